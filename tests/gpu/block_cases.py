"""The fused dynamic block quantization matrix (csrc/block_kernels.cu through the binding's fake_block_dynamic /
block_dynamic_backward), shared by tests/gpu/test_cuda_blocks.py (real GPU) and the host-emulated binding test.

Each check compares the extension against :mod:`modelopt_lite.functional.library_block_cuda`' reference (block amax,
``scale_from_amax``, the integer / E4M3 ops) bit for bit: fp32 / fp16 / bf16, integer (4-bit, 8-bit narrow) and
E4M3 elements, every supported block size from one 16-byte vector per block to 4 vectors per lane (fp32 blocks of
8..512), partial last blocks, rows shorter than a block, dead (all-zero) and tiny blocks, 3-D inputs, misaligned,
strided and transposed views, forward and backward, and per-tensor double quantization of the block scales
(unsigned 8-/4-bit and E4M3 scale codes). :func:`flag_failures`: a NaN / Inf anywhere raises the flag.

Static block amax (``fake_block_static`` / ``block_static_backward``): the same layouts with a given block amax
(the data's own times factors in [0.25, 2): clipping and slack; zero, tiny and float32-max blocks), x's NaN / Inf
passing through without raising the flag, and a NaN, Inf or negative amax raising it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from cuda_cases import DTYPES, assert_same
from mx_cases import Check
from variant_cases import under_variants

from modelopt_lite.functional import blocks
from modelopt_lite.functional import library_block_cuda as lb
from modelopt_lite.functional.scales import _overflow_threshold, scale_from_amax

ELEMENTS = {  # name: (bound, qmin, qmax, e4m3)
    "int4": (7.0, -8, 7, False),
    "int8 narrow": (127.0, -127, 127, False),
    "e4m3": (448.0, -448, 448, True),
}
REFERENCE: dict[str, Callable] = {
    "fake_block_dynamic": lb.fake_block_dynamic_reference,
    "block_dynamic_backward": lb.block_dynamic_backward_reference,
    "fake_block_static": lb.fake_block_static_reference,
    "block_static_backward": lb.block_static_backward_reference,
}


def _blocks_for(dtype) -> tuple[int, ...]:
    return (8, 16, 32, 64, 128, 256, 512) if dtype == torch.float32 else (8, 16, 64, 128, 256, 1024)


def _data(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = math.prod(shape[:-1])
    top = 12 if dtype == torch.float16 else 30
    x = torch.randn(rows, shape[-1], generator=g) * 2.0 ** torch.randint(-top // 2, top // 2, (rows, 1), generator=g)
    n = shape[-1]
    if rows >= 3:
        x[0, : min(n, 600)] = 0.0  # dead blocks (every block size)
        x[1, : min(n, 40)] = 1e-30 if dtype != torch.float16 else 1e-8  # tiny: a dead scale (amax <= 2**-24)
        x[2, :5] = torch.tensor([3.5, -2.5, 0.5, -0.5, 1.5])[: min(n, 5)] * (2.0 if n > 5 else 1.0)  # ties
    return x.reshape(shape).to(dtype)


SHAPES = {
    "5x1100 partial last block": (5, 1100),
    "2x3x1024 3-D": (2, 3, 1024),
    "4x24 shorter than most blocks": (4, 24),
}
VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "misaligned, vector-sized rows": lambda t: t.reshape(-1)[1 : 1 + 6 * 512].reshape(6, 512),
    "misaligned, odd rows": lambda t: t.reshape(-1)[3 : 3 + 7 * 301].reshape(7, 301),
    "strided": lambda t: t[:, ::2],
    "transposed": lambda t: t[:, :64].t(),
}


def _far(dtype, seed: int) -> torch.Tensor:
    """Blocks whose scale lies above 2**16 (times 2**40; bfloat16 and float32: float16 cannot hold them): the 16-bit
    kernels' division through the reciprocal falls back to true division there (mx_elem.h rcp_div_ok), alongside
    ordinary blocks of the same rows."""
    x = _data((6, 1100), dtype, seed).float()
    x[3:, ::3] *= 2.0**40
    return x.to(dtype)


def _inputs(dtype):
    out = [
        (name, lambda d, s=shape, k=i: _data(s, dtype, 300 + k).to(d)) for i, (name, shape) in enumerate(SHAPES.items())
    ]
    for i, (name, view) in enumerate(VIEWS.items()):
        out.append((name, lambda d, v=view, k=i: v(_data((8, 1040), dtype, 400 + k).to(d))))
    if dtype != torch.float16:
        out.append(("6x1100 with blocks scaled by 2**40", lambda d: _far(dtype, 500).to(d)))
    return out


def _grad(x: torch.Tensor) -> torch.Tensor:
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    g.view(-1)[::5] = -0.0
    return g.to(x.dtype)


def forward_checks(dtypes=DTYPES):
    out = []
    for dtype in dtypes:
        for name, mk in _inputs(dtype):
            for block in _blocks_for(dtype):
                for ename, (bound, qmin, qmax, e4m3) in ELEMENTS.items():
                    args = (block, bound, qmin, qmax, e4m3)
                    out.append(
                        Check(
                            f"fused block={block} {ename} {name} {dtype}",
                            "fake_block_dynamic",
                            lambda d, mk=mk, a=args: (mk(d), *a),
                        )
                    )
    return out


SCALE_QUANT = {
    "8-bit scale codes": (1, 255.0, 255),
    "4-bit scale codes": (1, 15.0, 15),
    "E4M3 scale codes": (2, 448.0, 0),
}


def double_quant_checks(dtypes=DTYPES):
    """Per-tensor double quantization of the block scales (the kernel's first pass finds the tensor's amax)."""
    out = []
    for dtype in dtypes:
        for name, mk in _inputs(dtype):
            for block in (16, 128):
                for ename, (bound, qmin, qmax, e4m3) in ELEMENTS.items():
                    for sname, sq in SCALE_QUANT.items():
                        args = (block, bound, qmin, qmax, e4m3, *sq)
                        out.append(
                            Check(
                                f"fused block={block} {ename} {sname} {name} {dtype}",
                                "fake_block_dynamic",
                                lambda d, mk=mk, a=args: (mk(d), *a),
                            )
                        )
            args = (128, 7.0, -8, 7, False, 2, 448.0, 0)
            out.append(
                Check(
                    f"fused backward block=128 int4 E4M3 scale codes {name} {dtype}",
                    "block_dynamic_backward",
                    lambda d, mk=mk, a=args: (_grad(mk("cpu")).to(d), mk(d), *a),
                )
            )
    return out


def backward_checks(dtypes=DTYPES):
    out = []
    for dtype in dtypes:
        for name, mk in _inputs(dtype):
            for block in (8, 128, 512 if dtype == torch.float32 else 1024):
                for ename, (bound, qmin, qmax, e4m3) in ELEMENTS.items():
                    args = (block, bound, qmin, qmax, e4m3)
                    out.append(
                        Check(
                            f"fused backward block={block} {ename} {name} {dtype}",
                            "block_dynamic_backward",
                            lambda d, mk=mk, a=args: (_grad(mk("cpu")).to(d), mk(d), *a),
                        )
                    )
    return out


F32_MAX = 3.4028234663852886e38


def static_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """A static block amax for x (float32, x.shape[:-1] + (blocks,)): the data's block amax times factors in
    [0.25, 2) (elements clipped and grids with slack), the first block 0 (dead), the second 1e-30 (dead: <= 2**-24),
    the last float32's largest value."""
    a = blocks.block_amax(x.detach().cpu(), {-1: block})
    f = torch.rand(a.shape, generator=torch.Generator().manual_seed(block)) * 1.75 + 0.25
    a = (a * f).clamp(max=F32_MAX)
    flat = a.view(-1)
    flat[0] = 0.0
    if flat.numel() > 2:
        flat[1] = 1e-30
        flat[-1] = F32_MAX
    return a


