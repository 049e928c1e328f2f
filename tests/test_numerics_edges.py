"""Numerics edge cases (issue 13): the sign of zero against ONNX Runtime, non-finite dynamic block amax, block_sizes
keys from JSON, affine ranges wider than float32, and the memory of float16/bfloat16 dynamic blocks.

Every backend is checked: the pure-torch reference and the native CPU kernels with both implementations (AVX2 and
scalar). The sign of zero is compared on bit patterns (``torch.equal`` treats ``-0.0 == 0.0``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import modelopt_lite.tensor_quant as tq
from modelopt_lite.functional import backend, blocks, lowlevel
from modelopt_lite.functional import reference as R

ROOT = Path(__file__).resolve().parent.parent
BITS_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS_VIEW[t.dtype])


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bit pattern (the sign of zero included; NaN positions must match)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(gn, wn), f"{what}: NaN positions differ"
    bad = (bits(got) != bits(want)) & ~wn
    assert not bool(bad.any()), f"{what}: got {got[bad].tolist()} want {want[bad].tolist()}"


@pytest.fixture(params=["reference", "avx512", "avx2", "scalar"])
def impl(request):
    """Run under the reference, or the native CPU kernels with a forced implementation."""
    if request.param == "reference":
        with backend.use_backend("reference"):
            yield "reference"
        return
    mod = backend._load("cpu")
    if mod is None:
        pytest.skip(f"native CPU kernels unavailable: {backend.native_error('cpu')}")
    try:
        mod.set_kernel_impl(request.param)
    except ValueError as e:
        pytest.skip(f"{request.param} kernels unavailable on this CPU: {e}")
    try:
        with backend.use_backend("native"):
            yield request.param
    finally:
        mod.set_kernel_impl("auto")


# --- the sign of zero: integer code 0 is +0.0 (as ORT's DequantizeLinear), FP8 keeps -0 (as ORT's FP8 Q/DQ) -------
def _ort_qdq(x: np.ndarray, scale: float, zp_type, zero_point=0):
    """ONNX Runtime's QuantizeLinear -> DequantizeLinear on float32 x, per tensor: (y, raw codes)."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    from onnx_helpers import make_model

    n = x.size
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [scale]),
        helper.make_tensor("z", zp_type, [], [zero_point]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n]), helper.make_tensor_value_info("q", zp_type, [n])],
        inits,
    )
    model = make_model(graph, 19)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, q = sess.run(None, {"x": x.astype(np.float32)})
    return torch.from_numpy(np.ascontiguousarray(y)), q


def _signed_zero_inputs(scale: float) -> torch.Tensor:
    """-0.0, tiny negatives, negatives that round to 0 (ties included), exact negative ties, and positives."""
    s = scale
    vals = [-0.0, 0.0, -1e-45, -1e-30, -0.4 * s, -0.5 * s, -0.49999997 * s, -1.5 * s, -2.5 * s, -3.5 * s]
    vals += [0.5 * s, 1.5 * s, 0.4 * s, -126.5 * s, -127.5 * s, -200.0 * s, 127.5 * s]
    x = torch.tensor(vals, dtype=torch.float32)
    return torch.cat([x, x.repeat(2)])  # 51 elements: AVX2 steps of 8 and scalar tails both see each value


