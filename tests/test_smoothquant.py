"""SmoothQuant: the pre_quant_scale of a quantizer, the smoothing algorithm, config, export, save and errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.nn import TensorQuantizer


class Attention(nn.Module):
    """Three projections reading one input (a shared smoothing vector), then a down projection."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.down = nn.Linear(d, 8)

    def forward(self, x):
        return self.down(torch.relu(self.q(x) + self.k(x) * self.v(x)))


def _data(seed=0, outlier=40.0):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(4):
        x = torch.randn(32, 16, generator=gen)
        x[:, 3] *= outlier  # one outlier channel: what SmoothQuant is for
        batches.append(x)
    return batches


def _loop(batches):
    def loop(m):
        for b in batches:
            m(b)

    return loop


# --- the quantizer's pre_quant_scale ------------------------------------------------------------------------------
def test_pre_quant_scale_multiplies_first_in_every_mode():
    q = TensorQuantizer(amax=4.0)
    q.pre_quant_scale = torch.tensor([1.0, 2.0, 0.5])
    x = torch.tensor([[1.0, 1.5, 3.0]])
    assert torch.equal(q(x), mtq.fake_tensor_quant(x * torch.tensor([1.0, 2.0, 0.5]), torch.tensor(4.0)))
    q.disable()  # the weights were rescaled: the multiply must stay
    assert torch.equal(q(x), torch.tensor([[1.0, 3.0, 1.5]]))
    assert torch.equal(x, torch.tensor([[1.0, 1.5, 3.0]]))  # the caller's tensor is untouched
    assert repr(q) == "TensorQuantizer(disabled, pre_quant_scale(3))"


def test_pre_quant_scale_state_dict_round_trip_and_errors():
    q = TensorQuantizer(amax=2.0, name="blk.input_quantizer")
    q.pre_quant_scale = torch.tensor([0.5, 4.0])
    fresh = TensorQuantizer()
    fresh.load_state_dict(q.state_dict())
    assert fresh.pre_quant_scale.dtype == torch.float32 and torch.equal(fresh.pre_quant_scale, q.pre_quant_scale)
    with pytest.raises(ValueError, match=r"'blk.input_quantizer': pre_quant_scale must be finite and > 0, got 0.0"):
        q.pre_quant_scale = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match=r"pre_quant_scale must be a non-empty 1-D tensor .* got shape \(2, 1\)"):
        q.pre_quant_scale = torch.ones(2, 1)
    with pytest.raises(TypeError, match=r"pre_quant_scale must be a tensor or None, got list"):
        q.pre_quant_scale = [1.0, 2.0]
    with pytest.raises(ValueError, match=r"pre_quant_scale has 2 channels but the input's last dimension is 3"):
        q(torch.ones(4, 3))
    other = TensorQuantizer()
    other.pre_quant_scale = torch.ones(3)
    with pytest.raises(
        ValueError,
        match=r"pre_quant_scale in the state dict has shape \(2,\) but this quantizer's "
        r"has shape \(3,\)",
    ):
        other.load_state_dict(q.state_dict())
    q.pre_quant_scale = None
    assert q.pre_quant_scale is None and "_pre_quant_scale" not in q.state_dict()


# --- the algorithm --------------------------------------------------------------------------------------------------
def test_smoothing_formula_shared_groups_and_float_equivalence():
    torch.manual_seed(0)
    model = Attention().eval()
    batches = _data()
    q = copy.deepcopy(model)
    mtq.quantize(q, mtq.INT8_DEFAULT_CFG)  # converted, not calibrated
    w_before = {n: getattr(q, n).weight.detach().clone() for n in ("q", "k", "v", "down")}
    groups = mtq.smooth_quant(q, _loop(batches), alpha=0.5)
    assert sorted(groups) == [["down"], ["k", "q", "v"]]
    # the formula, by hand, for the shared q/k/v group
    a = torch.cat(batches).abs().amax(0)
    w = torch.stack([w_before[n].abs().amax(0) for n in "qkv"]).amax(0)
    s = (a.pow(0.5) / w.pow(0.5)).clamp(1e-5, 1e5)
    for n in "qkv":
        mod = getattr(q, n)
        assert torch.equal(mod.weight, w_before[n] * s)
        assert torch.equal(mod.input_quantizer.pre_quant_scale, 1.0 / s)
    # with every quantizer off, the smoothed model is the float model up to float rounding
    for _, tq in mtq.conversion.named_quantizers(q):
        tq.disable()
    x = torch.cat(batches)
    with torch.no_grad():
        assert torch.allclose(q(x), model(x), rtol=1e-5, atol=1e-5)


def test_smoothquant_config_beats_plain_max_on_an_outlier_channel():
    torch.manual_seed(1)
    model = Attention().eval()
    batches = _data(outlier=80.0)
    x = torch.cat(_data(seed=7, outlier=80.0))
    with torch.no_grad():
        ref = model(x)
    errs = {}
    for name, cfg in [("max", mtq.INT8_DEFAULT_CFG), ("smoothquant", mtq.INT8_SMOOTHQUANT_CFG)]:
        q = mtq.quantize(copy.deepcopy(model), cfg, _loop(batches))
        with torch.no_grad():
            errs[name] = (q(x) - ref).pow(2).mean().item()
    assert errs["smoothquant"] < 0.5 * errs["max"], errs
    assert mtq.INT8_SMOOTHQUANT_CFG["algorithm"] == {"method": "smoothquant", "alpha": 0.8}


