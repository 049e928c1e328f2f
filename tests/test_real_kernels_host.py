"""The fused W8A8 kernels of the real GPU paths (csrc/real_kernels.cu, ops of functional/library_real.py) run on
the CPU, bit for bit against the pure-torch chains they replace, and the CUDA forward's op count with them.

``host`` runs the kernels' launchers built for the host (nvcc, a few seconds; skipped without nvcc); ``binding``
also runs csrc/real_cuda_binding.cpp built for the host (torch headers, ~1 min: opt-in with
MODELOPT_LITE_TEST_EMULATED=1, as tests/test_cuda_binding_emulated.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from fast_real_helpers import OpCounter, fake_mlp, fp8_cfg, inputs
from real_kernel_ops import HostOps, binding_ops, bits, build_host_library, same, special_rows

import modelopt_lite as mtl
from modelopt_lite.functional import library_real as LR
from modelopt_lite.functional.scales import scale_from_amax
from modelopt_lite.real import fake2real

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (3, 7), (17, 64), (5, 333), (40, 16)]


@pytest.fixture(scope="module", params=["host", "binding"])
def ops(request):
    if request.param == "binding":
        if os.environ.get("MODELOPT_LITE_TEST_EMULATED") != "1":
            pytest.skip("opt-in (about 1 min to build): set MODELOPT_LITE_TEST_EMULATED=1")
        ns = binding_ops()
        if ns is None:
            pytest.skip("CUDA headers (cuda_fp8.h) not found")
        return ns
    lib = build_host_library()
    if lib is None:
        pytest.skip("nvcc not found: the host build of the kernels needs it")
    return HostOps(lib)


# --- FP8 --------------------------------------------------------------------------------------------------------------
def test_e4m3_cast_equals_torch_on_every_bf16_value(ops):
    """Every bfloat16 bit pattern (as float32, divisor 1; the static chain saturates at 448 first) and float32
    values around each E4M3 rounding boundary give torch's float8_e4m3fn codes, NaN sign included."""
    allbf = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]
    srt = torch.sort(codes).values
    mids = (srt[:-1] + srt[1:]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-float("inf")))])
    x = torch.cat([allbf, near, torch.tensor([447.9, 448.0, 464.0, 479.9, 480.0, 1e38, 2.0**-10, 2.0**-9 * 3])])
    one = torch.ones(1)
    same(ops.real_fp8_static(x.reshape(1, -1), one), LR.fp8_static_reference(x.reshape(1, -1), one), "cast")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_static_equals_chain(ops, dtype, shape):
    x = special_rows(shape, dtype, seed=shape[0] * 1000 + shape[1])
    for d in (0.37, 1e-3, 2.0**-20, float("inf"), 3e4):  # inf: the divisor of a dead scale
        div = torch.tensor([d], dtype=torch.float32)
        same(ops.real_fp8_static(x, div), LR.fp8_static_reference(x, div), f"static {dtype} {shape} d={d}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_row", [True, False])
def test_fp8_dynamic_equals_chain(ops, dtype, shape, per_row):
    """Codes and scales (bits, NaN included) per row / per tensor, with dead, NaN and Inf rows."""
    x = special_rows(shape, dtype, seed=shape[0] * 7 + shape[1])
    codes, scale = ops.real_fp8_dynamic(x, per_row)
    want_codes, want_scale = LR.fp8_dynamic_reference(x, per_row)
    what = f"dynamic {dtype} {shape} per_row={per_row}"
    same(scale, want_scale, what + " scale", any_nan=True)
    same(codes, want_codes, what + " codes")


def test_fp8_dynamic_rows_as_documented(ops):
    """Dead rows: scale 0 and +0 codes; a NaN row: NaN scale, 0 codes; an Inf row: Inf scale, 0 codes; a float32 amax
    at float32's top: scale_from_amax's guarded scale, every code finite; a per-tensor scale of a clean tensor."""
    x = torch.randn(6, 40)
    x[0] = 0.0
    x[1] = -1e-30
    x[2, 3] = float("nan")
    x[3, 5] = float("inf")
    x[4, 0] = torch.finfo(torch.float32).max
    codes, scale = ops.real_fp8_dynamic(x, True)
    f = codes.float()
    assert scale[0, 0] == 0 and scale[1, 0] == 0 and torch.equal(bits(codes[:2]), torch.zeros(2, 40, dtype=torch.uint8))
    assert scale[2, 0].isnan() and scale[3, 0].isinf() and not f[2:4].any()
    top = torch.tensor(torch.finfo(torch.float32).max)
    assert scale[4, 0] == scale_from_amax(top, 448.0) and f[4, 0] == 448.0 and f.isfinite().all()
    clean = torch.randn(9, 33)
    c, s = ops.real_fp8_dynamic(clean, False)
    assert s.shape == (1, 1) and s[0, 0] == clean.abs().max() / torch.tensor(448.0)


