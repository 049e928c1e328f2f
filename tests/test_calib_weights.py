"""calibrate_weights with a duck-typed stand-in quantizer and with the real TensorQuantizer modules."""

import pytest
import torch
from torch import nn

from modelopt_lite.calib import HistogramCalibrator, MaxCalibrator, calibrate_weights


class StandIn:
    """The duck-typed weight quantizer interface: axis, num_bits, unsigned, narrow_range and a settable amax."""

    def __init__(self, axis=None, num_bits=8, unsigned=False, block_sizes=None):
        self.axis, self.num_bits, self.unsigned, self.narrow_range = axis, num_bits, unsigned, False
        self.block_sizes = block_sizes
        self.amax = None


class Loader(StandIn):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.loaded = []

    def load_amax(self, amax):
        self.loaded.append(amax)


def _model(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Flatten(), nn.Linear(20, 7), nn.ConvTranspose2d(2, 6, 3))
    m[0].weight_quantizer = StandIn(axis=0)
    m[3].weight_quantizer = StandIn(axis=0)
    m[4].weight_quantizer = StandIn(axis=1)  # ConvTranspose: output channels are dim 1
    return m


def test_max_per_channel_and_shapes():
    m = _model()
    out = calibrate_weights(m, method="max")
    assert sorted(out) == ["0", "3", "4"]
    assert torch.equal(m[0].weight_quantizer.amax, m[0].weight.abs().amax(dim=(1, 2, 3), keepdim=True))
    assert m[0].weight_quantizer.amax.shape == (5, 1, 1, 1)
    assert m[3].weight_quantizer.amax.shape == (7, 1)
    assert m[4].weight_quantizer.amax.shape == (1, 6, 1, 1)
    assert torch.equal(m[4].weight_quantizer.amax, m[4].weight.abs().amax(dim=(0, 2, 3), keepdim=True))


@pytest.mark.parametrize("method,kw", [("percentile", {"percentile": 99.0}), ("mse", {}), ("entropy", {})])
def test_histogram_methods_match_calibrators(method, kw):
    m = _model(1)
    calibrate_weights(m, method=method, num_bins=256, start_bin=64, **kw)
    args = kw if method == "percentile" else {"start_bin": 64, "stride": 1}
    w = m[3].weight
    for c in range(w.shape[0]):
        ref = HistogramCalibrator(8, num_bins=256)
        ref.collect(w[c])
        assert torch.equal(m[3].weight_quantizer.amax[c, 0], ref.compute_amax(method, **args))
    m = _model(1)
    calibrate_weights(m, method=method, perchannel=False, num_bins=256, start_bin=64, **kw)
    ref = HistogramCalibrator(8, num_bins=256)
    ref.collect(m[0].weight)
    assert m[0].weight_quantizer.amax.shape == ()
    assert torch.equal(m[0].weight_quantizer.amax, ref.compute_amax(method, **args))


def test_load_amax_preferred_blocks_skipped_errors():
    m = _model()
    m[0].weight_quantizer = Loader(axis=None, num_bits=4)
    m[3].weight_quantizer = StandIn(axis=0, block_sizes={-1: 4})
    with pytest.warns(UserWarning, match="block_sizes"):
        out = calibrate_weights(m, method="max")
    assert "3" not in out and m[3].weight_quantizer.amax is None
    ref = MaxCalibrator(4)
    ref.collect(m[0].weight)
    assert len(m[0].weight_quantizer.loaded) == 1 and torch.equal(m[0].weight_quantizer.loaded[0], ref.compute_amax())
    with pytest.raises(ValueError, match="method must be one of"):
        calibrate_weights(m, method="kl")
    bad = nn.Linear(2, 2)
    bad.weight_quantizer = object()
    with pytest.raises(TypeError, match=r"lacks attribute\(s\) \['axis', 'num_bits', 'unsigned'\]"):
        calibrate_weights(bad)


def test_e4m3_weights():
    m = _model()
    m[3].weight_quantizer = StandIn(axis=0, num_bits=(4, 3))
    calibrate_weights(m, method="mse", num_bins=256)
    assert m[3].weight_quantizer.amax.shape == (7, 1)
    with pytest.raises(ValueError, match="E4M3"):
        calibrate_weights(m, method="entropy")


def test_with_real_tensor_quantizer():
    tq_mod = pytest.importorskip("modelopt_lite.nn.tensor_quantizer")
    assert tq_mod.TensorQuantizer is not None
    from modelopt_lite import quant_nn

    def build():
        torch.manual_seed(3)
        return nn.Sequential(
            quant_nn.QuantConv2d(3, 4, 3), quant_nn.QuantLinear(6, 5), quant_nn.QuantConvTranspose2d(2, 3, 3)
        )

    ref, test = build(), build()
    for mod in ref:  # the quantizer's own max calibration path
        q = mod.weight_quantizer
        q.disable_quant()
        q.enable_calib()
        q(mod.weight)
        q.load_calib_amax()
    calibrate_weights(test, method="max")
    for r, t in zip(ref, test):
        assert t.weight_quantizer.amax.shape == r.weight_quantizer.amax.shape
        assert torch.equal(t.weight_quantizer.amax, r.weight_quantizer.amax)
    test = build()
    calibrate_weights(test, method="percentile")
    for r, t in zip(ref, test):
        assert t.weight_quantizer.amax.shape == r.weight_quantizer.amax.shape
        assert bool((t.weight_quantizer.amax <= r.weight_quantizer.amax).all())
    w = test[0].weight
    wq = test[0].weight_quantizer(w)  # the calibrated quantizer runs: per-channel codes on its own grid
    scale = test[0].weight_quantizer.amax / 127
    assert torch.equal(wq, torch.clamp(torch.round(w / scale), -128, 127) * scale)
