"""The real GPU paths on CUDA (issue 25): the fused W8A8 kernels (csrc/real_kernels.cu) bit for bit against the
pure-torch chains they replace (run on the same GPU, and on the CPU where the chains define every bit), and the
CUDA layouts of every fast path: FP8 ``_scaled_mm`` per tensor and row-wise, ``_int_mm`` with its column-major
weight, ``int4pack``; each forward's op list (codes, GEMM, epilogue), no host read, CUDA-graph capture.

Skipped without a GPU (conftest.py); tests/test_real_kernels_host.py runs the same kernels on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from fast_real_helpers import OpCounter, fake_mlp, fp8_cfg, inputs, int4_cfg
from real_kernel_ops import same, special_rows

import modelopt_lite as mtl
from modelopt_lite.functional import library_real as LR
from modelopt_lite.real import fake2real, fast_gemm

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 16), (6, 64), (17, 1000), (300, 4096)]


@pytest.fixture(scope="module")
def kernels(cuda_module):
    ns = LR.kernel_ops(torch.zeros(1, device="cuda"))
    if ns is None:
        pytest.fail("the CUDA extension loaded without the real W8A8 ops (csrc/real_cuda_binding.cpp)")
    return ns


@pytest.fixture(autouse=True)
def exact_bf16_gemm():
    saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_kernels_equal_chains(kernels, dtype, shape):
    x = special_rows(shape, dtype, shape[0] + shape[1])
    xc = x.cuda()
    for d in (0.37, 2.0**-20, float("inf")):
        div = torch.tensor([d])
        got = kernels.real_fp8_static(xc, div.cuda())
        same(got, LR.fp8_static_reference(xc, div.cuda()), f"static {dtype} {shape} d={d} (GPU chain)")
        fin = x.isfinite()  # the chain on the CPU: every finite element's code (a NaN code's sign is the device's)
        assert torch.equal(got.cpu().view(torch.uint8)[fin], LR.fp8_static_reference(x, div).view(torch.uint8)[fin])
    for per_row in (True, False):
        codes, scale = kernels.real_fp8_dynamic(xc, per_row)
        want_codes, want_scale = LR.fp8_dynamic_reference(xc, per_row)
        same(scale, want_scale, f"dynamic {dtype} {shape} {per_row} scale", any_nan=True)
        same(codes, want_codes, f"dynamic {dtype} {shape} {per_row} codes")
        cpu_codes, cpu_scale = LR.fp8_dynamic_reference(x, per_row)
        same(scale.cpu(), cpu_scale, "dynamic scale (CPU chain)", any_nan=True)
        same(codes.cpu(), cpu_codes, "dynamic codes (CPU chain)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_kernels_equal_chains(kernels, dtype, shape):
    x = special_rows(shape, dtype, 3 * shape[0] + shape[1]).nan_to_num(posinf=1e4, neginf=-1e4)
    xc = x.cuda()
    for qmin, qmax, shift in ((-128, 127, 0), (0, 255, 128)):
        for d in (1.0, 0.013, float("inf")):
            div = torch.tensor([d])
            rows_out = max(17, shape[0])
            got = kernels.real_int8_codes(xc, div.cuda(), qmin, qmax, shift, rows_out)
            assert torch.equal(got, LR.int8_codes_reference(xc, div.cuda(), qmin, qmax, shift, rows_out).cuda())
            assert torch.equal(got.cpu(), LR.int8_codes_reference(x, div, qmin, qmax, shift, rows_out))
    g = torch.Generator().manual_seed(shape[1])
    acc = torch.randint(-(2**30), 2**30, (max(17, shape[0]), shape[1]), generator=g, dtype=torch.int32)
    scale_row = torch.rand(1, shape[1], generator=g) * torch.logspace(-12, -2, shape[1])
    bias = torch.randn(shape[1], generator=g) * 100
    for b in (bias, None):
        args = (scale_row.cuda(), None if b is None else b.cuda(), shape[0], dtype)
        got = kernels.real_int_mm_epilogue(acc.cuda(), *args)
        same(got, LR.int_mm_epilogue_reference(acc.cuda(), *args), f"epilogue {dtype} {shape} (GPU addcmul)")
        same(got.cpu(), LR.int_mm_epilogue_reference(acc, scale_row, b, shape[0], dtype), "epilogue (CPU addcmul)")


CASES = {  # name: (config, in_features, path, the fused forward's ops)
    "fp8 tensor": (fp8_cfg(), 64, "scaled_mm", ["real_fp8_static", "_scaled_mm"]),
    "fp8 rowwise static": (fp8_cfg(0), 64, "scaled_mm", ["real_fp8_static", "_scaled_mm"]),
    "fp8 rowwise dynamic": (fp8_cfg(0, "row"), 64, "scaled_mm", ["real_fp8_dynamic", "_scaled_mm"]),
    "int8": (mtl.INT8_DEFAULT_CFG, 64, "int_mm", ["real_int8_codes", "_int_mm", "real_int_mm_epilogue"]),
    "int4 g32": (int4_cfg(32), 256, "int4pack", ["_weight_int4pack_mm", "add"]),
}


def _real(case, dtype):
    cfg, k, path, _ = CASES[case]
    fq = fake_mlp(cfg, dtype, dims=(k, 128, 32))
    real = fake2real(fq, inplace=False)  # "auto": on CUDA, bf16/fp16 modules take the fast paths
    return fq, real, k, path


@pytest.mark.parametrize(
    ("case", "dtype"),
    [(c, d) for c in CASES for d in (torch.bfloat16, torch.float16) if (c, d) != ("int4 g32", torch.float16)],
)
def test_fast_path_layouts_ops_and_outputs(kernels, monkeypatch, case, dtype):
    fq, real, k, path = _real(case, dtype)
    lin_cpu = real[0]
    lin = fake2real(fq, inplace=False)[0].cuda()
    rows = 1 if path == "int4pack" else 7
    x = inputs(k, dtype, rows=rows) if rows > 6 else inputs(k, dtype)[:1]
    xc = x.cuda()
    assert fast_gemm.route(lin, xc) == path
    with torch.no_grad():
        with OpCounter():
            lin(xc)  # the first call prepares the weight side: no host read
        with OpCounter() as c:
            y = lin(xc)
        p = fast_gemm.prepared(lin, path, xc)
        monkeypatch.setattr(LR, "kernel_ops", lambda t: None)
        y_chain = lin(xc)
        want = fq[0].cuda()(xc)
    assert c.ops == CASES[case][3], c.ops
    assert y.dtype == dtype and y.shape == (rows, lin.out_features)
    if path != "int4pack":
        assert torch.equal(y, y_chain), "the fused kernels change the output"
    bound = fast_gemm.error_bound(lin_cpu, path, x)
    assert bool(((y.double().cpu() - want.double().cpu()).abs() <= bound).all()), case
    if path == "scaled_mm":  # the E4M3 weight row-major (N, K): its transpose, the second operand, column-major
        assert p["w_t"].dtype == torch.float8_e4m3fn and p["w_t"].stride() == (1, k)
        if "rowwise" in case:
            assert p["scale_b"].shape == (1, lin.out_features)
    if path == "int_mm":  # column-major second operand (1.12x bf16 that way, 0.16x row-major on an H100)
        assert p["w_t"].dtype == torch.int8 and p["w_t"].stride() == (1, k)
        assert p["scale_row"].shape == (1, lin.out_features) and p["scale_row"].is_contiguous()


@pytest.mark.parametrize("case", ["fp8 tensor", "fp8 rowwise dynamic", "int8"])
def test_forward_captures_in_a_cuda_graph(kernels, case):
    _, real, k, _ = _real(case, torch.bfloat16)
    lin = real[0].cuda()
    x = inputs(k, torch.bfloat16, rows=24).cuda()
    with torch.no_grad():
        want = lin(x)  # warm-up: the weight side is prepared outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lin(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lin(x)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_int4_float16_on_cuda_dequantizes_and_forcing_int4pack_raises(kernels):
    """torch's CUDA int4 GEMM takes bfloat16 activations only: "auto" keeps a float16 module on its exact path."""
    fq, real, k, _ = _real("int4 g32", torch.float16)
    lin = fake2real(fq, inplace=False)[0].cuda()
    x = inputs(k, torch.float16)[:1]
    assert fast_gemm.route(lin, x.cuda()) is None
    with torch.no_grad():
        y = lin(x.cuda())
        want = fq[0].cuda()(x.cuda())
    assert y.dtype == torch.float16 and y.shape == (1, lin.out_features)
    bound = fast_gemm.error_bound(real[0], "dequant", x)
    assert bool(((y.double().cpu() - want.double().cpu()).abs() <= bound).all())
    forced = fake2real(fq, inplace=False, backend="int4pack")[0].cuda()
    with torch.no_grad(), pytest.raises(ValueError, match=r"^backend 'int4pack' on CUDA takes bfloat16 activations"):
        forced(x.cuda())


def test_int_mm_small_m_is_padded_by_the_codes_kernel(kernels):
    _, real, k, _ = _real("int8", torch.bfloat16)
    lin = real[0].cuda()
    with torch.no_grad():
        lin(inputs(k, torch.bfloat16).cuda())  # the first call prepares the weight side (counted elsewhere)
    for rows in (1, 16, 17):
        x = inputs(k, torch.bfloat16, rows=max(rows, 7))[:rows].cuda()
        with torch.no_grad(), OpCounter() as c:
            y = lin(x)
        assert y.shape == (rows, lin.out_features)
        assert c.ops == ["real_int8_codes", "_int_mm", "real_int_mm_epilogue"], c.ops