def _with_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """x with NaN, +Inf and -Inf in its first, second and last rows (in place; x is a fresh tensor or view)."""
    rows = x.reshape(-1, x.shape[-1]) if x.is_contiguous() else None
    idx = [(0, 0), (min(1, x.shape[0] - 1), x.shape[-1] // 2), (x.shape[0] - 1, x.shape[-1] - 1)]
    for (r, c), v in zip(idx, (math.nan, math.inf, -math.inf)):
        if rows is not None:
            rows[r, c] = v
        else:
            x[(r,) + (0,) * (x.dim() - 2) + (c,)] = v
    return x


def _static_maker(mk, block: int, nonfinite: bool):
    """(x, amax) on a device: the amax from the finite data (on the CPU), then x's NaN / Inf if asked."""

    def make(d):
        x = mk(d)
        amax = static_amax(x, block).to(d)
        return (_with_nonfinite(x) if nonfinite else x), amax

    return make


def static_checks(dtypes=DTYPES, block_list=None, backward=True):
    out = []
    for dtype in dtypes:
        big = 512 if dtype == torch.float32 else 1024
        for i, (name, mk) in enumerate(_inputs(dtype)):
            nonfinite = i % 2 == 1  # every other layout carries NaN / Inf in x
            tag = f"{name}{' with NaN/Inf' if nonfinite else ''} {dtype}"
            for block in block_list or (8, 64, 128, big):
                xa = _static_maker(mk, block, nonfinite)
                for ename, (bound, qmin, qmax, e4m3) in ELEMENTS.items():
                    args = (block, bound, qmin, qmax, e4m3)
                    out.append(
                        Check(
                            f"static block={block} {ename} {tag}",
                            "fake_block_static",
                            lambda d, m=xa, a=args: (*m(d), *a),
                        )
                    )
                    if backward and block in (8, 128):
                        out.append(
                            Check(
                                f"static backward block={block} {ename} {tag}",
                                "block_static_backward",
                                lambda d, m=xa, a=args: (_grad(m("cpu")[0]).to(d), *m(d), *a),
                            )
                        )
    return out


GROUPS: dict[str, Callable[[], list]] = {
    "forward": forward_checks,
    "backward": backward_checks,
    "double_quant": double_quant_checks,
    "static": static_checks,
}


def run_check(mod, device: str, check: Check) -> None:
    y, flag = getattr(mod, check.fn)(*check.make(device))
    want = REFERENCE[check.fn](*check.make("cpu"))
    assert int(flag.item()) == 0, f"{check.what}: flag raised on finite input"
    assert_same(y, want, check.what)


#: the work-distribution variants that change the fused block kernel's lanes (mx_kernels_api.h): none, 2 float32
#: vectors per lane (MLQ_MX_BLOCKS_FP32_TWO_VECTORS), that with one wave of thread blocks, 2 float16/bfloat16
#: vectors per lane (MLQ_MX_16BIT_TWO_VECTORS), and both two-vector bits; and the 16-bit division by __fdiv_rn
#: (MLQ_MX_TRUE_DIVISION) alone and with 2 vectors per lane
BLOCK_VARIANTS = (0, 32, 48, 64, 96, 128, 192)


def variant_failures(mod, device: str) -> list[str]:
    """The forward matrix (every block size, element, layout and dtype) under each of BLOCK_VARIANTS against the
    reference; the process-wide variant is restored after."""
    failures: list[str] = []
    for variant in under_variants(mod, BLOCK_VARIANTS, failures):
        for check in forward_checks() + static_checks(block_list=(128,), backward=False):
            try:
                run_check(mod, device, check)
            except AssertionError as e:
                failures.append(f"variant {variant}: {e}")
    return failures


def flag_failures(mod, device: str) -> list[str]:
    """NaN / Inf (fp32, fp16, bf16) in a partial last block: the binding's flag is raised (forward and backward);
    a NaN, Inf or negative static amax of a partial last block raises the static bindings' flag."""
    failures = []
    for dtype in DTYPES:
        for v in (math.nan, math.inf, -math.inf):
            x = torch.randn(3, 300).to(dtype)
            x[2, 290] = v
            xd = x.to(device)
            for fn, args in (
                ("fake_block_dynamic", (xd, 128, 7.0, -8, 7, False)),
                ("fake_block_dynamic", (xd, 16, 7.0, -8, 7, False, 1, 255.0, 255)),
                ("block_dynamic_backward", (torch.ones_like(xd), xd, 64, 448.0, -448, 448, True)),
            ):
                _, flag = getattr(mod, fn)(*args)
                if int(flag.item()) == 0:
                    failures.append(f"{fn} {dtype} {v}: flag not raised")
        for v in (math.nan, math.inf, -math.inf, -1e-30, -2.0):  # a bad static amax, in a partial last block
            x = torch.randn(3, 300).to(dtype).to(device)
            amax = static_amax(x, 128).to(device)
            amax[2, 2] = v
            for fn, args in (
                ("fake_block_static", (x, amax, 128, 7.0, -8, 7, False)),
                ("block_static_backward", (torch.ones_like(x), x, amax, 128, 448.0, -448, 448, True)),
            ):
                _, flag = getattr(mod, fn)(*args)
                if int(flag.item()) != 1:
                    failures.append(f"{fn} {dtype} amax {v}: flag {int(flag.item())}, expected 1")
    return failures


# --- scale_from_amax (one launch for scales.scale_from_amax and the amax check) -----------------------------------
SCALE_BOUNDS = (1.0, 6.0, 7.0, 8.0, 15.0, 127.0, 255.0, 448.0, 32767.0, 57344.0, 2147483648.0)


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def scale_amaxes(bound: float) -> torch.Tensor:
    """Edge amaxes for one bound: zeros, the dead-slice threshold 2**-24 and its neighbours, subnormals, float32's
    largest values, the 64 floats on each side of the bound's overflow threshold (scales._overflow_threshold), and
    random values over the whole exponent range; all finite and >= 0."""
    eps_bits = 0x33800000  # 2**-24
    top = 0x7F7FFFFF
    bits = [0, 1, 2, 0x007FFFFF, 0x00800000, eps_bits - 1, eps_bits, eps_bits + 1, 0x3F800000]
    bits += list(range(top - 64, top + 1))
    thr = _overflow_threshold(float(bound))
    if thr is not None:
        t = int(torch.tensor([thr], dtype=torch.float32).view(torch.int32)[0])
        bits += list(range(t - 64, min(t + 64, top) + 1))
    g = torch.Generator().manual_seed(int(bound) % 1000)
    rnd = torch.randint(0, top + 1, (4096,), generator=g, dtype=torch.int64).tolist()
    return torch.cat([_f32(bits), torch.tensor([-0.0]), _f32(rnd)])


def scale_failures(mod, device: str) -> list[str]:
    """The binding's scale_from_amax against scales.scale_from_amax bit for bit (shapes kept: a per-channel
    amax, a scalar, an amax longer than one launch's threads), and its flag: 0 for good amaxes, 1 for NaN, Inf,
    -Inf or a negative one anywhere."""
    out = []
    for bound in SCALE_BOUNDS:
        a = scale_amaxes(bound)
        for what, amax in (
            ("edges", a),
            ("per-channel", a[:96].reshape(96, 1)),
            ("scalar", a[7].reshape(())),
            ("long", a.repeat(64)),
        ):
            try:
                scale, flag = mod.scale_from_amax(amax.to(device), bound)
                assert_same(scale, scale_from_amax(amax, bound), f"scale_from_amax {what} bound={bound}")
                assert flag.dtype == torch.int32 and int(flag.cpu()[0]) == 0, f"{what} bound={bound}: flag raised"
            except AssertionError as e:
                out.append(str(e))
        for bad in (math.nan, math.inf, -math.inf, -1e-30, -3.0):
            amax = a[:300].clone()
            amax[257] = bad
            scale, flag = mod.scale_from_amax(amax.to(device), bound)
            if int(flag.cpu()[0]) != 1:
                out.append(f"scale_from_amax bound={bound}: amax {bad} did not raise the flag")
            want = scale_from_amax(amax, bound)
            try:
                assert_same(scale, want, f"scale_from_amax with {bad} bound={bound}")
            except AssertionError as e:
                out.append(str(e))
    return out
