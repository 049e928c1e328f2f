"""Block fake quantization along the last axis in one pass (functional/library_block.py, the native
``fake_block_last``), static and dynamic amax: bit-exact with the unfused path (block_amax, scale_from_amax, the
per-block op) for integer and E4M3 elements, every dtype, strided inputs, partial / dead / tiny / near-overflow
blocks, clipping static amax, both kernel implementations (AVX2 and scalar); the same errors for a NaN/Inf input
(dynamic) or a bad static amax; the same straight-through gradient; taken only where it applies."""

from __future__ import annotations

import pytest
import torch

import modelopt_lite.tensor_quant as tq
from modelopt_lite.functional import backend, library_block

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (bits or (E, M), narrow_range)
FORMATS = ((4, False), (8, True), (3, False), ((4, 3), False))


def _x(rows: int, cols: int, dtype: torch.dtype, strided: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cols, rows, generator=g).t() if strided else torch.randn(rows, cols, generator=g)
    x = x * torch.logspace(-2, 2, cols)  # blocks of very different ranges
    x[0, :] = 0.0  # dead blocks
    x[1, :] = 1e-30  # tiny amax: dead (<= 2**-24)
    if dtype == torch.float32:
        x[2, :3] = torch.tensor([3.4028234663852886e38, -1.0, 2.5])  # the grid end bound * scale overflows
    x[3, :8] = torch.tensor([0.5, 1.5, 2.5, -2.5, 7.0, -7.0, 3.5, -0.5])  # ties with amax 7
    return x.to(dtype)


def _static_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """The data's block amax times factors in [0.25, 2) (clipping and slack), one block 0 and one near float32's max."""
    a = tq.blocks.block_amax(x, {-1: block})
    a = a * (torch.rand(a.shape, generator=torch.Generator().manual_seed(5)) * 1.75 + 0.25)
    a = torch.clamp(a, max=3.4028234663852886e38)  # x's near-overflow blocks stay finite
    a[-1, 0] = 0.0
    a[-1, -1] = 3.4028234663852886e38
    return a


def _both(fn, *args):
    with backend.use_backend("reference"):
        want = fn(*args)
    with backend.use_backend("native"):
        got = fn(*args)
    return want, got


def _same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got, want), f"{what}: differs at {(got != want).nonzero()[:5].tolist()}"
    assert torch.equal(torch.signbit(got), torch.signbit(want)), f"{what}: the sign of zero differs"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_public_api_equals_reference(native, impl, dtype, strided):
    x = _x(6, 1000, dtype, strided)  # 1000 = 7 full blocks of 128 + 104: AVX2 steps, tails and a partial block
    for block in (4, 16, 128, 2000):
        for bits, narrow in FORMATS:
            sizes = {-1: block}
            for amax in (None, _static_amax(x, block)):
                want, got = _both(tq.fake_block_quant, x, sizes, amax, bits, False, narrow)
                _same(got, want, f"block {block} bits {bits} {'dynamic' if amax is None else 'static'}")


def test_the_fused_op_is_taken_only_where_it_applies(native, monkeypatch):
    x = _x(4, 64, torch.float32, False)
    calls = []
    real = library_block.fake_block_last
    monkeypatch.setattr(library_block, "fake_block_last", lambda *a: calls.append(a[2:]) or real(*a))
    amax = tq.blocks.block_amax(x, {-1: 16})
    with backend.use_backend("native"):
        tq.fake_block_quant(x, {-1: 16}, None, 4)
        tq.fake_block_quant(x, {1: 32, "type": "dynamic"}, None, (4, 3))
        tq.fake_block_quant(x, {-1: 16}, amax.clamp(max=1e3).half(), 8)  # static: converted to float32
        assert calls == [(16, 0, 7.0, -8, 7), (32, 1, 448.0, 0, 0), (16, 0, 127.0, -128, 127)]
        tq.fake_block_quant(x, {0: 2}, None, 4)  # not the last axis
        tq.fake_block_quant(x, {-1: 16, "scale_bits": 8}, None, 4)  # double quantization
        tq.fake_block_quant(x.abs(), {-1: 16}, None, 4, True)  # unsigned: the input check
        tq.fake_block_quant(x, {-1: 16}, amax.clone().requires_grad_(True), 4)  # a learnable amax
        tq.fake_block_quant(x, {-1: 16}, 3.0, 4)  # one amax for all blocks
        tq.fake_block_quant(x, {-1: 16}, None, (5, 2))  # E5M2
    with backend.use_backend("reference"):
        tq.fake_block_quant(x, {-1: 16}, None, 4)  # no such kernel
    assert len(calls) == 3