@pytest.mark.parametrize("scale", [1.0, 0.0625, 0.1])
def test_int8_zero_sign_matches_onnxruntime(impl, scale):
    from onnx import TensorProto

    x = _signed_zero_inputs(scale)
    amax = torch.tensor(scale * 127, dtype=torch.float32)
    s = amax / 127
    ort_y, ort_q = _ort_qdq(x.numpy(), float(s), TensorProto.INT8)
    y = tq.fake_tensor_quant(x, amax, 8, narrow_range=False)
    assert_bits(y, ort_y, f"{impl} fake_tensor_quant vs ORT")
    assert not bool(torch.signbit(y[y == 0]).any()), "a zero output must be +0.0"
    q, _ = tq.tensor_quant(x, amax, 8, narrow_range=False)
    assert torch.equal(q.to(torch.int8), torch.from_numpy(ort_q))
    assert not bool(torch.signbit(q[q == 0]).any()), "code 0 must be +0.0"
    # the low-level API and the int8 codes path agree too
    assert_bits(lowlevel.quantize(x, s), ort_y, f"{impl} lowlevel.quantize vs ORT")
    assert torch.equal(lowlevel.quantize(x, s, mode="hardware"), torch.from_numpy(ort_q))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int_zero_sign_low_precision(impl, dtype):
    x = torch.tensor([-0.0, -1e-3, -0.4, -0.5, 0.3, -1.5] * 3, dtype=dtype)
    y = tq.fake_tensor_quant(x, torch.tensor(127.0), 8)
    assert y.dtype == dtype
    assert_bits(y, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -2.0] * 3, dtype=dtype), f"{impl} {dtype}")


def test_int_zero_sign_blocks_and_per_channel(impl):
    x = torch.tensor([[-0.001, -0.0, 2.0, -3.0], [-0.2, 5.0, -0.0, -1e-9]])
    want = tq.fake_tensor_quant(x, torch.tensor([[3.0], [5.0]]), 4)
    assert not bool(torch.signbit(want[want == 0]).any())
    assert_bits(tq.fake_block_quant(x, {-1: 4}, None, 4), want, f"{impl} dynamic blocks")
    q, _ = tq.block_quant(x, {-1: 4}, None, 4)
    assert not bool(torch.signbit(q[q == 0]).any())


def test_affine_zero_sign_matches_onnxruntime(impl):
    from onnx import TensorProto

    x = _signed_zero_inputs(0.0625)
    scale, zp, _, _ = tq._affine(x, torch.tensor(-8.0), torch.tensor(7.9375), 8)
    ort_y, ort_q = _ort_qdq(x.numpy(), float(scale), TensorProto.INT8, int(zp))
    assert_bits(tq.fake_affine_tensor_quant(x, -8.0, 7.9375), ort_y, f"{impl} fake_affine vs ORT")
    q, _, _ = tq.affine_tensor_quant(x, -8.0, 7.9375)
    assert torch.equal(q.to(torch.int8), torch.from_numpy(ort_q))


def test_affine_zero_point_is_never_negative_zero():
    # lo / scale = -127.5: qmin - lo / scale = -0.5 rounds to -0.0, stored as +0.0
    _, zp, _, _ = tq._affine(torch.zeros(1), torch.tensor(-127.5), torch.tensor(127.5), 8)
    assert zp.item() == 0.0 and not bool(torch.signbit(zp))


def test_e4m3_zero_sign_matches_onnxruntime(impl):
    """ORT's FP8 QuantizeLinear gives the -0 code (0x80) for -0.0 and negative values that round to 0, and its
    DequantizeLinear turns it into -0.0: FP8 keeps the sign of zero, as torch's float8_e4m3fn cast does."""
    from onnx import TensorProto

    x = torch.cat([_signed_zero_inputs(1.0), torch.tensor([-(2.0**-10), -(2.0**-11), 2.0**-10, -3 * 2.0**-10])])
    ort_y, ort_q = _ort_qdq(x.numpy(), 1.0, TensorProto.FLOAT8E4M3FN)
    y = tq.scaled_e4m3(x, torch.tensor(448.0))
    assert_bits(y, ort_y, f"{impl} scaled_e4m3 vs ORT")
    assert bool(torch.signbit(y[0])) and bool(torch.signbit(y[2])), "FP8 keeps -0.0, as ORT does"
    q, _ = tq.tensor_quant(x, torch.tensor(448.0), (4, 3))
    assert torch.equal(q.view(torch.uint8), torch.from_numpy(ort_q.view(np.uint8)))


