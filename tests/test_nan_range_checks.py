"""NaN and Inf never slip past a range check: every check that compares a minimum or maximum (which NaN poisons:
``nan < 0`` is False) raises a ValueError naming the op or quantizer and the bad value.

Issue 23, section 4: ``fake_tensor_quant([nan, -5.0], 2.0, unsigned=True)`` returned ``[nan, 0.]``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import modelopt_lite.tensor_quant as tq
from modelopt_lite.calib import HistogramCalibrator, MaxCalibrator
from modelopt_lite.calib.bias import BiasCalibrator, compute_bias
from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.functional import library_mx, lowlevel
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.functional.blocks import block_amax
from modelopt_lite.functional.scales import affine_params
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.nn.functional import clip
from modelopt_lite.nn.modules.clip import Clip
from modelopt_lite.onnx_export import weights as onnx_weights
from modelopt_lite.real.packing import pack_int4

NAN, INF = float("nan"), float("inf")
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
LABEL = "TensorQuantizer 'blk.fc.input_quantizer': "
UNSIGNED_NAN = r"unsigned quantization of inputs: the input contains NaN \(minimum nan\), which cannot be checked"


def _x():
    return torch.linspace(-3, 3, 128).reshape(4, 32)


def _q(**desc):
    return TensorQuantizer(QuantDescriptor(**desc), name="blk.fc.input_quantizer")


def _learned_amax_gone_nan():
    q = _q(amax=2.0, learn_amax=True)
    with torch.no_grad():
        q.amax.fill_(NAN)  # what a diverging optimizer step leaves
    return q(_x())


def _collect(cal, *xs):
    for x in xs:
        cal.collect(x)
    return cal


CASES = {
    # unsigned: the negative-input check (a NaN minimum used to pass it)
    "unsigned_nan_and_negative": (
        lambda: tq.fake_tensor_quant(torch.tensor([NAN, -5.0]), 2.0, unsigned=True),
        "^" + UNSIGNED_NAN,
    ),
    "unsigned_nan_only": (lambda: tq.fake_tensor_quant(torch.tensor([NAN, 5.0]), 2.0, unsigned=True), UNSIGNED_NAN),
    "unsigned_real_quant": (lambda: tq.tensor_quant(torch.tensor([1.0, NAN]), 2.0, unsigned=True), UNSIGNED_NAN),
    "unsigned_minus_inf": (
        lambda: tq.fake_tensor_quant(torch.tensor([-INF, 1.0]), 2.0, unsigned=True),
        r"with negative values \(minimum -inf\); use signed",
    ),
    "unsigned_static_blocks": (
        lambda: tq.fake_block_quant(torch.tensor([[NAN, 1.0]]), {-1: 2}, torch.tensor([[2.0]]), 4, unsigned=True),
        UNSIGNED_NAN,
    ),
    "unsigned_quantizer": (
        lambda: _q(num_bits=8, unsigned=True, amax=2.0)(torch.tensor([NAN, 1.0])),
        "^" + LABEL + UNSIGNED_NAN,
    ),
    # affine ranges (min/max -> scale and zero point)
    "affine_min_nan": (lambda: tq.fake_affine_tensor_quant(_x(), NAN, 1.0), "min_range must be finite, got nan"),
    "affine_max_inf": (lambda: tq.affine_tensor_quant(_x(), -1.0, INF), "max_range must be finite, got inf"),
    "affine_params_nan": (
        lambda: affine_params(torch.tensor([-1.0, -1.0]), torch.tensor([1.0, NAN]), 8),
        r"^affine quantization: max_range must be finite, got nan$",
    ),
    "affine_params_inf": (
        lambda: affine_params(torch.tensor([-INF]), torch.tensor([1.0]), 8),
        r"^affine quantization: min_range must be finite, got -inf$",
    ),
    # histogram and max calibration (bounds of the histogram, running max)
    "histogram_nan": (
        lambda: _collect(HistogramCalibrator(8, name="h"), _x(), torch.tensor([NAN, 1.0])),
        r"HistogramCalibrator 'h': input has 1 NaN and 0 Inf value\(s\) \(of 2\)",
    ),
    "histogram_unsigned_minus_inf": (
        lambda: _collect(HistogramCalibrator(8, unsigned=True), torch.tensor([-INF, 1.0])),
        r"input has 0 NaN and 1 Inf value\(s\)",
    ),
    "max_unsigned_nan_and_negative": (
        lambda: _collect(MaxCalibrator(8, unsigned=True, name="relu_out"), torch.tensor([NAN, -1.0])),
        r"MaxCalibrator 'relu_out': input has 1 NaN and 0 Inf value\(s\)",
    ),
    "calibrating_quantizer_inf": (
        lambda: (lambda q: (q.enable_calib(), q(torch.tensor([INF, 1.0]))))(_q()),
        "^" + LABEL + r"MaxCalibrator.*input has 0 NaN and 1 Inf value\(s\)",
    ),
    "percentile_nan": (
        lambda: _collect(HistogramCalibrator(8), _x()).compute_amax("percentile", percentile=NAN),
        r"percentile nan is out of range: it must be in \(0, 100\]",
    ),
    # affine bias calibration (max/min -> bias)
    "bias_max_min_nan": (
        lambda: compute_bias(torch.tensor([NAN, 1.0]), (), "max_min"),
        r"bias is not finite \(the 'max_min' bias got nan\)",
    ),
    "bias_mean_inf": (lambda: compute_bias(torch.tensor([INF, 1.0]), (), "mean"), r"the 'mean' bias got inf"),
    "bias_calibrator_nan": (
        lambda: _collect(BiasCalibrator("max_min", name="kq"), _x(), torch.tensor([1.0, NAN]).repeat(4, 16)),
        r"bias is not finite \(the 'max_min' bias of 'kq' got nan\)",
    ),
    # clip ranges
    "clip_min_nan": (lambda: clip(_x(), torch.tensor([-1.0, NAN]), 1.0), "^clip: clip_value_min is NaN$"),
    "clip_max_nan": (lambda: clip(_x(), -1.0, NAN), "^clip: clip_value_max is NaN$"),
    "clip_module_nan": (lambda: Clip(-1.0, NAN, learn_max=True)(_x()), "^clip: clip_value_max is NaN$"),
    # amax validation (static, per channel, set by hand, learned, E4M3, NVFP4's global amax)
    "amax_nan": (lambda: tq.fake_tensor_quant(_x(), NAN), r"^amax must be finite and >= 0, got nan$"),
    "amax_negative": (lambda: tq.fake_tensor_quant(_x(), -1.0), r"^amax must be finite and >= 0, got -1.0$"),
    "amax_per_channel_nan": (
        lambda: tq.fake_tensor_quant(_x(), torch.tensor([[1.0], [NAN], [1.0], [1.0]])),
        "amax must be finite and >= 0, got nan",
    ),
    "amax_set_nan": (lambda: setattr(_q(), "amax", [1.0, NAN]), "^" + LABEL + "amax must be finite and >= 0, got nan"),
    "amax_learned_nan": (_learned_amax_gone_nan, "^" + LABEL + "amax must be finite and >= 0, got nan"),
    "amax_e4m3_inf": (
        lambda: tq.fake_tensor_quant(_x(), INF, num_bits=(4, 3)),
        "amax must be finite and >= 0, got inf",
    ),
    "dynamic_amax_nan": (
        lambda: _q(axis=0)(torch.tensor([[NAN, 1.0], [1.0, 2.0]])),
        "^" + LABEL + "the input contains NaN or Inf, so its dynamic amax is not finite",
    ),
    # block amax (dynamic and static)
    "block_amax_nan": (
        lambda: block_amax(torch.tensor([[1.0, 2.0, NAN, 1.0]]), {-1: 2}, "the weight"),
        r"the weight contains NaN or Inf, so its block amax is not finite \(block \(0, 1\) of \(1, 2\) blocks has "
        r"amax nan\)",
    ),
    "block_static_amax_nan": (
        lambda: tq.fake_block_quant(_x(), {-1: 16}, amax=torch.tensor([[1.0, NAN]] * 4)),
        "^block amax must be finite and >= 0, got nan$",
    ),
    # NVFP4 / MX (global amax, global scale, inputs)
    "nvfp4_global_amax_nan": (
        lambda: mx.nvfp4_global_scale(torch.tensor([1.0, NAN])),
        "^NVFP4 global amax must be finite and >= 0, got nan$",
    ),
    "nvfp4_global_scale_inf": (
        lambda: mx.fake_nvfp4(_x(), INF),
        "^NVFP4 global_scale must be finite and >= 0, got inf$",
    ),
    "nvfp4_input_nan": (
        lambda: library_mx.nvfp4_fake_quant(torch.tensor([[NAN] + [1.0] * 15]), 2.0),
        r"NVFP4 input contains NaN or Inf \(nan\)",
    ),
    "nvfp4_quantizer_amax_nan": (
        lambda: _q(**NVFP4, amax=NAN)(_x()),
        "amax must be finite and >= 0, got nan",
    ),
    "mx_input_inf": (
        lambda: library_mx.mx_fake_quant(torch.tensor([[1.0] * 31 + [-INF]]), "e2m1"),
        r"MX \(e2m1\) input contains NaN or Inf \(-inf\)",
    ),
    # explicit scales and zero points
    "lowlevel_scale_nan": (lambda: lowlevel.quantize(_x(), NAN), r"^scale must be finite and > 0, got nan$"),
    "lowlevel_zero_point_inf": (
        lambda: lowlevel.quantize(_x(), 0.1, zero_point=INF),
        r"^zero_point must hold integers, got inf$",
    ),
    # codes: real packing, weight codes, ONNX weight folding
    "pack_int4_nan": (
        lambda: pack_int4(torch.tensor([NAN, 1.0])),
        r"^pack_int4: codes must be finite integers, got nan$",
    ),
    "pack_int4_fraction": (lambda: pack_int4(torch.tensor([0.5, 1.0])), r"codes must be finite integers, got 0.5$"),
    "weight_codes_nan": (
        lambda: _q(axis=0, amax=[1.0] * 4).quantize_weight_codes(torch.full((4, 32), NAN)),
        "^" + LABEL + "inputs contain NaN, which has no integer code",
    ),
    "onnx_fold_nan": (
        lambda: onnx_weights.fold("FakeQuantInt", np.array([NAN, 1.0]), np.float32(0.1), None, -8, 7, "fc.weight"),
        r"^fc.weight: the constant \(weight\) being quantized contains NaN",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nan_and_inf_raise_a_value_error_naming_the_op_and_value(case):
    run, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        run()


def test_the_issue_example():
    with pytest.raises(ValueError, match="unsigned quantization of inputs: the input contains NaN"):
        tq.fake_tensor_quant(torch.tensor([NAN, -5.0]), 2.0, unsigned=True)


def test_signed_quantization_still_propagates_nan_and_unsigned_keeps_inf():
    """The contract: NaN in x propagates to y (signed); +Inf saturates (unsigned too)."""
    y = tq.fake_tensor_quant(torch.tensor([NAN, -5.0, 1.0]), 2.0)
    assert torch.isnan(y[0]) and torch.equal(y[1:], tq.fake_tensor_quant(torch.tensor([-5.0, 1.0]), 2.0))
    y = tq.fake_tensor_quant(torch.tensor([INF, 1.0]), 2.0, unsigned=True)
    assert y.dtype == torch.float32 and y[0].item() == 2.0


def test_affine_params_of_a_finite_range_is_unchanged():
    scale, zp, qmin, qmax = affine_params(torch.tensor([-1.0]), torch.tensor([3.0]), 8)
    assert scale.item() == np.float32(4.0) / np.float32(255.0) and zp.item() == -64.0 and (qmin, qmax) == (-128, 127)