def test_native_scales_and_outputs_equal_the_reference_op(native, impl):
    x = _x(5, 300, torch.bfloat16, False)
    for kind, bound, qmin, qmax in ((0, 7.0, -8, 7), (1, 448.0, 0, 0)):
        for amax in (None, _static_amax(x, 32)):
            keep = None if amax is None else amax.clone()
            y, s, bad = native.fake_block_last(x, amax, 32, kind, bound, qmin, qmax)
            ry, rs = library_block._reference(x, amax, 32, kind, bound, qmin, qmax)
            assert bad is False and s.dtype == torch.float32 and s.shape == (5, 10)
            _same(y, ry, f"kind {kind} y")
            _same(s, rs, f"kind {kind} scales")
            assert amax is None or torch.equal(amax, keep)  # the caller's amax is not touched


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_raises_the_reference_error(native, impl, bad):
    x = _x(4, 70, torch.float32, False)
    x[3, 65] = bad
    msgs = []
    for name in ("reference", "native"):
        with backend.use_backend(name), pytest.raises(ValueError, match="contains NaN or Inf") as e:
            tq.fake_block_quant(x, {-1: 32}, None, 4)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "block (3, 2)" in msgs[1]
    y, _, flagged = native.fake_block_last(x, None, 32, 0, 7.0, -8, 7)
    assert flagged is True and y.shape == x.shape
    amax = tq.blocks.block_amax(_x(4, 70, torch.float32, False), {-1: 32})
    want, got = _both(tq.fake_block_quant, x, {-1: 32}, amax, 4)  # a static amax: x's NaN/Inf pass through
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_static_amax_raises_the_reference_error(native, impl, bad):
    x = _x(4, 70, torch.float32, False)
    amax = tq.blocks.block_amax(x, {-1: 32})
    amax[2, 1] = bad
    msgs = []
    for name in ("reference", "native"):
        with backend.use_backend(name), pytest.raises(ValueError, match="block amax must be finite and >= 0") as e:
            tq.fake_block_quant(x, {-1: 32}, amax, 4)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


@pytest.mark.parametrize("bits", [4, (4, 3)], ids=["int4", "e4m3"])
def test_gradient_equals_reference(native, impl, bits):
    x0 = _x(4, 50, torch.float32, False)
    g = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    grads = []
    for name in ("reference", "native"):
        x = x0.clone().requires_grad_(True)
        with backend.use_backend(name):
            tq.fake_block_quant(x, {-1: 16}, None, bits).backward(g)
        grads.append(x.grad)
    _same(grads[1], grads[0], "grad")
    assert torch.equal(grads[1][0], g[0]) and not grads[1][1].any()  # zero rows pass, tiny (dead) rows do not


def test_op_registration(native):
    x = _x(4, 40, torch.float16, False)
    with backend.use_backend("native"):
        y, s = library_block.fake_block_last(x, None, 16, 0, 7.0, -8, 7)
        assert y.dtype == torch.float16 and s.shape == (4, 3) and s.dtype == torch.float32
        torch.library.opcheck(library_block.fake_block_last, (x.float(), None, 16, 0, 7.0, -8, 7))
        torch.library.opcheck(library_block.fake_block_last, (x.float(), s, 16, 1, 448.0, 0, 0))
