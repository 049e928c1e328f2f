"""The CUDA kernels equal the pure-torch reference (run on the CPU) bit for bit.

Run on a machine with a GPU: ``python -m pytest -q tests/gpu`` (the first test JIT-builds the extension, about a
minute). Everything here is skipped without CUDA (see conftest.py). The matrix itself is in cuda_cases.py.
"""

from __future__ import annotations

import importlib
import math

import cuda_cases
import pytest
import torch
from cuda_cases import (
    affine_checks,
    assert_same,
    binding_checks,
    e4m3_checks,
    edge_checks,
    int_checks,
    run_check,
)
from isolated_cases import run_isolated

from modelopt_lite.functional import backend
from modelopt_lite.functional import reference as ref

GROUPS = {
    "int": int_checks,
    "e4m3": e4m3_checks,
    "affine": affine_checks,
    "edge": edge_checks,
    "binding": binding_checks,
}
MB = 1 << 20


def _free_bytes() -> int:
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("group", list(GROUPS))
def test_matrix_equals_reference(cuda_module, group):
    failures = []
    for check in GROUPS[group]():
        try:
            run_check(cuda_module, "cuda", check)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("function", ["error_cases", "device_error_cases"])
def test_errors_are_raised_on_the_host(cuda_module, function):
    """Each bad-argument case raises its exception; they run in child processes (isolated_cases.py), so a case that
    crashes the process (SIGSEGV on the first GPU run) fails with its signal instead of ending the session."""
    total, failures = run_isolated("cuda_cases", function, "cuda")
    assert total == len(getattr(cuda_cases, function)("cpu"))
    assert not failures, f"{len(failures)} of {total} cases failed:\n" + "\n".join(failures)


def test_unsigned_flagged_bindings_flag_negative_inputs(cuda_module):
    failures = cuda_cases.unsigned_flag_failures(cuda_module, "cuda")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_backend_routes_cuda_tensors_to_the_kernels(cuda_module):
    with backend.use_backend("native"):
        mod = backend.kernels_for("cuda")
    assert mod is not ref and hasattr(mod, "fake_quant_int")
    assert backend.precompile(("cuda",))["cuda"] == "ok"


def test_public_api_on_cuda_equals_cpu_reference():
    tq = importlib.import_module("modelopt_lite.tensor_quant")  # the module (the package attribute is a function)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * 3
    amax = x.abs().amax(dim=1, keepdim=True) * 0.8
    amax[3] = 0.0
    calls = [
        ("int8 per-row", lambda t, a: tq.fake_tensor_quant(t, a, 8, False, False)),
        ("int4 narrow", lambda t, a: tq.fake_tensor_quant(t, a, 4, False, True)),
        ("unsigned 8", lambda t, a: tq.fake_tensor_quant(t.abs(), a, 8, True, False)),
        ("e4m3", lambda t, a: tq.fake_tensor_quant(t, a, (4, 3))),
        ("codes", lambda t, a: tq.tensor_quant(t, a, 8, False, False)),
        ("fp16", lambda t, a: tq.fake_tensor_quant(t.half(), a, 8, False, False)),
        ("bf16 e4m3", lambda t, a: tq.scaled_e4m3(t.bfloat16(), a)),
        ("affine", lambda t, a: tq.fake_affine_tensor_quant(t, t.amin(), t.amax() * 0.5, 8)),
        ("block 16", lambda t, a: tq.fake_block_quant(t, {-1: 16}, None, 4)),
        ("block 2-D", lambda t, a: tq.fake_block_quant(t, {0: 4, -1: 16}, None, 4)),
        ("block double", lambda t, a: tq.fake_block_quant(t, {-1: 16, "scale_bits": 8}, None, 4)),
        ("block e4m3", lambda t, a: tq.fake_block_quant(t, {-1: 32}, None, (4, 3))),
    ]
    for what, call in calls:
        with backend.use_backend("native"):
            got = call(x.cuda(), amax.cuda())
        with backend.use_backend("reference"):
            want = call(x, amax)
        assert_same(got, want, what)


