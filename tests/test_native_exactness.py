"""The native CPU kernels equal the pure-torch reference bit for bit (torch.equal, NaN where the reference has NaN).

Compared through the public API under ``use_backend("native")`` vs ``use_backend("reference")`` and op by op,
over a compact matrix: bits x unsigned x narrow_range x granularity (per tensor, axis 0 / last / negative / tuple,
blocks with padding, 2-D, dynamic and double-quantized) x dtype, with ties, values beyond amax, dead slices
(amax 0 and 1e-26), NaN/inf, non-contiguous and empty inputs; E4M3; affine; the backward ops; both kernel
implementations (AVX2 and scalar). Tensors are small (a few hundred elements) to keep the file fast.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import modelopt_lite.tensor_quant as tq
from modelopt_lite.formats import int_range
from modelopt_lite.functional import backend, native_build
from modelopt_lite.functional import reference as R

BITS = (2, 3, 4, 5, 7, 8, 11, 16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPE = (4, 6, 10)  # rows of 10 and 60 elements: AVX2 steps of 8 plus scalar tails
# granularity -> amax shape on SHAPE (None: per tensor)
AXES = {"tensor": (), "axis0": (4, 1, 1), "last": (1, 1, 10), "neg": (1, 6, 1), "tuple02": (4, 1, 10)}
BLOCKS = {
    "blk_pad_dynamic": ({-1: 4}, None),  # 10 -> 12: a padded last block, amax from the data
    "blk_2d_static": ({0: 2, -1: 4}, (2, 6, 3)),
    "blk_dq_int8": ({-1: 4, "scale_bits": 8}, None),
    "blk_dq_e4m3": ({-1: 4, "scale_bits": (4, 3)}, None),
}


def same(a, b, what=""):
    """Bit-level agreement: dtype, shape, NaN positions, and torch.equal plus the sign bit elsewhere."""
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"{what}: NaN positions differ"
    assert torch.equal(a[~na], b[~nb]), f"{what}: values differ at {(a != b).nonzero()[:5].tolist()}"
    if a.is_floating_point():  # torch.equal treats -0.0 == 0.0: the sign of zero must agree too
        sa, sb = torch.signbit(a[~na]), torch.signbit(b[~nb])
        assert torch.equal(sa, sb), f"{what}: the sign of zero differs at {(sa != sb).nonzero()[:5].tolist()}"


def both(fn, *args):
    """fn(*args) under the reference and the native backend."""
    with backend.use_backend("reference"):
        ref = fn(*args)
    with backend.use_backend("native"):
        nat = fn(*args)
    return ref, nat


def make_amax(shape, bound, gen, dead=True):
    """Random amax plus power-of-two ones (exact .5 ties); dead channels (0 and 1e-26) when per-channel."""
    n = max(1, int(torch.tensor(shape).prod())) if shape else 1
    a = torch.rand(n, generator=gen) * 3 + 0.1
    a[::2] = bound * 2.0 ** -torch.randint(0, 6, (len(a[::2]),), generator=gen).float()
    if dead and n > 2:
        a[1], a[2] = 0.0, 1e-26
    return a.reshape(shape)


def make_x(amax, unsigned, dtype, gen, shape=SHAPE, bound=127):
    """Values inside, on ties of, and beyond the range, plus NaN/inf/-0/subnormals."""
    a = amax.expand(shape).float()
    s = torch.where(a > 0, a / bound, torch.ones_like(a))
    x = torch.randn(shape, generator=gen) * a * 0.8
    ties = (torch.randint(-bound, bound, shape, generator=gen).float() + 0.5) * s
    x = torch.where(torch.rand(shape, generator=gen) < 0.3, ties, x)
    x = torch.where(torch.rand(shape, generator=gen) < 0.1, x * 7, x)  # beyond amax
    flat = x.view(-1)
    flat[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -3e-39])
    if unsigned:  # NaN is refused by unsigned quantization (tests/test_nan_range_checks.py): a positive value instead
        x = x.abs().nan_to_num(nan=0.25, posinf=float("inf"))
    return x.to(dtype)


def _int_fq(x, amax, bits, unsigned, narrow):
    return tq.fake_tensor_quant(x, amax, bits, unsigned, narrow)


def _affine_fq(x, _amax, lo, hi, bits):
    return tq.fake_affine_tensor_quant(x, lo, hi, bits)


def _fwd_bwd(fn, x, amax, g):
    """Forward and backward of fn(x, amax): (y, x.grad, amax.grad)."""
    xx = x.detach().clone().requires_grad_(True)
    aa = amax.detach().clone().requires_grad_(True) if amax is not None else None
    y = fn(xx, aa)
    y.backward(g)
    return y.detach(), xx.grad, aa.grad if aa is not None else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("unsigned", [False, True])
@pytest.mark.parametrize("bits", BITS)
def test_int_public_api(bits, unsigned, narrow, dtype, native):
    gen = torch.Generator().manual_seed(bits * 4 + 2 * unsigned + narrow)
    bound = int_range(bits, unsigned, narrow).bound
    for name, ashape in AXES.items():
        amax = make_amax(ashape, bound, gen)
        x = make_x(amax, unsigned, dtype, gen, bound=bound)
        g = torch.randn(SHAPE, generator=gen).to(dtype)
        fn = functools.partial(_int_fq, bits=bits, unsigned=unsigned, narrow=narrow)
        ref, nat = both(_fwd_bwd, fn, x, amax, g)
        for r, n, what in zip(ref, nat, ("y", "grad_x", "grad_amax")):
            same(n, r, f"{name} {what}")
        dead = amax.expand(SHAPE) <= 2.0**-24
        assert bool((nat[0][dead] == 0).all()), "dead channels must be exact zeros (never NaN)"
        ref, nat = both(tq.tensor_quant, x, amax, bits, unsigned, narrow)
        same(nat[0], ref[0], f"{name} codes")
    for name, (sizes, ashape) in BLOCKS.items():
        amax = make_amax(ashape, bound, gen, dead=True) if ashape else None
        xb = make_x(torch.tensor(1.0), unsigned, torch.float32, gen, bound=bound)
        xb = torch.nan_to_num(xb, nan=0.0, posinf=9.0, neginf=-9.0).to(dtype)  # dynamic amax must stay finite
        xb[0, 1] = 0.0  # an all-zero (dead) block row
        ref, nat = both(tq.fake_block_quant, xb, sizes, amax, bits, unsigned, narrow)
        same(nat, ref, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dead_per_tensor_and_tiny_amax(dtype, native):
    x = torch.randn(5, 7).to(dtype)
    x[0, 0] = float("nan")
    for amax in (0.0, 1e-26, 2.0**-24):
        ref, nat = both(tq.fake_tensor_quant, x, torch.tensor(amax), 8)
        same(nat, ref)
        assert torch.equal(nat, torch.zeros_like(x))  # dead: exact zeros, even where x is NaN
        ref, nat = both(tq.scaled_e4m3, x, torch.tensor(amax))
        same(nat, ref)
        assert torch.equal(nat, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_e4m3_public_api(dtype, native):
    gen = torch.Generator().manual_seed(7)
    for name, ashape in list(AXES.items()) + [("none", None)]:
        amax = make_amax(ashape, 448, gen) if ashape is not None else None
        a = amax if amax is not None else torch.tensor(448.0)
        x = make_x(a, False, torch.float32, gen, bound=448)
        x = torch.where(torch.rand(SHAPE, generator=gen) < 0.2, x * 2.0**-12, x)  # e4m3 subnormals
        x = torch.where(torch.rand(SHAPE, generator=gen) < 0.1, x * 3, x).to(dtype)  # overflow: saturates
        g = torch.randn(SHAPE, generator=gen).to(dtype)
        ref, nat = both(_fwd_bwd, tq.scaled_e4m3, x, amax, g)
        for r, n, what in zip(ref, nat, ("y", "grad_x", "grad_amax")):
            same(n, r, f"{name} {what}")
    xb = make_x(torch.tensor(3.0), False, torch.float32, gen, bound=448)
    xb = torch.nan_to_num(xb, nan=0.0, posinf=9.0, neginf=-9.0).to(dtype)  # dynamic amax must stay finite
    ref, nat = both(tq.fake_block_quant, xb, {-1: 4}, None, (4, 3))
    same(nat, ref, "e4m3 blocks")


def test_e4m3_saturation_value(native):
    x = torch.tensor([1e9, -1e9, 450.0, -448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, float("inf")])
    with backend.use_backend("native"):
        y = tq.scaled_e4m3(x, torch.tensor(448.0))
        y2 = tq.scaled_e4m3(x * 3, torch.tensor(2.0))  # scale 2/448: overflow saturates to +-448 * scale
    assert torch.equal(y, torch.tensor([448.0, -448.0, 448.0, -448.0, 2.0**-9, 0.0, 2 * 2.0**-9, 448.0]))
    s = torch.tensor(2.0) / 448
    assert y2[0].item() == (448 * s).item() and y2[1].item() == (-448 * s).item() and y2[7].item() == (448 * s).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_affine_public_api(bits, dtype, native):
    gen = torch.Generator().manual_seed(bits)
    for lo, hi in (
        (torch.tensor(-1.5), torch.tensor(3.0)),
        (torch.tensor(0.5), torch.tensor(2.0)),
        (torch.tensor([-1.0, 0.0, -2.0, -0.3]).view(4, 1, 1), torch.tensor([2.0, 0.0, -1.0, 5.0]).view(4, 1, 1)),
    ):
        x = (torch.randn(SHAPE, generator=gen) * 3).to(dtype)
        x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
        g = torch.randn(SHAPE, generator=gen).to(dtype)
        fn = functools.partial(_affine_fq, lo=lo, hi=hi, bits=bits)
        ref, nat = both(_fwd_bwd, fn, x, None, g)
        for r, n, what in zip(ref, nat, ("y", "grad_x", "grad_amax")):
            same(n, r, what)
        ref, nat = both(tq.affine_tensor_quant, x, lo, hi, bits)
        same(nat[0], ref[0], "affine codes")


# --- op level: the module functions against reference.py ------------------------------------------------------------
def _scale(shape, gen):
    s = torch.rand(shape, generator=gen) * 0.2 + 0.01
    s.view(-1)[0] = 0.0  # a dead slice
    return s


def _op_cases(gen):
    """(x, scale) pairs: layouts, broadcasts, tails, empty and 0-dim tensors."""
    base = torch.randn(6, 7, 19, generator=gen) * 2
    base.view(-1)[::37] = float("nan")
    yield base, _scale((1,), gen)
    yield base.transpose(0, 2), _scale((19, 1, 1), gen)  # non-contiguous, per-channel
    yield base[:, ::2, 3:], _scale((1, 4, 16), gen)  # strided slice, scale over two dims
    yield base[:1].expand(3, 7, 19), _scale((3, 1, 19), gen)  # stride-0 input
    yield base[0, 0, :1].reshape(1, 1), _scale((5, 1), gen)  # x broadcast up to the scale's shape
    yield base[:, :, :1].permute(2, 0, 1)[0], _scale((6, 1), gen)  # column view
    yield torch.empty(0, 5), _scale((1, 5), gen)
    yield torch.empty(3, 0, 2), _scale((3, 1, 1), gen)
    yield torch.tensor(2.7), torch.tensor(0.5)
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 33, 47, 64, 65):
        yield torch.randn(3, n, generator=gen) * 3, _scale((1, n), gen)
        yield torch.randn(n, 3, generator=gen) * 3, _scale((n, 1), gen)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,), ids=str)
def test_ops_direct(dtype, impl, native):
    gen = torch.Generator().manual_seed(11)
    for i, (x, s) in enumerate(_op_cases(gen)):
        x = x.to(dtype)
        zp = torch.randint(-3, 4, s.shape, generator=gen).float()
        g = torch.randn(torch.broadcast_shapes(x.shape, s.shape), generator=gen).to(dtype)
        for f in ("fake_quant_int", "quantize_int"):
            for qmin, qmax in ((-8, 7), (0, 255), (-32768, 32767)):
                same(getattr(native, f)(x, s, qmin, qmax), getattr(R, f)(x, s, qmin, qmax), f"{f} case {i}")
        same(native.fake_e4m3(x, s), R.fake_e4m3(x, s), f"e4m3 case {i}")
        for f in ("fake_affine", "quantize_affine"):
            same(getattr(native, f)(x, s, zp, -8, 7), getattr(R, f)(x, s, zp, -8, 7), f"{f} case {i}")
        same(native.affine_backward(g, x, s, zp, -8, 7), R.affine_backward(g, x, s, zp, -8, 7), f"affine bwd {i}")
        for need in (False, True):
            for a, b in zip(native.int_backward(g, x, s, -128, 127, need), R.int_backward(g, x, s, -128, 127, need)):
                same(a, b, f"int bwd case {i}")
            for a, b in zip(native.e4m3_backward(g, x, s, need), R.e4m3_backward(g, x, s, need)):
                same(a, b, f"e4m3 bwd case {i}")


def test_zero_point_shape_differs_from_scale(native, impl):
    x = torch.randn(3, 20) * 4
    zp = torch.randint(-5, 6, (1, 20)).float()
    for s in (torch.tensor(0.0), torch.tensor([0.3]), torch.tensor([[0.2], [0.0], [0.5]])):
        for f in ("fake_affine", "quantize_affine"):
            same(getattr(native, f)(x, s, zp, -8, 7), getattr(R, f)(x, s, zp, -8, 7), f"{f} {tuple(s.shape)}")
        same(native.affine_backward(x, x, s, zp, -8, 7), R.affine_backward(x, x, s, zp, -8, 7))


def test_grad_dtype_differs_from_x(native):
    x = torch.randn(5, 9).half()
    s, g = torch.tensor([0.01]), torch.randn(5, 9)
    for a, b in zip(native.int_backward(g, x, s, -8, 7, True), R.int_backward(g, x, s, -8, 7, True)):
        same(a, b)
    assert native.int_backward(g, x, s, -8, 7, False)[0].dtype == torch.float32


def test_library_ops_dispatch_to_native(native):
    x, s = torch.randn(3, 50), torch.rand(3, 1) * 0.1
    ops = torch.ops.modelopt_lite
    for op, args in ((ops.fake_quant_int, (-128, 127)), (ops.fake_e4m3, ()), (ops.quantize_int, (0, 15))):
        ref, nat = both(op, x, s, *args)
        same(nat, ref)


def test_native_rejects_bad_arguments(native):
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16, got Int"):
        native.fake_quant_int(torch.ones(3, dtype=torch.int32), torch.tensor(1.0), -8, 7)
    with pytest.raises(TypeError, match="scale must be float32, got Double"):
        native.fake_quant_int(torch.ones(3), torch.tensor(1.0, dtype=torch.float64), -8, 7)
    with pytest.raises(RuntimeError, match="size"):
        native.fake_quant_int(torch.ones(3, 4), torch.ones(5, 1), -8, 7)
    with pytest.raises(ValueError, match="must be 'auto', 'avx512', 'avx2' or 'scalar', got 'sse'"):
        native.set_kernel_impl("sse")


def test_conversions_sample(native, impl):
    """float32 -> float16/bfloat16 rounding of the kernels on a sample of all bit patterns (ties, overflow)."""
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat(
        [x, torch.tensor([65504.0, 65520.0, 65519.996, 2.0**-24 * 1.5, 2.0**-25, 1 + 2.0**-8, 1 + 3 * 2.0**-8])]
    )
    for bf16, dt in ((False, torch.float16), (True, torch.bfloat16)):
        same(native.round_float32(x, bf16).float(), x.to(dt).float(), str(dt))


# --- the build: cache, locks ---------------------------------------------------------------------------------------
def test_stale_torch_baton_is_removed_under_the_build_lock(tmp_path):
    (tmp_path / "lock").write_text("")  # left behind by a killed build: torch would wait on it forever
    with native_build._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_build_lock_excludes_and_times_out(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(tmp_path / ".build.flock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another builder holds the folder
        with pytest.raises(TimeoutError, match="another process"), native_build._build_lock(tmp_path, timeout_s=0.3):
            pass
    finally:
        os.close(fd)  # the holder dies: its lock goes with it
    with native_build._build_lock(tmp_path, timeout_s=0.3):
        pass


def test_header_changes_change_the_build_key(tmp_path):
    (tmp_path / "k.cpp").write_text('#include "a.h"\n#include <vector>\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n')
    (tmp_path / "b.h").write_text("int v = 1;\n")
    deps = native_build.local_deps([tmp_path / "k.cpp"])
    assert [f.name for f in deps] == ["k.cpp", "a.h", "b.h"]
    before = native_build._digest(deps, ["-O3"])
    (tmp_path / "b.h").write_text("int v = 2;\n")
    assert native_build._digest(deps, ["-O3"]) != before != native_build._digest(deps, ["-O2"])


def test_cached_build_loads_without_compiling(native):
    name, build_dir = native_build.build_dir_for("cpu")
    assert (build_dir / native_build._MARKER).read_text() == name
    mod = native_build._import_built(name, build_dir)
    assert mod is not None and mod.kernel_impl() in ("avx512", "avx2", "scalar")


@pytest.mark.parametrize("advice", [True, False])
def test_large_outputs_use_the_huge_page_path_and_stay_exact(native, advice):
    """With the (opt-in) huge-page advice, outputs of >= 4 MiB come from the kernels' own 2 MiB-aligned allocation;
    without it from torch's allocator: same bits, an ordinary tensor, either way."""
    if not hasattr(native, "set_huge_page_advice"):
        pytest.skip("kernels built without the huge-page switch")
    native.set_huge_page_advice(advice)
    try:
        _check_large_outputs(native, advice)
    finally:
        native.set_huge_page_advice(None)


