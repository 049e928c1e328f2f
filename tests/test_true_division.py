"""No tensor is divided by a Python number where the numerics contract promises true division.

On CUDA, ``tensor / python_number`` is a multiplication by the reciprocal (measured on an H100: 22% of random amaxes
gave an NVFP4 global scale one ulp off). The guard of :mod:`true_division_guard` fails on that pattern; these tests
run every format's public ops, the quantizer, the calibrators, the weight-code exports and real packing under it
(pure-torch reference backend, so the guard sees each torch op), and check the helper itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from true_division_guard import NoPythonNumberDivision, PythonNumberDivisionError, no_python_number_division

import modelopt_lite as mtq
import modelopt_lite.tensor_quant as tq
from modelopt_lite.calib import HistogramCalibrator, MaxCalibrator
from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.functional import library_mx, lowlevel
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.functional.division import divisor_like, true_div, true_div_
from modelopt_lite.functional.scales import affine_params, scale_from_amax
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.onnx_export import weights as onnx_weights
from modelopt_lite.real import fake2real
from modelopt_lite.real.packing import dequantize_weight, pack_int4, unpack_int4

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _mx(nb):
    return {"num_bits": nb, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 3


# --- the guard itself --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "div",
    [
        lambda t: t / 6,
        lambda t: t / 448.0,
        lambda t: t.div(2688.0),
        lambda t: torch.div(t, 3),
        lambda t: torch.true_divide(t, 7.0),
        lambda t: t.true_divide(7.0),
        lambda t: torch.divide(t, 5),
        lambda t: t.clone().div_(64.0),
        lambda t: t.clone().__itruediv__(3),
        lambda t: t / np.float32(2.5),
    ],
)
def test_guard_catches_every_spelling(div):
    with NoPythonNumberDivision(), pytest.raises(PythonNumberDivisionError, match="divided by the Python number"):
        div(torch.ones(3))


def test_guard_lets_tensor_divisors_reciprocals_and_rounding_modes_pass():
    t = torch.full((3,), 6.0)
    with NoPythonNumberDivision() as mode:
        t / torch.tensor(2.0)
        1.0 / t
        torch.div(t, 4, rounding_mode="floor")
        t // 4
        true_div(t, 448.0)
        true_div_(t.clone(), 3)
    assert mode.checked == 3


def test_guard_sees_inside_the_custom_ops():
    """The kernels behind ``torch.ops.modelopt_lite.*`` run under the guard too (the mode alone would not see
    them), shown with a kernel that divides by a Python number."""
    from modelopt_lite.functional import reference

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "fake_quant_int", lambda x, s, qmin, qmax: x / 2.0)
        with no_python_number_division(), pytest.raises(PythonNumberDivisionError):
            tq.fake_tensor_quant(torch.ones(4), 1.0)


# --- the helper ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "number"),
    [
        (torch.float32, 2688.0),
        (torch.float32, 448),
        (torch.float16, 6.0),
        (torch.bfloat16, 448.0),
        (torch.float64, 255),
        (torch.int64, 3),
        (torch.int32, 2.5),
        (torch.int32, 3),
        (torch.bool, 2),
        (torch.uint8, 2.0),
    ],
)
def test_true_div_keeps_the_dtype_and_value_of_the_plain_division(dtype, number):
    t = (torch.arange(1, 200) * 7).to(dtype)
    got, want = true_div(t, number), t / number
    assert got.dtype == want.dtype and torch.equal(got, want)
    if dtype.is_floating_point:
        inplace = t.clone()
        assert true_div_(inplace, number) is inplace and torch.equal(inplace, want)
    d = divisor_like(t, number)
    assert d.dtype == torch.result_type(t, number) or not dtype.is_floating_point
    assert d.dim() == 0 and d.device == t.device and float(d) == float(number)


def test_true_div_is_a_true_division_of_float32():
    """float32(a) / float32(2688) correctly rounded: the float64 quotient rounded once to float32 (exact here)."""
    a = torch.rand(4096, generator=torch.Generator().manual_seed(3), dtype=torch.float32) * 1e3
    assert torch.equal(true_div(a, 2688.0), (a.double() / 2688.0).float())
    assert torch.equal(mx.nvfp4_global_scale(a), (a.double() / 2688.0).float())


@pytest.mark.parametrize(
    "op",
    [
        lambda: mx.nvfp4_global_scale(torch.tensor(3.0)),
        lambda: scale_from_amax(torch.tensor([0.0, 1.0, 3.4e38]), 127.0),
        lambda: affine_params(torch.tensor([-3e38]), torch.tensor([3e38]), 8),
        lambda: mx.int8_mx_round(torch.tensor([0.3, -1.7])),
        lambda: TensorQuantizer(QuantDescriptor(amax=2.0)).step_size,
    ],
    ids=["nvfp4_global_scale", "scale_from_amax", "affine_params_wide", "int8_mx_round", "step_size"],
)
def test_scale_ops_divide_by_tensors(op):
    with no_python_number_division():
        op()


# --- every public op under the guard -------------------------------------------------------------------------------
def _functional_ops():
    x = _x(6, 40)
    per_channel = x.abs().amax(1, keepdim=True)
    learn = torch.tensor(2.5, requires_grad=True)
    xg = x.clone().requires_grad_(True)
    tq.fake_tensor_quant(xg, learn).sum().backward()  # STE + LSQ gradient ops
    tq.fake_tensor_quant(x, per_channel, num_bits=4, narrow_range=False)
    tq.fake_tensor_quant(x.abs(), 3.0, num_bits=8, unsigned=True)
    tq.fake_tensor_quant(x.half(), 3.0)
    tq.fake_tensor_quant(x.double(), 3.0, bias=0.25)
    tq.tensor_quant(x, 3.0, dtype=torch.int8)
    tq.tensor_quant(x, per_channel)
    tq.legacy_fake_tensor_quant(x, torch.tensor(3.0))
    for nb in ((4, 3), (5, 2), (2, 1)):
        a = torch.tensor(5.0, requires_grad=True)
        tq.fake_tensor_quant(x, a, num_bits=nb).sum().backward()
        tq.tensor_quant(x, per_channel, num_bits=nb)
    tq.scaled_e4m3(x, 4.0)
    tq.fake_affine_tensor_quant(xg, -1.5, 4.0).sum().backward()
    tq.affine_tensor_quant(x, torch.tensor(-2.0), torch.tensor(7.0), num_bits=4)
    affine_params(torch.tensor([-3e38]), torch.tensor([3e38]), 8)  # the float64 path of a range wider than float32
    scale_from_amax(torch.tensor([0.0, 1.0, 3.4e38]), 127.0)
    tq.fake_block_quant(x, {-1: 16})
    tq.fake_block_quant(x, {-1: 8}, amax=torch.full((6, 5), 2.0), num_bits=8)
    tq.fake_block_quant(x, {-1: 16, "scale_bits": 8})
    tq.fake_block_quant(x, {-1: 8, "scale_bits": (4, 3), "scale_block_sizes": {-1: 2}})
    tq.fake_block_quant(x, {-1: 16}, num_bits=(4, 3))
    tq.block_quant(x, {-1: 16, 0: 2})
    tq.block_scales(x, {-1: 16}, num_bits=4)
    lowlevel.quantize(x, 0.05, mode="hardware")
    lowlevel.quantize(x, torch.full((6,), 0.05), zero_point=torch.full((6,), 3.0), axis=0)
    lowlevel.dequantize(torch.ones(6, 3, dtype=torch.int8), 0.1, zero_point=2)
    # NVFP4 and OCP MX
    xs = xg.detach().clone().requires_grad_(True)
    library_mx.nvfp4_fake_quant(xs, xs.detach().abs().amax()).sum().backward()
    gs = mx.nvfp4_global_scale(torch.tensor([3.0, 0.0, 1e-30, 2688.0]))
    gs = mx.nvfp4_global_scale(x.abs().amax())
    mx.nvfp4_block_scales(x, gs)
    codes, scales = mx.quantize_nvfp4(x, gs)
    mx.dequantize_nvfp4(codes, scales, gs)
    for elem in mx.MX_ELEMENTS:
        for rounding in mx.MX_ROUNDINGS:
            xe = x.clone().requires_grad_(True)
            library_mx.mx_fake_quant(xe, elem, 32, rounding).sum().backward()
            c, s = mx.quantize_mx(x, elem, rounding=rounding)
            mx.dequantize_mx(c, s, elem)
            mx.mx_scale_exponents(x, elem, rounding=rounding)


def _quantizer_forwards():
    x = _x(4, 64, seed=1)
    descs = [
        {},
        {"axis": 0},
        {"num_bits": 8, "unsigned": True},
        {"num_bits": 4, "block_sizes": {-1: 16}},
        {"num_bits": 4, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": 8}},
        {"num_bits": (4, 3)},
        {"num_bits": (4, 3), "axis": 0},
        {"num_bits": (5, 2)},
        {"num_bits": (2, 1)},
        {"num_bits": 8, "learn_amax": True, "amax": 3.0},
        NVFP4,
        *(_mx(nb) for nb in ((4, 3), (5, 2), (2, 1), 8)),
    ]
    for d in descs:
        q = TensorQuantizer(QuantDescriptor(**d))
        inp = x.abs() if d.get("unsigned") else x
        if not q.dynamic and q.amax is None:
            q.enable_calib()
            q.disable_quant()
            q(inp)
            q.load_calib_amax()
            q.disable_calib()
            q.enable_quant()
        q(inp).sum().backward() if q.learn_amax else q(inp)
        if not q.dynamic:
            assert q.step_size is not None and q.step_size.dtype == torch.float32
            assert q.scale is not None
        if d and not d.get("block_sizes", {}).get("scale_bits") and "learn_amax" not in d:
            q.quantize_weight_codes(x) if not q.unsigned else q.quantize_weight_codes(x.abs())


def _calibrations():
    x = _x(8, 32, seed=2)
    mc = MaxCalibrator(8, axis=0)
    mc.collect(x)
    mc.compute_amax()
    for nb, unsigned in ((8, False), (8, True), ((4, 3), False), (4, False)):
        for axis in (None, 0):
            hc = HistogramCalibrator(num_bits=nb, axis=axis, unsigned=unsigned)
            hc.collect(x.abs() if unsigned else x)
            hc.collect(2 * x.abs() if unsigned else 2 * x)
            hc.compute_amax("percentile", percentile=99.9)
            hc.compute_amax("mse", start_bin=8)
            if not isinstance(nb, tuple):
                hc.compute_amax("entropy", start_bin=8)


def _exports_and_packing():
    x = _x(6, 16, seed=3).numpy()
    scale = np.full((6, 1), 0.05, dtype=np.float32)
    onnx_weights.fold("FakeQuantInt", x, scale, None, -8, 7, "w")
    onnx_weights.fold("FakeAffine", x, scale, np.full((6, 1), 2.0, dtype=np.float32), -8, 7, "w")
    for marker in ("FakeE4M3", "FakeE5M2", "FakeE2M1"):
        onnx_weights.fold(marker, x, scale, None, -448, 448, "w")
    q = torch.randint(-8, 8, (6, 16), dtype=torch.int8)
    packed = pack_int4(q)
    unpack_int4(packed, 16)
    dequantize_weight(q, torch.full((6, 1), 0.1), None)
    dequantize_weight(q, torch.full((6, 2), 0.1), {-1: 8})


def _fake2real():
    lin = lambda: nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)).eval()  # noqa: E731
    x = _x(4, 32, seed=4)
    cfgs = [
        mtq.INT8_DEFAULT_CFG,
        mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
        {
            "quant_cfg": {
                "default": {"enable": False},
                "*weight_quantizer": dict(NVFP4, axis=None, enable=True),
                "*input_quantizer": dict(NVFP4, axis=None, enable=True),
            },
            "algorithm": "max",
        },  # fmt: skip
        {
            "quant_cfg": {"default": {"enable": False}, "*weight_quantizer": dict(_mx((2, 1)), axis=None, enable=True)},
            "algorithm": "max",
        },  # fmt: skip
    ]
    for cfg in cfgs:
        torch.manual_seed(0)
        model = mtq.quantize(lin(), cfg, lambda m: m(x))
        with torch.no_grad():
            fake2real(model)(x)


@pytest.mark.parametrize(
    "run",
    [_functional_ops, _quantizer_forwards, _calibrations, _exports_and_packing, _fake2real],
    ids=["functional", "tensor_quantizer", "calibration", "exports_packing", "fake2real"],
)
def test_no_python_number_division_in_the_quantization_paths(run):
    with no_python_number_division() as mode:
        run()
    assert mode.checked > 0  # the guard did see the paths' divisions