def test_autograd_on_cuda_matches_cpu():
    tq = importlib.import_module("modelopt_lite.tensor_quant")  # the module (the package attribute is a function)

    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(32, 40, generator=g)
    a0 = x0.abs().amax(dim=1, keepdim=True) * 0.7
    grad = torch.randn(32, 40, generator=g)
    results = {}
    for dev, name in (("cuda", "native"), ("cpu", "reference")):
        x = x0.to(dev).requires_grad_()
        a = a0.to(dev).requires_grad_()
        with backend.use_backend(name):
            tq.fake_tensor_quant(x, a, 4, False, False).backward(grad.to(dev))
        results[dev] = (x.grad.cpu(), a.grad.cpu())
    assert_same(results["cuda"][0], results["cpu"][0], "grad x")
    # amax gradient: per-element terms are exact; their sum is reduced by torch (order differs across devices)
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], rtol=1e-5, atol=1e-6)


def _check_slices(y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, slices, what: str) -> None:
    for sl in slices:
        want = ref.fake_quant_int(x[sl].cpu(), scale.cpu(), -128, 127)
        assert_same(y[sl], want, f"{what} {sl}")


def test_more_than_2_31_elements(cuda_module):
    n = 2**31 + 17
    if _free_bytes() < 3 * 2 * n + 4 * n + 2**30:
        pytest.skip("needs about 18 GB of free GPU memory")
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    s = torch.tensor(0.02, device="cuda")
    y = cuda_module.fake_quant_int(x, s, -128, 127)
    _check_slices(y, x, s, [slice(0, MB), slice(2**31 - MB, 2**31 + 17), slice(n - MB, n)], "flat fp16")
    del y
    gx, term = cuda_module.int_backward(x, x, s, -128, 127, True)
    tail = slice(n - MB, n)
    assert_same(
        (gx[tail], term[tail]),
        ref.int_backward(x[tail].cpu(), x[tail].cpu(), s.cpu(), -128, 127, True),
        "backward tail",
    )
    del gx, term, x
    x = torch.randn(3, 2**30 + 5, dtype=torch.float16, device="cuda")  # channel 2 starts past 2**31
    s = torch.tensor([[0.01], [0.02], [0.03]], device="cuda")
    y = cuda_module.fake_quant_int(x, s, -128, 127)
    for c in range(3):
        want = ref.fake_quant_int(x[c, -MB:].cpu(), s[c].cpu(), -128, 127)
        assert_same(y[c, -MB:], want, f"axis 0 channel {c}")
    del x, y
    x = torch.randn(2**28 + 3, 9, dtype=torch.float16, device="cuda")  # last axis, 2.4e9 elements
    s = torch.linspace(0.01, 0.05, 9, device="cuda").reshape(1, 9)
    y = cuda_module.fake_quant_int(x, s, -128, 127)
    assert_same(y[-MB:], ref.fake_quant_int(x[-MB:].cpu(), s.cpu(), -128, 127), "last axis tail")


def test_runs_on_the_current_stream_in_order(cuda_module):
    n = 1 << 24
    src = torch.randn(n, device="cuda")
    grad = torch.randn(n, device="cuda")
    scale = torch.tensor(0.05, device="cuda")
    x = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy: work on any other stream would run first
        x.copy_(src)
        y = cuda_module.fake_quant_int(x, scale, -128, 127)
        e = cuda_module.fake_e4m3(x, scale)
        gx, term = cuda_module.int_backward(grad, x, scale, -128, 127, True)
        hist = cuda_module.histogram(x.abs(), 256, 8.0)
    side.synchronize()
    xc, sc = src.cpu(), scale.cpu()
    assert_same(y, ref.fake_quant_int(xc, sc, -128, 127), "int on a side stream")
    assert_same(e, ref.fake_e4m3(xc, sc), "e4m3 on a side stream")
    assert_same((gx, term), ref.int_backward(grad.cpu(), xc, sc, -128, 127, True), "backward on a side stream")
    assert int(hist.sum()) == n  # every |x| < 16 = 256 * 2**needed_exp(8.0, 256)


