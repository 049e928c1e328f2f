"""The torch_quantizer-style workflow: fake_quant -> run data -> fake2real(save_dir) -> real_quant."""

import pytest
import torch
from real_helpers import data, float_model

import modelopt_lite as mtl
from modelopt_lite.calib import HistogramCalibrator
from modelopt_lite.examples import DigitsMLP
from modelopt_lite.real import fake_quant, real_quant, seed_config

WQ = {"n_bits": 8, "channel_wise": True, "scale_method": "max"}
AQ = {"n_bits": 8, "channel_wise": False, "scale_method": "mse"}


def test_seed_params_map_onto_config():
    cfg = seed_config(WQ, AQ, num_steps=3)
    qc = cfg["quant_cfg"]
    assert qc["*weight_quantizer"] == {"num_bits": 8, "axis": 0, "calib_method": "max", "enable": True}
    assert qc["*input_quantizer"] == {
        "num_bits": 8,
        "axis": None,
        "enable": True,
        "num_steps": 3,
        "calib_method": "histogram",
    }
    from modelopt_lite.conversion.config import CONVTRANSPOSE_WEIGHT_AXIS

    assert qc["nn.ConvTranspose2d"]["*weight_quantizer"]["axis"] == CONVTRANSPOSE_WEIGHT_AXIS
    assert cfg["algorithm"] is None


def test_fake_quant_with_forward_loop_calibrates_as_specified():
    batches = data().calib_batches(4, 64)
    fq = fake_quant(float_model("mlp"), WQ, AQ, forward_loop=lambda m: [m(b) for b in batches])
    w = fq.body[0].weight.detach()
    assert torch.equal(fq.body[0].weight_quantizer.amax.flatten(), w.abs().amax(1))
    hist = HistogramCalibrator()
    for b in batches:
        hist.collect(b.flatten(1))
    assert torch.equal(fq.body[0].input_quantizer.amax, hist.compute_amax("mse"))
    assert not fq.body[0].input_quantizer.is_calib_enabled


def test_seed_workflow_without_loop(tmp_path):
    fq = fake_quant(float_model("mlp"), WQ, AQ)
    assert fq.body[0].input_quantizer.is_calib_enabled and not fq.body[0].input_quantizer.is_quant_enabled
    with torch.no_grad():
        for b in data().calib_batches(4, 64):  # "run your model": statistics are collected
            fq(b)
    ref = fake_quant(float_model("mlp"), WQ, AQ, forward_loop=lambda m: [m(b) for b in data().calib_batches(4, 64)])
    real = mtl.fake2real(fq, save_dir=tmp_path)  # finishes calibration, converts, saves
    for name in ("body.0", "body.2", "head"):  # same statistics, same amax as the one-call form
        amax = ref.get_submodule(name).input_quantizer.amax
        assert torch.equal(real.get_submodule(name).input_scale, (amax / 127).reshape(1))
    x = data().x_test
    with torch.no_grad():
        assert float((ref(x) - real(x)).abs().max()) < 0.05  # float rounding (+ rare tie flips downstream)
        loaded = real_quant(DigitsMLP().eval(), 8, 1, tmp_path)
        assert torch.equal(loaded(x), real(x))


def test_temporal_steps_survive_conversion(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fq = fake_quant(model, WQ, {"n_bits": 8, "scale_method": "max"}, num_steps=2)
    with torch.no_grad():
        for t, scale in ((0, 1.0), (1, 10.0)):
            with mtl.quant_step(fq, t):
                fq(torch.randn(32, 16) * scale)
    real = mtl.fake2real(fq, inplace=False)
    assert real[0].input_scale.shape == (2,) and real[0].input_scale[1] > 5 * real[0].input_scale[0]
    x = torch.randn(5, 16) * 3
    for t in (0, 1):
        with torch.no_grad(), mtl.quant_step(fq, t), mtl.quant_step(real, t):
            assert real[0].step == t
            assert float((fq(x) - real(x)).abs().max()) < 1e-5
    assert real[0].step == 0
    mtl.fake2real(fq, save_dir=tmp_path, inplace=False)
    with pytest.raises(ValueError, match="num_steps=2; expected n_bits=8, num_steps=1"):
        real_quant(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)), 8, 1, tmp_path)


def test_bad_seed_params():
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['bits'\]"):
        fake_quant(float_model("mlp"), {"bits": 8}, AQ)
    with pytest.raises(ValueError, match="scale_method'\\] must be one of"):
        seed_config(WQ, {"scale_method": "minmax"})
    with pytest.raises(ValueError, match="channel_wise'\\]=True is not supported"):
        seed_config(WQ, {"channel_wise": True})
    with pytest.raises(ValueError, match="n_bits'\\] must be an int in 2..8"):
        seed_config({"n_bits": 16}, AQ)
