"""modelopt_lite.calibrate (context manager): modes, amax loading, exact restoration on errors, methods, helpers."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.calib import HistogramCalibrator
from modelopt_lite.conversion.config import normalize_config
from modelopt_lite.conversion.model_quant import (
    _calibrators,
    calibrate_loop,
    make_forward_loop,
)
from modelopt_lite.conversion.registry import QuantModuleRegistry
from modelopt_lite.conversion.utils import named_quantizers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _model(cfg=mtq.INT8_DEFAULT_CFG):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = Net().eval()
    return mtq.quantize(net, cfg)


def _x(seed, n=16, scale=1.0):
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed)) * scale


def _state(model):
    """Everything observable about every quantizer (flags, descriptor, step, amax, calibrator statistics)."""
    out = {}
    for n, q in named_quantizers(model):
        stats = []
        for cal in _calibrators(q):
            counts = getattr(cal, "counts", None)
            stats.append(counts.clone() if counts is not None else cal.compute_amax())
        out[n] = (
            q.is_enabled,
            q.is_quant_enabled,
            q.is_calib_enabled,
            q.quant_desc,
            q.num_steps,
            q.step,
            q._amax.detach().clone() if q.has_amax else None,
            type(q._amax).__name__,
            stats,
        )
    return out


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for n in a:
        for x, y in zip(a[n], b[n]):
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                assert x is not None and y is not None and torch.equal(x, y), n
            elif isinstance(x, list):
                assert len(x) == len(y)
                for u, v in zip(x, y):
                    assert (u is None and v is None) or torch.equal(u, v), n
            else:
                assert x == y, (n, x, y)


def test_modes_inside_the_block_and_amax_after():
    model = _model()
    ref = copy.deepcopy(model)
    x = _x(0)
    inside = {}
    with warnings.catch_warnings(record=True) as caught, mtq.calibrate(model) as m:
        warnings.simplefilter("always")
        assert m is model
        for n, q in named_quantizers(model):
            inside[n] = (q.is_enabled, q.is_quant_enabled, q.is_calib_enabled)
        for _, q in named_quantizers(ref):
            q.disable()
        assert torch.equal(model(x), ref(x))  # quantization is off while collecting
    assert [str(w.message)[:35] for w in caught] == ["calibrate: 2 quantizer(s) saw no da"]  # the unused layer
    assert inside["conv.input_quantizer"] == (True, False, True)
    assert inside["conv.output_quantizer"] == (False, True, False)  # disabled quantizers are left alone
    for n, q in named_quantizers(model):
        if q.is_enabled and n.split(".")[0] != "unused":
            assert (q.is_quant_enabled, q.is_calib_enabled, q.has_amax) == (True, False, True), n
    assert torch.equal(model.conv.input_quantizer.amax, x.abs().max())
    assert torch.equal(model.conv.weight_quantizer.amax, model.conv.weight.detach().abs().amax((1, 2, 3), keepdim=True))
    fc_in = torch.relu(ref.conv(x)).flatten(1)
    assert torch.equal(model.fc.input_quantizer.amax, fc_in.abs().max())


def test_quantizer_without_data_keeps_state_and_is_named_in_a_warning():
    model = _model()
    with (
        pytest.warns(
            UserWarning,
            match=r"calibrate: 2 quantizer\(s\) saw no data and were left as they were: "
            r"unused.input_quantizer, unused.weight_quantizer$",
        ),
        mtq.calibrate(model),
    ):
        model(_x(0))
    assert not model.unused.input_quantizer.has_amax and model.unused.input_quantizer.is_quant_enabled
    assert not model.unused.input_quantizer.is_calib_enabled
    model.unused.input_quantizer.amax = 3.0
    before = _state(model)["unused.input_quantizer"]
    with pytest.warns(UserWarning, match="saw no data"), mtq.calibrate(model, "percentile"):
        model(_x(0))
    assert model.conv.input_quantizer.quant_desc.calib_method == "histogram"
    _assert_same_state({"u": before}, {"u": _state(model)["unused.input_quantizer"]})  # not switched, amax kept
    # an uncalibrated quantizer quantizes with the tensor's own max (as in pytorch-quantization/ModelOpt), storing nothing
    wq = model.unused.weight_quantizer
    w = model.unused.weight.detach()
    assert torch.equal(wq.amax, w.abs().amax(1, keepdim=True))  # quantize() without a loop calibrated the weights
    wq.reset_amax()
    assert torch.equal(wq(w), mtq.fake_tensor_quant(w, w.abs().amax(1, keepdim=True), 8, False, False))
    assert not wq.has_amax and wq.amax is None


def test_exception_in_block_restores_every_quantizer_exactly():
    model = _model()
    with warnings.catch_warnings(), mtq.calibrate(model):
        warnings.simplefilter("ignore")
        model(_x(0))
    before = _state(model)
    cal_ids = {n: id(q.calibrator) for n, q in named_quantizers(model)}
    out_before = model(_x(5))
    for method in ("max", "percentile", "entropy"):
        with pytest.raises(RuntimeError, match="boom"), mtq.calibrate(model, method):
            model(_x(1, scale=30.0))
            expected = "max" if method == "max" else "histogram"
            assert model.conv.input_quantizer.quant_desc.calib_method == expected
            raise RuntimeError("boom")
        _assert_same_state(before, _state(model))
        assert {n: id(q.calibrator) for n, q in named_quantizers(model)} == cal_ids
        assert torch.equal(model(_x(5)), out_before)


def test_error_while_computing_amax_restores_too():
    model = _model(mtq.FP8_DEFAULT_CFG)
    before = _state(model)
    # the KL search is defined for integer grids only: the error comes on exit, after the data ran
    with pytest.raises(ValueError, match="entropy"), mtq.calibrate(model, "entropy"):
        model(_x(0))
    _assert_same_state(before, _state(model))
    assert not model.conv.input_quantizer.has_amax


def test_bad_method_or_parameter_raises_before_anything_runs():
    model = _model()
    before = _state(model)
    with pytest.raises(ValueError, match="unknown calibration method 'minmax'"), mtq.calibrate(model, "minmax"):
        pytest.fail("the block must not run")
    with (
        pytest.raises(ValueError, match=r"method 'percentile' got unknown parameter\(s\) \['start_bin'\]"),
        mtq.calibrate(model, "percentile", start_bin=3),
    ):
        pytest.fail("the block must not run")
    _assert_same_state(before, _state(model))


def test_histogram_calibrators_work_with_algorithm_max():
    """ModelOpt #63/#200: "max" with HistogramCalibrator quantizers fails there; here each uses its default."""
    cfg = copy.deepcopy(mtq.INT8_HISTOGRAM_CFG)
    cfg["algorithm"] = "max"
    batches = [_x(i) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model(cfg)
        mtq.quantize(model, cfg, make_forward_loop(batches))
    ref = HistogramCalibrator(8)
    for b in batches:
        ref.collect(b)
    assert model.conv.input_quantizer.quant_desc.calib_method == "histogram"
    assert torch.equal(model.conv.input_quantizer.amax, ref.compute_amax("percentile", percentile=99.99))
    w = model.conv.weight.detach()
    assert torch.equal(model.conv.weight_quantizer.amax, w.abs().amax((1, 2, 3), keepdim=True))  # weights: max


@pytest.mark.parametrize(
    "method, kwargs", [("percentile", {"percentile": 99.0}), ("mse", {}), ("entropy", {"start_bin": 64})]
)
def test_histogram_methods_switch_per_tensor_quantizers_only(method, kwargs):
    model = _model()
    batches = [_x(i) for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mtq.calibrate(model, method, **kwargs):
            for b in batches:
                model(b)
    ref = HistogramCalibrator(8)
    for b in batches:
        ref.collect(b)
    q = model.conv.input_quantizer
    assert q.quant_desc.calib_method == "histogram"
    assert torch.equal(q.amax, ref.compute_amax(method, **kwargs))
    assert model.conv.weight_quantizer.quant_desc.calib_method == "max"
    assert torch.equal(model.conv.weight_quantizer.amax, model.conv.weight.detach().abs().amax((1, 2, 3), keepdim=True))


def test_dynamic_and_fixed_amax_quantizers_are_not_calibrated():
    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            "conv.input_quantizer": {"enable": True, "dynamic": True},
            "fc.input_quantizer": {"enable": True, "amax": 2.5},
            "fc.weight_quantizer": {"enable": True, "axis": 0},
        },
        "algorithm": "max",
    }
    model = _model(cfg)
    with mtq.calibrate(model):
        assert model.conv.input_quantizer.is_quant_enabled and not model.conv.input_quantizer.is_calib_enabled
        assert model.fc.input_quantizer.is_quant_enabled and not model.fc.input_quantizer.is_calib_enabled
        model(_x(0, scale=50.0))
    assert not model.conv.input_quantizer.has_amax
    assert model.fc.input_quantizer.amax.item() == 2.5
    assert model.fc.weight_quantizer.has_amax