def test_reference_int_codes_have_no_negative_zero():
    x = torch.tensor([-0.0, -1e-45, -0.5, -0.25, float("nan"), -3.0])
    s = torch.tensor(1.0)
    q = R.quantize_int(x, s, -8, 7)
    assert_bits(q, torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan"), -3.0]))
    assert_bits(R.fake_quant_int(x, s, -8, 7), torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan"), -3.0]))
    x16 = x.to(torch.float16)
    assert_bits(R.fake_quant_int(x16, s, -8, 7), torch.tensor([0.0, 0.0, 0.0, 0.0, math.nan, -3.0]).half())


def test_reference_never_modifies_its_input():
    x = torch.tensor([-0.3, 1.7, -2.5, 9.0])
    x16 = x.half()
    before, before16 = x.clone(), x16.clone()
    s, z = torch.tensor(0.5), torch.tensor(1.0)
    R.fake_quant_int(x, s, -8, 7)
    R.quantize_int(x, s, -8, 7)
    R.fake_e4m3(x, s)
    R.fake_affine(x, s, z, -8, 7)
    R.quantize_affine(x, s, z, -8, 7)
    R.fake_quant_int(x16, s, -8, 7)
    assert_bits(x, before)
    assert_bits(x16, before16)


# --- dynamic block amax with NaN/Inf: a ValueError, never a silently NaN block ----------------------------------------
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_bits", [8, (4, 3)])
def test_dynamic_block_with_nonfinite_input_raises(impl, bad, dtype, num_bits):
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]], dtype=dtype)
    x[1, 2] = bad
    with pytest.raises(
        ValueError, match=r"the input contains NaN or Inf, so its block amax is not finite \(block \(1, 0\)"
    ):
        tq.fake_block_quant(x, {-1: 4}, None, num_bits)
    if num_bits == 8:
        with pytest.raises(ValueError, match="NaN or Inf"):
            tq.block_quant(x, {-1: 4}, None, num_bits)


def test_dynamic_block_nonfinite_through_a_quantizer_names_it():
    from modelopt_lite.descriptor import QuantDescriptor
    from modelopt_lite.nn import TensorQuantizer

    q = TensorQuantizer(QuantDescriptor(num_bits=8, block_sizes={-1: 4, "type": "dynamic"}))
    x = torch.ones(2, 8)
    x[0, 5] = math.inf
    with pytest.raises(ValueError, match=r"TensorQuantizer.*NaN or Inf, so its block amax is not finite"):
        q(x)


def test_static_block_collector_rejects_nonfinite_like_the_calibrators():
    x = torch.ones(2, 8)
    x[1, 0] = math.nan
    with pytest.raises(ValueError, match=r"NaN or Inf.*block \(1, 0\)"):
        blocks.block_amax(x, {-1: 4})


def test_block_amax_is_exact_in_low_precision_and_for_integers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 37, generator=g) * 100
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        want = blocks.to_blocks(xd.float().abs(), {1: 8})[0].amax(dim=2)
        got = blocks.block_amax(xd, {-1: 8})
        assert got.dtype == torch.float32 and torch.equal(got, want), dtype
    xi = torch.tensor([[-128, 5, 7, 127], [0, -3, 2, 1]], dtype=torch.int8)
    assert torch.equal(blocks.block_amax(xi, {-1: 2}), torch.tensor([[128.0, 127.0], [3.0, 2.0]]))


# --- block_sizes keys: "-1" (JSON) is the axis -1; other keys are errors ----------------------------------------------
def test_string_axis_keys_equal_int_keys(impl):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 10, generator=g)
    want = tq.fake_block_quant(x, {-1: 4}, None, 4)
    assert not torch.equal(want, tq.fake_tensor_quant(x, x.abs().amax(), 4, narrow_range=False))  # really blocked
    for keys in ({"-1": 4}, {" -1": 4}, {"1": 4}, json.loads(json.dumps({-1: 4}))):
        assert torch.equal(tq.fake_block_quant(x, keys, None, 4), want), keys
    dq = {-1: 2, "scale_bits": 8, "scale_block_sizes": {-1: 2}}
    dq_json = json.loads(json.dumps(dq))
    assert dq_json == {"-1": 2, "scale_bits": 8, "scale_block_sizes": {"-1": 2}}
    assert torch.equal(tq.fake_block_quant(x, dq_json, None, 4), tq.fake_block_quant(x, dq, None, 4))
    assert torch.equal(blocks.block_amax(x, {"0": 2, "-1": 5}), blocks.block_amax(x, {0: 2, -1: 5}))
    assert blocks.normalize({"-1": 4, "type": "dynamic"}, x.shape) == {1: 4}