def test_config_and_calibrate_errors():
    model = Attention()
    with pytest.raises(ValueError, match=r"smoothquant alpha must be a number in \[0, 1\], got 1.5"):
        mtq.quantize(copy.deepcopy(model), {"quant_cfg": {}, "algorithm": {"method": "smoothquant", "alpha": 1.5}})
    with pytest.raises(ValueError, match=r"algorithm 'smoothquant' got unknown parameter\(s\) \['beta'\]"):
        mtq.quantize(copy.deepcopy(model), {"quant_cfg": {}, "algorithm": {"method": "smoothquant", "beta": 1}})
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_DEFAULT_CFG, _loop(_data()))
    with (
        pytest.raises(ValueError, match=r"'smoothquant' is an algorithm of quantize\(\)"),
        mtq.calibrate(q, "smoothquant"),
    ):
        pass


def test_failed_calibration_restores_the_weights():
    torch.manual_seed(2)
    model = Attention().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def loop(m):
        calls.append(1)
        m(_data()[0])
        if len(calls) == 2:  # the calibration pass, after the smoothing pass
            raise RuntimeError("data loader died")

    with pytest.raises(RuntimeError, match="data loader died"):
        mtq.quantize(model, mtq.INT8_SMOOTHQUANT_CFG, loop)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not any(isinstance(m, mtq.TensorQuantizer) for m in model.modules())


# --- export, save, fake2real ----------------------------------------------------------------------------------------
def test_export_shares_one_mul_and_qdq_for_q_k_v_and_ort_agrees(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnx

    from modelopt_lite.onnx_export.ort_runner import ort_session

    torch.manual_seed(3)
    batches = _data()
    q = mtq.quantize(Attention().eval(), mtq.INT8_SMOOTHQUANT_CFG, _loop(batches))
    rep = mtq.export_onnx(q, batches[0], tmp_path / "sq.onnx", dynamic_axes={"input": {0: "batch"}})
    assert rep.merged == 2  # k and v reuse q's Mul and Q/DQ
    nodes = onnx.load(str(tmp_path / "sq.onnx")).graph.node
    assert [n.op_type for n in nodes].count("QuantizeLinear") == 2  # one for q/k/v, one for down
    x = torch.cat(batches)
    got = ort_session(tmp_path / "sq.onnx", optimize=False).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        want = q(x).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_save_needs_the_weights_and_restores_exactly(tmp_path):
    torch.manual_seed(4)
    model = Attention().eval()
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_SMOOTHQUANT_CFG, _loop(_data()))
    with pytest.raises(
        ValueError,
        match=r"save: 4 quantizer\(s\) have a SmoothQuant pre_quant_scale .* "
        r"save with include_weights=True",
    ):
        mtq.save(q, tmp_path / "sq")
    mtq.save(q, tmp_path / "sq", include_weights=True)
    fresh = mtq.restore(copy.deepcopy(model), tmp_path / "sq")
    x = torch.cat(_data(seed=9))
    with torch.no_grad():
        assert torch.equal(fresh(x), q(x))


def test_fake2real_keeps_the_pre_quant_scale_and_checkpoints_it(tmp_path):
    torch.manual_seed(5)
    q = mtq.quantize(Attention().eval(), mtq.INT8_SMOOTHQUANT_CFG, _loop(_data()))
    fake = copy.deepcopy(q)
    real = mtq.fake2real(q, save_dir=tmp_path / "real")
    x = torch.cat(_data(seed=6))
    for name in ("q", "k", "v", "down"):
        rm, fm = getattr(real, name), getattr(fake, name)
        assert torch.equal(rm.pre_quant_scale, fm.input_quantizer.pre_quant_scale)
        assert rm.compute == "int8"
        xin = x if name != "down" else torch.relu(x[:, :16])
        with torch.no_grad():
            d = (rm(xin) - fm(xin)).abs()
        assert bool((d <= rm.error_bound(xin)).all()), name  # integer product exact; float32 accumulation bound
    loaded = mtq.load_real(Attention().eval(), tmp_path / "real")
    with torch.no_grad():
        assert torch.equal(loaded(x), real(x))


def test_fake2real_refuses_a_pre_quant_scale_on_a_conv():
    conv = mtq.quantize(nn.Sequential(nn.Conv2d(3, 4, 3)), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(2, 3, 8, 8)))
    conv[0].input_quantizer.pre_quant_scale = torch.ones(8)
    with pytest.raises(
        ValueError,
        match=r"fake2real: module '0': input_quantizer has a SmoothQuant pre_quant_scale, "
        r"which real modules support only on a Linear input",
    ):
        mtq.fake2real(conv)