def test_calibrate_loop_batches_modes_and_progress(capsys):
    seen = []

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, a, b=None):
            seen.append((self.training, self.drop.training, a.shape, None if b is None else b.shape))
            return a

    m = Rec().train()
    n = calibrate_loop(
        m, [torch.zeros(2), (torch.zeros(3), torch.zeros(1)), {"a": torch.zeros(4), "b": None}], progress=False
    )
    assert n == 3 and [s[:2] for s in seen] == [(False, False)] * 3
    assert [s[2] for s in seen] == [(2,), (3,), (4,)] and seen[1][3] == (1,)
    assert m.training and m.drop.training  # restored
    assert capsys.readouterr().out == ""
    loop = make_forward_loop(iter([torch.zeros(1)] * 2))
    assert loop(m) == 2 and loop(m) == 2  # the batches are kept, so the loop can run again


def test_quant_modules_enable_and_calibrate_restore_global_state_on_errors():
    from modelopt_lite import quant_modules
    from modelopt_lite.nn import QuantLinear

    original = torch.nn.Linear
    model = None
    with pytest.raises(ZeroDivisionError), quant_modules.enable():
        assert torch.nn.Linear is QuantLinear
        # conversion looks classes up where torch defines them, which quant_modules never patches
        assert QuantModuleRegistry.get(torch.nn.modules.linear.Linear) is QuantLinear
        rule = normalize_config({"quant_cfg": {"nn.Linear": {"*": {"enable": False}}}}).rules[0]
        assert rule.owner_cls is original
        model = nn.Sequential(torch.nn.Linear(4, 4))
        mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(3, 4)))
        before = _state(model)
        with mtq.calibrate(model, "percentile"):
            model(torch.randn(3, 4) * 100)
            raise ZeroDivisionError("in the middle of calibration")
    assert torch.nn.Linear is original and nn.Linear is original
    assert type(model[0]) is QuantLinear
    _assert_same_state(before, _state(model))
    m2 = mtq.quantize(nn.Sequential(nn.Linear(2, 2)), mtq.INT8_DEFAULT_CFG)
    assert type(m2[0]) is QuantLinear


def test_max_after_an_entropy_pass_loads_the_max_not_a_histogram_amax():
    """Issue 13: the entropy pass left calib_method="histogram"; a later "max" pass answered with its percentile."""
    model = _model()
    x = _x(7, n=512)
    x[0, 0, 0, 0] = 40.0  # one outlier among 32768 values: the 99.99th percentile leaves it out, max does not
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mtq.calibrate(model, "entropy"):
            model(x)
        q = model.conv.input_quantizer
        assert q.quant_desc.calib_method == "histogram" and float(q.amax) < 10.0
        with mtq.calibrate(model, method="max"):
            model(x)
    assert q.quant_desc.calib_method == "max"
    assert torch.equal(q.amax, x.abs().max())
    assert isinstance(q.calibrator, mtq.calib.MaxCalibrator)
    # None still means "each quantizer's own calibrator": a histogram-configured quantizer keeps its percentile
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*input_quantizer"]["calib_method"] = "histogram"
    model = _model(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mtq.calibrate(model, None):
            model(x)
    ref = HistogramCalibrator(8)
    ref.collect(x)
    assert torch.equal(model.conv.input_quantizer.amax, ref.compute_amax("percentile"))