@pytest.mark.parametrize(
    "sizes,exc,msg",
    [
        ({"foo": 4}, ValueError, r"block_sizes: key 'foo' is neither an axis"),
        ({"-1.5": 4}, ValueError, r"key '-1.5' is neither an axis"),
        ({-1: 4, "-1": 4}, ValueError, r"axis -1 is given twice"),
        ({"type": "dynamic"}, ValueError, r"needs at least one \{axis: size\} entry"),
        ({}, ValueError, r"needs at least one"),
        ({1.0: 4}, TypeError, r"keys must be axes \(ints\)"),
        ({True: 4}, TypeError, r"keys must be axes"),
        ({-1: 2.5}, ValueError, r"block size for axis -1 must be positive"),
        ({"-1": -4}, ValueError, r"block size for axis '-1' must be positive"),
        ({"2": 4}, ValueError, r"block_sizes axis=\(2,\) is out of range for a tensor of rank 2"),
        ({-1: 2, 1: 2}, ValueError, r"names the same dimension twice"),
        ([4], TypeError, r"block_sizes must be a dict"),
        ({-1: 2, "scale_bits": 8, "scale_block_sizes": {"x": 2}}, ValueError, r"key 'x' is neither an axis"),
    ],
)
def test_bad_block_sizes_raise(sizes, exc, msg):
    with pytest.raises(exc, match=msg):
        tq.fake_block_quant(torch.ones(2, 8), sizes, None, 4)


# --- affine ranges wider than float32 ----------------------------------------------------------------------------------
def test_affine_range_wider_than_float32(impl):
    x = torch.tensor([1.0, -2e38, 3e38, -3e38, 0.0, -1e30, 1e38, float("nan")])
    y = tq.fake_affine_tensor_quant(x, -3e38, 3e38)
    q, scale, zp = tq.affine_tensor_quant(x, -3e38, 3e38)
    want_scale = torch.tensor((float(np.float32(3e38)) * 2) / 255, dtype=torch.float64).float()
    assert scale.dtype == torch.float32 and torch.equal(scale, want_scale)
    assert zp.item() == 0.0 and not bool(torch.signbit(zp))
    assert torch.equal(q[:7], torch.tensor([0.0, -85.0, 127.0, -128.0, 0.0, 0.0, 42.0]))
    assert torch.isnan(q[7]) and torch.isnan(y[7])
    assert torch.isfinite(y[:7]).all()
    assert_bits(y[:7], q[:7] * scale, f"{impl} wide affine")


def test_affine_wide_range_matches_onnxruntime():
    from onnx import TensorProto

    x = torch.tensor([1.0, -2e38, 3e38, -3e38, 0.0, -1e30, 1e38, -1e38])
    q, scale, zp = tq.affine_tensor_quant(x, -3e38, 3e38)
    ort_y, ort_q = _ort_qdq(x.numpy(), float(scale), TensorProto.INT8, int(zp))
    assert torch.equal(q.to(torch.int8), torch.from_numpy(ort_q))
    assert_bits(tq.fake_affine_tensor_quant(x, -3e38, 3e38), ort_y)


def test_affine_ordinary_ranges_keep_the_float32_formula():
    g = torch.Generator().manual_seed(3)
    lo = -torch.rand(200, generator=g) * 10.0 ** torch.randint(-3, 37, (200,), generator=g)
    hi = torch.rand(200, generator=g) * 10.0 ** torch.randint(-3, 37, (200,), generator=g)
    scale, zp, qmin, _ = tq._affine(torch.zeros(200), lo, hi, 8)
    assert torch.equal(scale, (hi - lo) / torch.tensor(255.0))
    assert torch.equal(zp, torch.clamp(torch.round(qmin - lo / scale), -128, 127) + 0.0)


