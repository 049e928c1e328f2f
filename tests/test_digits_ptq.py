"""Post-training quantization of the real digits models (CNN and MLP) with the presets and every calibration method."""

from __future__ import annotations

import copy

import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.conversion.model_quant import make_forward_loop
from modelopt_lite.conversion.utils import named_quantizers
from modelopt_lite.examples import accuracy, evaluate


def _acc(model, data):
    return accuracy(model, data.x_test, data.y_test)


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_int8_ptq_is_within_half_a_point_of_fp32(digits_model, digits_data, kind):
    model = digits_model(kind)
    fp32 = _acc(model, digits_data)
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_DEFAULT_CFG, make_forward_loop(digits_data.calib_batches(16, 64)))
    int8 = _acc(q, digits_data)
    assert fp32 > (98.0 if kind == "cnn" else 96.0)
    assert int8 >= fp32 - 0.5, (kind, fp32, int8)
    enabled = [n for n, tq in named_quantizers(q) if tq.is_enabled]
    assert all(tq.has_amax for n, tq in named_quantizers(q) if tq.is_enabled)
    assert len(enabled) == 6  # input + weight quantizers of the 3 Linear/Conv layers
    assert torch.equal(q(digits_data.x_test[:7]), q(digits_data.x_test[:7]))  # deterministic
    assert not torch.equal(evaluate(q, digits_data.x_test), evaluate(model, digits_data.x_test))  # really quantized


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_every_calibration_method_and_fp8(digits_model, digits_data, kind):
    model = digits_model(kind)
    fp32 = _acc(model, digits_data)
    batches = digits_data.calib_batches(8, 64)
    first_in = "conv1.input_quantizer" if kind == "cnn" else "body.0.input_quantizer"
    last_in = "fc.input_quantizer" if kind == "cnn" else "head.input_quantizer"
    amax = {}
    for method in ("max", {"method": "percentile", "percentile": 99.9}, "mse", "entropy", "histogram"):
        cfg = dict(mtq.INT8_DEFAULT_CFG, algorithm=method)
        q = mtq.quantize(copy.deepcopy(model), cfg, make_forward_loop(batches))
        name = method if isinstance(method, str) else method["method"]
        acc = _acc(q, digits_data)
        assert acc >= fp32 - 1.5, (kind, name, acc, fp32)
        qs = dict(named_quantizers(q))
        amax[name] = float(qs[last_in].amax)
        assert qs[first_in].quant_desc.calib_method == ("max" if name == "max" else "histogram")
    seen = []
    layer = model.fc if kind == "cnn" else model.head
    handle = layer.register_forward_hook(lambda m, inp, out: seen.append(inp[0].abs().max()))
    with torch.no_grad():
        for b in batches:
            model(b)
    handle.remove()
    assert amax["max"] == float(torch.stack(seen).max())  # max calibration sees the float activations exactly
    for name in ("percentile", "mse", "histogram"):
        assert amax[name] < amax["max"], (name, amax)  # these histogram methods clip the tail of the activations
    assert amax["entropy"] <= amax["max"] * 1.01  # entropy may keep the whole range (up to one bin above max)
    assert len(set(amax.values())) >= 4
    fp8 = mtq.quantize(copy.deepcopy(model), mtq.FP8_DEFAULT_CFG, make_forward_loop(batches))
    assert {tq.quant_desc.num_bits for _, tq in named_quantizers(fp8) if tq.is_enabled} == {(4, 3)}
    assert _acc(fp8, digits_data) >= fp32 - 1.0


@pytest.mark.parametrize(
    "cfg_name, tol",
    [("INT8_HISTOGRAM_CFG", 1.0), ("INT8_ORT_CFG", 1.0), ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", 2.0), ("W4A8_CFG", 2.0)],
)
def test_other_presets_on_the_cnn(digits_model, digits_data, cfg_name, tol):
    model = digits_model("cnn")
    fp32 = _acc(model, digits_data)
    q = mtq.quantize(copy.deepcopy(model), getattr(mtq, cfg_name), make_forward_loop(digits_data.calib_batches(8)))
    assert _acc(q, digits_data) >= fp32 - tol
    rows = {r["name"]: r for r in mtq.summary(q)}
    if cfg_name.startswith(("INT4", "W4")):
        assert rows["conv1.weight_quantizer"]["granularity"] == "blocks{-1:128}"
        assert rows["conv1.input_quantizer"]["enabled"] == (cfg_name == "W4A8_CFG")
    if cfg_name == "INT8_ORT_CFG":
        assert rows["conv1.output_quantizer"]["calibrated"] and rows["fc.output_quantizer"]["enabled"]
