"""ModelOpt's ``nvfp4_act_headroom``: ``model_calib.nvfp4_act_headroom_calibrate`` and the config form.

Inputs built from constant blocks whose per-block amaxes are powers of two, so the histogram bins (512 over
``log2`` in [-40, 40): 6.4 bins per octave) and the percentiles are known by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite import model_calib
from modelopt_lite.calib.max import MaxCalibrator
from modelopt_lite.calib.nvfp4_headroom import NVFP4ActHeadroomCalibrator
from modelopt_lite.conversion.config import QuantConfigError


def _center(e: float) -> float:
    """The center of the log2 bin holding 2**e."""
    b = int((e + 40) * 6.4)
    return -40 + (b + 0.5) / 6.4


def _blocks() -> torch.Tensor:
    """25 rows x 64 features = 100 blocks of 16: 99 blocks of +-1 and one block of 2**-4."""
    x = torch.ones(25, 64)
    x[::2] *= -1
    x[7, 16:32] = 2.0**-4
    return x


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))


def test_headroom_amax_by_hand_and_weights_by_max():
    x = _blocks()
    model = _model()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    w_amax = model[0].weight_quantizer.amax.clone()
    model_calib.nvfp4_act_headroom_calibrate(model, lambda m: m(x))
    want = torch.tensor(16384 * 2.0 ** _center(-4), dtype=torch.float32)  # rho * anchor (1st percentile: 2**-4)
    assert model[0].input_quantizer.amax.dtype == torch.float32
    assert torch.equal(model[0].input_quantizer.amax, want)
    assert torch.equal(model[0].weight_quantizer.amax, w_amax)  # weights: max
    assert type(model[0].input_quantizer.calibrator) is MaxCalibrator  # the swap is undone


def test_headroom_falls_back_to_upper_and_literal_max():
    x = _blocks()
    model = _model()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    with pytest.warns(UserWarning, match=r"'0.input_quantizer': per-block amax span .* no headroom at rho=1"):
        model_calib.nvfp4_act_headroom_calibrate(model, lambda m: m(x), rho=1.0)
    assert torch.equal(model[0].input_quantizer.amax, torch.tensor(2.0 ** _center(0), dtype=torch.float32))
    with pytest.warns(UserWarning, match="no headroom at rho=1"):
        model_calib.nvfp4_act_headroom_calibrate(model, lambda m: m(x), rho=1.0, upper_percentile=100)
    assert torch.equal(model[0].input_quantizer.amax, torch.tensor(1.0))


def test_headroom_config_form_and_weight_mse():
    x = torch.randn(32, 64) * torch.logspace(-2, 1, 64)
    a = _model()
    alg = {"method": "nvfp4_act_headroom", "rho": 2048.0, "weight_scale_algorithm": {"method": "mse", "step_size": 0.2}}
    mtq.quantize(a, {**copy.deepcopy(mtq.NVFP4_DEFAULT_CFG), "algorithm": alg}, lambda m: m(x))
    b = _model()
    mtq.quantize(b, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    model_calib.nvfp4_act_headroom_calibrate(
        b, lambda m: m(x), rho=2048.0, weight_scale_algorithm={"method": "mse", "step_size": 0.2}
    )
    c = _model()
    mtq.quantize(c, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    model_calib.mse_calibrate(c, lambda m: m(x), step_size=0.2)
    for i in (0, 1):
        assert torch.equal(a[i].input_quantizer.amax, b[i].input_quantizer.amax)
        assert torch.equal(a[i].weight_quantizer.amax, c[i].weight_quantizer.amax)
        assert not torch.equal(a[i].input_quantizer.amax, c[i].input_quantizer.amax)


def test_headroom_bad_input():
    x = _blocks()
    model = _model()
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    before = model[0].input_quantizer.amax.clone()
    with pytest.raises(QuantConfigError, match=r"rho must be in \(0, 28672\), got 30000"):
        model_calib.nvfp4_act_headroom_calibrate(model, lambda m: m(x), rho=30000)
    with pytest.raises(QuantConfigError, match="weight_scale_algorithm must be None or"):
        model_calib.nvfp4_act_headroom_calibrate(model, lambda m: m(x), weight_scale_algorithm={"method": "gptq"})
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'0.input_quantizer'.*NaN"):
        model_calib.nvfp4_act_headroom_calibrate(model, lambda m: m(bad))
    assert torch.equal(model[0].input_quantizer.amax, before)
    assert type(model[0].input_quantizer.calibrator) is MaxCalibrator
    with pytest.raises(ValueError, match=r"rho must be in"):
        NVFP4ActHeadroomCalibrator(rho=0)


def test_headroom_refuses_sequential_nvfp4_input():
    model = _model()
    nv = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
    cfg = {"quant_cfg": {"*input_quantizer": [nv, {"num_bits": 8, "axis": None}], "*weight_quantizer": nv}}
    mtq.quantize(model, cfg, None)
    with pytest.raises(NotImplementedError, match="does not support SequentialQuantizer"):
        model_calib.nvfp4_act_headroom_calibrate(model, lambda m: m(_blocks()))