@pytest.mark.parametrize("lo,hi", [(-3.4e38, 3.4e38), (-3.4028234663852886e38, 3.4028234663852886e38)])
def test_affine_range_whose_grid_overflows_raises(lo, hi):
    with pytest.raises(ValueError, match=r"affine range .* is too wide for 8-bit quantization in float32"):
        tq.fake_affine_tensor_quant(torch.ones(3), lo, hi)


# --- memory of float16/bfloat16 dynamic blocks ---------------------------------------------------------------------
_MEM_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import modelopt_lite.tensor_quant as tq
    from modelopt_lite.functional.backend import set_backend

    def peak_kib():  # VmHWM: this process's own peak RSS (ru_maxrss would inherit the parent's across exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    torch.set_num_threads(1)
    set_backend(sys.argv[2])
    x = torch.randn(2048, 4096, dtype=getattr(torch, sys.argv[1]))  # no float32 copy: the peak starts low
    tq.fake_block_quant(x[:16], {-1: 128}, None, 4)  # loads the kernels
    base = peak_kib()
    y = tq.fake_block_quant(x, {-1: 128}, None, 4)
    print((peak_kib() - base) * 1024 / (x.numel() * x.element_size()))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,which,limit", [("float16", "native", 1.5), ("bfloat16", "native", 1.5), ("float16", "reference", 3.5)]
)
def test_low_precision_dynamic_blocks_peak_memory(dtype, which, limit):
    """The peak memory of one dynamic-block fake quant, as a multiple of the input's bytes (the output alone is 1x;
    it was 4x with the native kernels and 6x with the reference before block amax stopped making float32 copies)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc/self/status (Linux) for the peak RSS")
    if which == "native" and backend._load("cpu") is None:
        pytest.skip("native CPU kernels unavailable")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _MEM_SCRIPT, dtype, which], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    ratio = float(out.stdout.strip().splitlines()[-1])
    assert 0.9 < ratio < limit, ratio


# --- calibrators near the top of float32 ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["percentile", "mse", "entropy"])
def test_histogram_amax_stays_finite_near_float32_max(method):
    from modelopt_lite.calib import HistogramCalibrator

    top = torch.finfo(torch.float32).max
    cal = HistogramCalibrator(8)
    cal.collect(torch.tensor([top, -top, 1.0, 3e38]))
    amax = cal.compute_amax(method, **({"percentile": 100.0} if method == "percentile" else {}))
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert bool(torch.isfinite(amax)) and amax.item() > 3e38, amax
    y = tq.fake_tensor_quant(torch.tensor([top, -top]), amax, 8)  # usable: a finite scale, no NaN
    assert bool(torch.isfinite(y).all()), y


@pytest.mark.parametrize("num_bits,narrow", [(8, True), (8, False), (4, False), ((4, 3), False)])
def test_amax_near_float32_max_gives_a_finite_grid(impl, num_bits, narrow):
    """amax = float32's largest value: float32(amax / bound) rounds up so far that bound * scale is Inf for 8 bits;
    the scale is then the float32 just below (identical on every backend), and finite inputs stay finite."""
    top = torch.finfo(torch.float32).max
    x = torch.tensor([top, -top, 3e38, -1.0, 0.0] * 2)
    amax = torch.tensor(top)
    if num_bits == (4, 3):
        y = tq.scaled_e4m3(x, amax)
        scale = tq.tensor_quant(x, amax, num_bits)[1]
    else:
        y = tq.fake_tensor_quant(x, amax, num_bits, narrow_range=narrow)
        scale = tq.tensor_quant(x, amax, num_bits, narrow_range=narrow)[1]
    assert bool(torch.isfinite(y).all()), y
    bound = 448.0 if num_bits == (4, 3) else float(2 ** (num_bits - 1) - 1)
    plain = amax / torch.tensor(bound)
    want = plain if bool(torch.isfinite(plain * bound)) else torch.nextafter(plain, torch.tensor(0.0))
    assert torch.equal(scale, want)
    assert y[0].item() == (bound * want).item() and y[1].item() == -(bound * want).item()