def test_fp8_dynamic_per_tensor_over_many_partials(ops):
    """A tensor larger than one partial-amax chunk (8192 elements), its max in the last chunk."""
    x = torch.randn(40, 1000).bfloat16()
    x[39, 999] = 77.0
    same(ops.real_fp8_dynamic(x, False)[1], LR.fp8_dynamic_reference(x, False)[1], "partials")


# --- INT8 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("qmin", "qmax", "shift"), [(-128, 127, 0), (-127, 127, 0), (0, 255, 128)])
def test_int8_codes_equal_chain(ops, dtype, shape, qmin, qmax, shift):
    """Codes (ties to even, clamping, a dead scale's +Inf divisor) and the zero rows _int_mm's padding needs; NaN
    quotients give the documented 0 - shift (the chain's float-to-int8 cast of NaN is undefined)."""
    x = special_rows(shape, dtype, seed=shape[0] + shape[1])
    x.view(-1)[:: max(1, x.numel() // 5)] = torch.tensor(2.5).to(dtype)  # ties at divisor 1
    for d in (1.0, 0.013, float("inf")):
        div = torch.tensor([d])
        nan = (x / div).isnan()  # NaN inputs, and Inf / Inf under a dead scale
        for rows_out in (shape[0], max(17, shape[0])):
            got = ops.real_int8_codes(x, div, qmin, qmax, shift, rows_out)
            want = LR.int8_codes_reference(x, div, qmin, qmax, shift, rows_out)
            what = f"int8 {dtype} {shape} [{qmin}, {qmax}] - {shift} d={d} rows_out={rows_out}"
            assert got.dtype == torch.int8 and got.shape == (rows_out, shape[1]), what
            keep = torch.zeros(rows_out, shape[1], dtype=torch.bool)
            keep[: shape[0]] = nan
            assert torch.equal(got[~keep], want[~keep]), what
            assert (got[keep] == -shift).all(), what + ": NaN"


# --- epilogue ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(("rows", "acc_rows", "cols"), [(1, 17, 8), (7, 7, 32), (33, 33, 1000), (16, 17, 24)])
def test_epilogue_equals_chain(ops, dtype, with_bias, rows, acc_rows, cols):
    """int32 accumulators beyond 2**24 (the int-to-float rounding), scales across magnitudes, one fused multiply-add
    with the bias and one rounding into the output dtype: equal to addcmul / mul written into that dtype."""
    g = torch.Generator().manual_seed(rows * cols)
    acc = torch.randint(-(2**30), 2**30, (acc_rows, cols), generator=g, dtype=torch.int32)
    acc[0, 0] = 2**31 - 1
    acc[-1, -1] = -(2**31)
    scale_row = (torch.rand(1, cols, generator=g) * torch.logspace(-12, -2, cols)).float()
    bias = (torch.randn(cols, generator=g) * 100).float() if with_bias else None
    got = ops.real_int_mm_epilogue(acc, scale_row, bias, rows, dtype)
    want = LR.int_mm_epilogue_reference(acc, scale_row, bias, rows, dtype)
    same(got, want, f"epilogue {dtype} bias={with_bias} {rows}/{acc_rows}x{cols}")


# --- the CUDA forward with the kernels standing in --------------------------------------------------------------------
EXPECTED = {
    "fp8 static": ["real_fp8_static", "_scaled_mm"],
    "fp8 static, channel weights": ["real_fp8_static", "_scaled_mm"],
    "fp8 dynamic row": ["real_fp8_dynamic", "_scaled_mm"],
    "fp8 dynamic tensor": ["real_fp8_dynamic", "_scaled_mm"],
    "int_mm": ["real_int8_codes", "_int_mm", "real_int_mm_epilogue"],
}


def _model(case):
    if case.startswith("fp8"):
        dynamic = "row" if "row" in case else "tensor" if "tensor" in case else None
        return fake_mlp(fp8_cfg(0 if "channel" in case else None, dynamic)), "scaled_mm"
    return fake_mlp(mtl.INT8_DEFAULT_CFG), "int_mm"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(EXPECTED))
def test_forward_with_kernels_op_list_and_output(ops, monkeypatch, case, dtype):
    """The real forward with the kernels routed in (as CUDA tensors are): one op per launch (W8A8 int_mm: codes,
    GEMM, epilogue = 3; FP8: codes, GEMM), no host read even on the first call, and the output equal to the
    pure-torch path's bit for bit."""
    fq, backend = _model(case)
    fq = fq.to(dtype)
    lin = fake2real(fq, inplace=False, backend=backend)[0]
    x = inputs(64, dtype)
    with torch.no_grad():
        want = lin(x)
        lin.__dict__.pop("_fast_cache", None)
        monkeypatch.setattr(LR, "kernel_ops", lambda t: ops if t.device.type == "cpu" else None)
        with OpCounter():
            lin(x)  # the first call prepares the weight side: still no host read
        with OpCounter() as c:
            got = lin(x)
    assert c.ops == EXPECTED[case]
    assert got.dtype == dtype and torch.equal(got, want), case


def test_ops_fall_back_to_the_chain_without_kernels():
    """The torch.library ops themselves equal the chains where no kernel serves the tensor (CPU here)."""
    x = special_rows((6, 48), torch.bfloat16, 3)
    d = torch.tensor([0.02])
    assert not LR.available(x)
    same(LR.real_fp8_static(x, d), LR.fp8_static_reference(x, d), "op static")
    for a, b in zip(LR.real_fp8_dynamic(x, True), LR.fp8_dynamic_reference(x, True)):
        same(a, b, "op dynamic", any_nan=True)
    xi = x.nan_to_num()
    assert torch.equal(LR.real_int8_codes(xi, d, -128, 127, 0, 17), LR.int8_codes_reference(xi, d, -128, 127, 0, 17))
    acc = torch.randint(-1000, 1000, (17, 48), dtype=torch.int32)
    s, b = torch.rand(1, 48), torch.randn(48)
    same(
        LR.real_int_mm_epilogue(acc, s, b, 6, torch.float16),
        LR.int_mm_epilogue_reference(acc, s, b, 6, torch.float16),
        "op epi",
    )


def test_binding_rejects_bad_arguments_by_name(ops):
    """The binding's checks (real_cuda_binding.cpp): the exact Python exception type, the op and argument named."""
    if isinstance(ops, HostOps):
        pytest.skip("the binding's checks: its host build only (opt-in)")
    x = torch.randn(4, 16)
    d = torch.tensor([0.5])
    cases = [
        (lambda: ops.real_fp8_static(x.int(), d), TypeError, r"real_fp8_static: x must be float32, float16 or bf"),
        (lambda: ops.real_fp8_static(x.reshape(-1), d), ValueError, r"real_fp8_static: x must be 2-D"),
        (lambda: ops.real_fp8_static(x, torch.ones(2)), ValueError, r"divisor must have 1 element"),
        (lambda: ops.real_fp8_static(x, d.double()), TypeError, r"divisor must be float32"),
        (lambda: ops.real_fp8_dynamic(x[None], True), ValueError, r"real_fp8_dynamic: x must be 2-D"),
        (lambda: ops.real_int8_codes(x, d, 5, 4, 0, 4), ValueError, r"real_int8_codes: bad range qmin=5"),
        (lambda: ops.real_int8_codes(x, d, 0, 255, 0, 4), ValueError, r"bad range qmin=0 qmax=255 shift=0"),
        (lambda: ops.real_int8_codes(x, d, -128, 127, 0, 3), ValueError, r"rows_out=3 for 4 rows"),
        (lambda: ops.real_int_mm_epilogue(x, torch.ones(1, 16), None, 4, torch.float16), TypeError, r"acc must be"),
        (
            lambda: ops.real_int_mm_epilogue(x.int(), torch.ones(1, 16), None, 5, torch.float16),
            ValueError,
            r"rows=5 outside acc's 4",
        ),
        (
            lambda: ops.real_int_mm_epilogue(x.int(), torch.ones(1, 8), None, 4, torch.float16),
            ValueError,
            r"scale_row must have 16 element",
        ),
        (
            lambda: ops.real_int_mm_epilogue(x.int(), torch.ones(1, 16), None, 4, torch.int8),
            TypeError,
            r"output dtype must be float32",
        ),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg) as info:
            call()
        assert type(info.value) is exc