def _check_large_outputs(native, advice):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 20, 3, generator=gen) * 4  # 12 MiB of float32
    s = torch.tensor(4.0 / 127)
    g = torch.randn(x.shape, generator=gen)
    for name, nat, ref in [
        ("int", native.fake_quant_int(x, s, -128, 127), R.fake_quant_int(x, s, -128, 127)),
        ("e4m3", native.fake_e4m3(x, s), R.fake_e4m3(x, s)),
        ("bwd", native.int_backward(g, x, s, -128, 127, True)[0], R.int_backward(g, x, s, -128, 127, True)[0]),
    ]:
        same(nat, ref, name)
        assert nat.is_contiguous() and (nat.data_ptr() % (2 << 20) == 0 or not advice), name
        nat.add_(1.0).mul_(2.0)  # writable; its memory is freed with the tensor (no leak to check here)
        assert nat.untyped_storage().nbytes() == x.numel() * 4
    small = native.fake_quant_int(x[:10], s, -128, 127)  # under 4 MiB: torch's allocator
    same(small, R.fake_quant_int(x[:10], s, -128, 127), "small")


def test_building_and_loading_leave_the_environment_alone(native):
    """ModelOpt's loader sets TORCH_CUDA_ARCH_LIST process-wide (anchors 4, ModelOpt 11); ours changes nothing."""
    before = dict(os.environ)
    assert backend.precompile() == {
        "cpu": "ok",
        "cuda": "ok" if torch.cuda.is_available() else "skipped: CUDA is not available",
    }
    assert native_build.load("cpu") is not None
    assert dict(os.environ) == before
