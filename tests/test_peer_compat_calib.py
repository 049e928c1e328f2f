"""Drop-in behaviour for pytorch-quantization and ModelOpt users (issue 14): calibrators, the documented calibration
loop, ModelOpt config entries (type, calibrator, lists -> SequentialQuantizer) and zero-argument forward loops."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import calib
from modelopt_lite import nn as quant_nn
from modelopt_lite.conversion.config import QuantConfigError
from modelopt_lite.functional import blocks
from modelopt_lite.nn import SequentialQuantizer, TensorQuantizer
from modelopt_lite.tensor_quant import QuantDescriptor, fake_block_quant, fake_tensor_quant, scaled_e4m3


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 256, generator=g) for _ in range(n)]


# --- calibrators -------------------------------------------------------------------------------------------------------
def test_histogram_calibrator_takes_the_peers_positional_arguments():
    x = torch.cat([torch.zeros(50), torch.arange(1.0, 11.0)])
    # (num_bits, axis, unsigned, num_bins, grow_method, skip_zeros, torch_hist)
    cal = calib.HistogramCalibrator(8, None, False, 2048, "append", True, False)
    cal.collect(x)
    assert (cal.num_bins, cal.skip_zeros, cal.num_collected) == (2048, True, 10)
    assert float(cal.compute_amax("percentile", percentile=50)) == 5.0
    for grow in (None, "stretch", "append"):  # all three grow the same exact grid
        other = calib.HistogramCalibrator(8, None, False, 2048, grow, True, True)
        other.collect(x)
        assert torch.equal(other.counts, cal.counts)


def test_histogram_compute_amax_keywords_are_the_peers():
    cal = calib.HistogramCalibrator(8, None, False)
    cal.collect(torch.arange(100.0))
    assert float(cal.compute_amax("percentile", stride=1, start_bin=128, percentile=90)) == 89.0
    with pytest.raises(TypeError, match="positional"):
        cal.compute_amax("mse", 2)  # keyword-only, as in the peers
    for exc in (TypeError, ValueError):
        with pytest.raises(exc, match="unknown method 'max'"):
            cal.compute_amax("max")


def test_max_calibrator_shape_change_raises_runtime_error_as_the_peers():
    cal = calib.MaxCalibrator(8, 0, False, True)  # (num_bits, axis, unsigned, track_amax)
    cal.collect(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    for exc in (RuntimeError, ValueError):
        with pytest.raises(exc, match=r"amax shape changed! \(2, 1\) before, \(3, 1\) now"):
            cal.collect(torch.ones(3, 2))
    assert torch.equal(cal.compute_amax(), torch.tensor([[2.0], [3.0]]))
    assert len(cal.amaxs) == 1


def test_load_calib_amax_before_data_says_calibrator_returned_none():
    q = TensorQuantizer(QuantDescriptor(num_bits=8), if_calib=True, if_quant=False)
    with pytest.raises(RuntimeError, match="Calibrator returned None"):
        q.load_calib_amax()
    q.disable()
    q.load_calib_amax()  # disabled and never fed: nothing to load, no error
    assert not q.has_amax


# --- pytorch-quantization's documented calibration loop, unmodified ------------------------------------------------------
def _collect_stats(model, batches):
    for name, module in model.named_modules():
        if name.endswith("_quantizer"):
            if module._calibrator is not None:
                module.disable_quant()
                module.enable_calib()
            else:
                module.disable()
    with torch.no_grad():
        for b in batches:
            model(b)
    for name, module in model.named_modules():
        if name.endswith("_quantizer"):
            if module._calibrator is not None:
                module.enable_quant()
                module.disable_calib()
            else:
                module.enable()


def _compute_amax(model, **kwargs):
    for name, module in model.named_modules():
        if name.endswith("_quantizer"):
            if module._calibrator is not None:
                if isinstance(module._calibrator, calib.MaxCalibrator):
                    module.load_calib_amax()
                else:
                    module.load_calib_amax(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"method": "percentile", "percentile": 99.9}, {"method": "entropy"}, {"method": "mse"}],
)
def test_documented_calibration_loop_runs_with_default_off_output_quantizers(kwargs):
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    if kwargs:
        cfg["quant_cfg"]["*input_quantizer"]["calib_method"] = "histogram"
    model = mtq.quantize(_mlp(), cfg)
    batches = _batches()
    _collect_stats(model, batches)
    _compute_amax(model, **kwargs)
    fc = model[0]
    assert not fc.output_quantizer.is_enabled and not fc.output_quantizer.has_amax
    x = torch.cat(batches)
    if kwargs:
        ref = calib.HistogramCalibrator(8, None, False)
        for b in batches:
            ref.collect(b)
        method = kwargs["method"]
        expect = ref.compute_amax(method, **{k: v for k, v in kwargs.items() if k != "method"})
    else:
        expect = x.abs().max()
    assert torch.equal(fc.input_quantizer.amax, expect)
    w = fc.weight.detach()
    assert torch.equal(fc.weight_quantizer.amax, w.abs().amax(1, keepdim=True))
    out = model[0](batches[0])
    ref_out = F.linear(
        fake_tensor_quant(batches[0], expect, 8, False, False),
        fake_tensor_quant(w, w.abs().amax(1, keepdim=True), 8, False, False),
        fc.bias,
    )
    assert torch.equal(out, ref_out)


# --- ModelOpt config entries --------------------------------------------------------------------------------------------
def test_type_and_calibrator_entries_translate():
    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            "0.input_quantizer": {"num_bits": 8, "type": "dynamic", "enable": True},
            "2.input_quantizer": {"num_bits": 8, "type": "static", "calibrator": "histogram", "enable": True},
            "*weight_quantizer": {"num_bits": 8, "axis": 0, "calibrator": calib.MaxCalibrator, "enable": True},
        },
        "algorithm": {"method": "percentile", "percentile": 99.0},
    }
    batches = _batches()
    model = mtq.quantize(_mlp(), cfg, lambda m: [m(b) for b in batches])
    assert model[0].input_quantizer.dynamic and not model[0].input_quantizer.has_amax
    q2 = model[2].input_quantizer
    assert (q2.dynamic, q2.quant_desc.calib_method) == (False, "histogram")
    assert model[0].weight_quantizer.quant_desc.calib_method == "max"
    ref = calib.HistogramCalibrator(8)
    fc = model[0]
    with torch.no_grad():
        for b in batches:  # what 2.input_quantizer saw: layer 0 with its dynamic input quantizer and float weights
            ref.collect(torch.relu(F.linear(fake_tensor_quant(b, b.abs().max(), 8, False, False), fc.weight, fc.bias)))
    assert torch.equal(q2.amax, ref.compute_amax("percentile", percentile=99.0))


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"type": "sometimes"}, r"'type' must be 'static' or 'dynamic', got 'sometimes'"),
        ({"type": "dynamic", "dynamic": False}, r"'type': 'dynamic' contradicts 'dynamic': False"),
        ({"calibrator": "mse"}, r"calibrator 'mse' is not supported"),
        (
            {"calibrator": "modelopt.torch.quantization.calib.MaxCalibrator"},
            r"calibrator 'modelopt.torch.quantization.calib.MaxCalibrator' is not supported.*never imported",
        ),
        ({"calibrator": nn.Linear}, r"calibrator class torch.nn.modules.linear.Linear has no collect\(\) method"),
        ({"calibrator": "max", "calib_method": "histogram"}, r"'calibrator': 'max' contradicts 'calib_method'"),
    ],
)
def test_bad_modelopt_entries_raise_naming_the_entry(attrs, message):
    with pytest.raises(QuantConfigError, match=r"quant_cfg\['\*input_quantizer'\]: " + message):
        mtq.quantize(_mlp(), {"quant_cfg": {"*input_quantizer": attrs}, "algorithm": None})


_W4A8 = {
    "quant_cfg": {
        "default": {"enable": False},
        "*weight_quantizer": [
            {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "enable": True},
            {"num_bits": (4, 3), "axis": None, "enable": True},
        ],
        "*input_quantizer": {"num_bits": (4, 3), "axis": None, "enable": True},
        "*lm_head*": {"enable": False},
    },
    "algorithm": "max",
}


def test_list_entry_makes_a_sequential_quantizer_calibrated_with_a_zero_argument_loop():
    model = _mlp()
    batches = _batches()

    def forward_loop():  # ModelOpt also accepts a loop that takes no argument
        for b in batches:
            model(b)

    mtq.quantize(model, _W4A8, forward_loop)
    wq = model[0].weight_quantizer
    assert isinstance(wq, SequentialQuantizer) and len(wq) == 2
    assert [q.name for q in wq] == ["0.weight_quantizer.0", "0.weight_quantizer.1"]
    w = model[0].weight.detach()
    assert torch.equal(wq[0].amax, blocks.block_amax(w, {-1: 128}))
    assert torch.equal(wq[1].amax, w.abs().max())  # each member collects the original weight
    x = batches[0]
    ref_w = scaled_e4m3(fake_block_quant(w, {-1: 128}, wq[0].amax, 4, False, False), wq[1].amax)
    amax_in = torch.stack([b.abs().max() for b in batches]).max()
    assert torch.equal(model[0].input_quantizer.amax, amax_in)
    assert torch.equal(model[0](x), F.linear(scaled_e4m3(x, amax_in), ref_w, model[0].bias))


def test_sequential_quantizer_replacement_is_undone_when_quantize_fails():
    model = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG)
    original = model[0].weight_quantizer

    def broken(m):
        m(_batches(1)[0])
        raise RuntimeError("loop failed")

    with pytest.raises(RuntimeError, match="loop failed"):
        mtq.quantize(model, _W4A8, broken)
    assert model[0].weight_quantizer is original
    with pytest.raises(TypeError, match="must take the model as its only argument, or no argument"):
        mtq.quantize(_mlp(), _W4A8, lambda a, b: None)


def test_sequential_quantizer_api():
    with pytest.raises(TypeError, match="argument 1 must be a TensorQuantizer"):
        SequentialQuantizer(TensorQuantizer(), nn.Identity())
    seq = SequentialQuantizer(TensorQuantizer(), TensorQuantizer())
    with pytest.raises(ValueError, match="of 2 quantizers got 3 attribute configs"):
        seq.set_from_attribute_config([{}, {}, {}])
    with pytest.raises(TypeError, match=r"SequentialQuantizer\[1\]:.*num_bitz"):
        seq.set_from_attribute_config([{"num_bits": 4}, {"num_bitz": 4}])
    seq.set_from_attribute_config({"num_bits": 6})
    assert [q.num_bits for q in seq] == [6, 6]
    x = torch.linspace(-3, 3, 13)
    seq.enable_calib()
    seq.disable_quant()
    seq(x)
    seq.load_calib_amax()
    seq.enable_quant()
    seq.disable_calib()
    assert torch.equal(seq(x), fake_tensor_quant(fake_tensor_quant(x, 3.0, 6, False, False), 3.0, 6, False, False))
    seq.disable()
    assert not seq.is_enabled and seq(x) is x
    assert list(SequentialQuantizer.tensor_quantizer_iterator(seq)) == list(seq)
    seq.reset_amax()
    assert not any(q.has_amax for q in seq)


def test_modelopt_calibrate_function_form():
    model = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG)
    batches = _batches()
    out = mtq.calibrate(
        model, algorithm={"method": "percentile", "percentile": 99.0}, forward_loop=lambda: [model(b) for b in batches]
    )
    assert out is model
    ref = calib.HistogramCalibrator(8)
    for b in batches:
        ref.collect(b)
    assert torch.equal(model[0].input_quantizer.amax, ref.compute_amax("percentile", percentile=99.0))
    mtq.calibrate(model, "max", lambda m: [m(b) for b in batches])
    assert torch.equal(model[0].input_quantizer.amax, torch.cat(batches).abs().max())
    assert quant_nn.SequentialQuantizer is SequentialQuantizer