def test_second_device(cuda_module):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x = torch.randn(1000, 33, device="cuda:1")
    with torch.cuda.device(0):
        s1 = x.abs().amax(dim=0, keepdim=True) / 127
        y = cuda_module.fake_quant_int(x, s1, -128, 127)
        y0 = cuda_module.fake_quant_int(x, s1.to("cuda:0"), -128, 127)  # scale on another device: moved to x's
        gx, _ = cuda_module.int_backward(x, x, s1, -128, 127, False)
    assert y.device == x.device == y0.device == gx.device
    want = ref.fake_quant_int(x.cpu(), s1.cpu(), -128, 127)
    assert_same(y, want, "cuda:1")
    assert_same(y0, want, "cuda:1 with the scale on cuda:0")


def test_histograms_match_the_calibrator_grid(cuda_module):
    grid = pytest.importorskip("modelopt_lite.calib.grid")
    g = torch.Generator().manual_seed(2)
    a = torch.randn(300, 5000, generator=g).abs() * torch.logspace(-30, 30, 300).reshape(-1, 1).float()
    a[7] = 0.0
    for cap in (2, 2048, 20000):  # 20000 bins: the global-atomics path
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            t = a.to(dt)
            finite = torch.isfinite(t.double()).all(dim=1)
            t = t[finite]
            exps = grid.needed_exp(t.double().amax(dim=1), cap)
            got = cuda_module.histogram_rows(t.cuda(), exps.cuda(), cap)
            want = grid.histogram_rows(t.double() if dt == torch.float64 else t.float(), exps, cap)
            assert torch.equal(got.cpu(), want), (cap, dt)
    # the kernels bin in float32 where 2**-e is a normal float32 (|e| <= 126), else in float64: both sides, products
    # below 2**-126 or overflowing to +Inf, values at or past the top edge (not counted)
    # (and values with no bin: NaN, negative, +-Inf, which the shared-memory path counts into per-lane spare counters)
    vals = [0.0, -0.0, 1.0, 2.0**-126, 2.0**-149, 1e-30, 3.0e38, 65504.0, 2.0**-14, 1.5, 2.0**100, 2.0**-100]
    vals += [math.nan, -1.0, -math.inf, math.inf]
    edge_exps = torch.tensor([126, 127, -126, -127, 120, -100, 0, -5], dtype=torch.int64)
    for cap in (1, 3, 2048):
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            t = torch.tensor([vals] * 8, dtype=torch.float64).to(dt)
            v = t.double() * torch.pow(torch.tensor(2.0, dtype=torch.float64), -edge_exps.double()).reshape(-1, 1)
            keep = (v >= 0) & (v < cap)
            idx = v.clamp(0, cap - 1).long() + torch.arange(8).reshape(-1, 1) * cap
            want = torch.bincount(idx[keep], minlength=8 * cap).reshape(8, cap)
            got = cuda_module.histogram_rows(t.cuda(), edge_exps.cuda(), cap)
            assert torch.equal(got.cpu(), want), ("edges", cap, dt)
    none = torch.full((2, 4099), math.nan, device="cuda")  # whole warps of values with no bin: every count 0
    none[1] = -(torch.arange(4099, device="cuda") % 7) - 0.5
    none[1, ::2] = 1e30
    assert torch.equal(
        cuda_module.histogram_rows(none, torch.zeros(2, dtype=torch.int64, device="cuda"), 2048).cpu(),
        torch.zeros(2, 2048, dtype=torch.int64),
    )
    big = torch.zeros(1, 2**25 + 3, device="cuda")  # one bin holds 2**25 values: float32 counts would be wrong
    big[0, :1000] = 1.0
    exps = grid.needed_exp(torch.tensor([1.0]), 2048)
    counts = cuda_module.histogram_rows(big, exps.cuda(), 2048)
    assert int(counts[0, 0]) == 2**25 + 3 - 1000 and int(counts.sum()) == 2**25 + 3
    v = torch.randn(10**6, generator=g).abs().cuda()
    m = float(v.max())
    want = grid.histogram_rows(v.cpu().reshape(1, -1), grid.needed_exp(torch.tensor([m]), 2048), 2048)[0]
    assert torch.equal(cuda_module.histogram(v, 2048, m).cpu(), want)
