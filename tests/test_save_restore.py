"""modelopt_lite.save / restore: a fresh float model re-quantized from the files gives bit-identical outputs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.conversion.model_quant import make_forward_loop
from modelopt_lite.conversion.utils import named_quantizers
from modelopt_lite.examples import MLP
from modelopt_lite.examples.denoiser import DenoiserMLP, NoiseSchedule, step_batches


def _same_quant_state(a, b):
    qa, qb = dict(named_quantizers(a)), dict(named_quantizers(b))
    assert qa.keys() == qb.keys()
    for n, x in qa.items():
        y = qb[n]
        assert x.quant_desc == y.quant_desc, n
        assert (x.is_enabled, x.is_quant_enabled, x.is_calib_enabled, x.num_steps) == (
            y.is_enabled,
            y.is_quant_enabled,
            y.is_calib_enabled,
            y.num_steps,
        ), n
        assert x.has_amax == y.has_amax, n
        if x.has_amax:
            assert type(x._amax) is type(y._amax) and torch.equal(x._amax, y._amax), n


@pytest.mark.parametrize(
    "kind, cfg_name",
    [("cnn", "INT8_DEFAULT_CFG"), ("mlp", "INT8_HISTOGRAM_CFG"), ("mlp", "FP8_DEFAULT_CFG"), ("cnn", "W4A8_CFG")],
)
def test_save_restore_into_a_fresh_float_model_is_bit_identical(tmp_path, digits_model, digits_data, kind, cfg_name):
    cfg = getattr(mtq, cfg_name)
    model = mtq.quantize(digits_model(kind), cfg, make_forward_loop(digits_data.calib_batches(4, 64)))
    model.fc.input_quantizer.disable() if kind == "cnn" else model.body[0].weight_quantizer.disable_quant()
    json_path, st_path = mtq.save(model, tmp_path / "q.json")
    assert (json_path.name, st_path.name) == ("q.json", "q.safetensors")
    fresh = digits_model(kind)
    restored = mtq.restore(fresh, tmp_path / "q")
    assert restored is fresh
    _same_quant_state(model, fresh)
    x = digits_data.x_test
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))
    assert [type(m) for m in fresh.modules()] == [type(m) for m in model.modules()]
    assert all(q.name == n for n, q in named_quantizers(fresh))


def test_saved_files_content(tmp_path):
    model = mtq.quantize(nn.Sequential(nn.Linear(4, 3)), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.ones(2, 4)))
    j, s = mtq.save(model, tmp_path / "a.safetensors")
    doc = json.loads(j.read_text())
    assert doc["format"] == "modelopt_lite.quant_state" and doc["version"] == 1
    assert doc["modules"] == [
        {
            "name": "0",
            "float_cls": "torch.nn.modules.linear.Linear",
            "quant_cls": "modelopt_lite.nn.modules.quant_linear.QuantLinear",
            "params": {"weight": [3, 4], "bias": [3]},
            "requant": "float",
        }
    ]
    w = doc["quantizers"]["0.weight_quantizer"]
    assert w["enabled"] and w["quant"] and not w["calib"] and w["num_steps"] == 1
    assert w["descriptor"] == {"axis": 0} and w["tensors"] == ["_amax"]
    assert doc["quantizers"]["0.output_quantizer"]["enabled"] is False
    from safetensors.torch import load_file

    t = load_file(str(s))
    assert sorted(t) == ["0.input_quantizer._amax", "0.weight_quantizer._amax"]
    assert t["0.input_quantizer._amax"].item() == 1.0 and t["0.weight_quantizer._amax"].shape == (3, 1)


def test_temporal_learned_and_block_state_round_trip(tmp_path):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        float_model = DenoiserMLP(num_steps=5)
    sched = NoiseSchedule.geometric(5)
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*input_quantizer"]["num_steps"] = 5
    cfg["quant_cfg"]["out.weight_quantizer"] = {"learn_amax": True, "num_bits": 4}
    cfg["quant_cfg"]["body.0.weight_quantizer"] = {"num_bits": 4, "block_sizes": {-1: 16, "scale_bits": 8}}
    batches = step_batches(sched, 32, seed=0)

    def loop(m):
        for x, t in batches:
            with mtq.quant_step(m, t):
                m(x, t)

    model = mtq.quantize(copy.deepcopy(float_model), cfg, loop)
    assert isinstance(model.out.weight_quantizer._amax, nn.Parameter)
    with torch.no_grad():
        model.out.weight_quantizer._amax.mul_(0.9)  # as if trained
    mtq.save(model, tmp_path / "d")
    fresh = mtq.restore(copy.deepcopy(float_model), tmp_path / "d")
    _same_quant_state(model, fresh)
    assert fresh.inp.input_quantizer._amax.shape == (5,)
    assert fresh.body[0].weight_quantizer.quant_desc.block_sizes == {-1: 16, "scale_bits": 8}
    for x, t in batches:
        with mtq.quant_step(model, t), mtq.quant_step(fresh, t), torch.no_grad():
            assert torch.equal(model(x, t), fresh(x, t))


def test_include_weights_restores_fine_tuned_weights(tmp_path, digits_data):
    model = mtq.quantize(MLP(64, 32, 10, 1), mtq.INT8_DEFAULT_CFG, make_forward_loop(digits_data.calib_batches(2)))
    with torch.no_grad():
        model.head.weight.add_(0.01)  # as if fine-tuned after quantization
    mtq.save(model, tmp_path / "w", include_weights=True)
    fresh = mtq.restore(MLP(64, 32, 10, 1), tmp_path / "w")
    with torch.no_grad():
        assert torch.equal(model(digits_data.x_test), fresh(digits_data.x_test))


def _conv_first():
    m = MLP(64, 32, 10, 2)
    m.body[0] = nn.Conv1d(64, 32, 1)
    return m


@pytest.mark.parametrize(
    "make_other, message",
    [
        (
            lambda: MLP(64, 16, 10, 2),
            (
                r"module 'body.0' has parameters \{'weight': \[16, 64\], 'bias': \[16\]\}, "
                r"the saved state has \{'weight': \[32, 64\], 'bias': \[32\]\}"
            ),
        ),
        (lambda: MLP(64, 32, 10, 1), r"module 'body.2' of the saved state does not exist in the model"),
        (lambda: MLP(64, 32, 10, 3), r"module 'body.4' \(Linear\) is not quantized in the saved state"),
        (
            _conv_first,
            (
                r"module 'body.0' is a torch.nn.modules.conv.Conv1d, the saved state has "
                r"torch.nn.modules.linear.Linear \(quantized as "
                r"modelopt_lite.nn.modules.quant_linear.QuantLinear\)"
            ),
        ),
    ],
)
def test_mismatched_model_raises_naming_the_first_differing_module(tmp_path, make_other, message):
    model = mtq.quantize(MLP(64, 32, 10, 2), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.rand(4, 64)))
    mtq.save(model, tmp_path / "m")
    other = make_other()
    types_before = [type(m) for m in other.modules()]
    with pytest.raises(ValueError, match=message):
        mtq.restore(other, tmp_path / "m")
    assert [type(m) for m in other.modules()] == types_before  # untouched


def test_restore_rejects_foreign_files(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match=r"x.json is not a modelopt_lite.quant_state v1 file"):
        mtq.restore(MLP(), tmp_path / "x.json")
