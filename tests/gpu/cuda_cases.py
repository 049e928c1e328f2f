"""The exactness matrix shared by tests/gpu/test_cuda_exactness.py (real GPU) and the host-emulated binding test.

Each :class:`Check` names a function of ``modelopt_lite.functional.reference`` and builds its arguments for a
device; the native module must return exactly what the reference returns on CPU: same dtype and shape, NaN in
the same places and the same bits everywhere else (the sign of zero included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from modelopt_lite.formats import E4M3_MAX, int_range
from modelopt_lite.functional import blocks
from modelopt_lite.functional import reference as ref
from modelopt_lite.functional.scales import affine_params, scale_from_amax

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (2, 3, 4, 5, 7, 8, 11, 16)
MODES = ((False, True), (False, False), (True, False))  # (unsigned, narrow_range)
_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


class Check(NamedTuple):
    what: str
    fn: str
    make: Callable[[str], tuple]  # device -> positional args


def assert_same(got, want, what: str) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), f"{what}: got {type(got)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
        return
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    got = got.detach().cpu()
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    gn, wn = torch.isnan(got.float()), torch.isnan(want.float())
    assert torch.equal(gn, wn), f"{what}: NaN positions differ ({int((gn != wn).sum())} elements)"
    view = _VIEW.get(want.dtype)
    if view is None:
        assert torch.equal(got, want), what
        return
    bad = (got.contiguous().view(view) != want.contiguous().view(view)) & ~wn
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {want.numel()} elements differ; first at flat index {i}: "
            f"got {got.flatten()[i].item()!r}, want {want.flatten()[i].item()!r}"
        )


def run_check(mod, device: str, check: Check) -> None:
    got = getattr(mod, check.fn)(*check.make(device))
    want = getattr(ref, check.fn)(*check.make("cpu"))
    assert_same(got, want, check.what)


def _dev(t, device):
    return t.to(device) if isinstance(t, torch.Tensor) else t


def _special(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.view(-1)
    vals = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-30, -1e-30, 3e38])
    k = min(flat.numel(), vals.numel())
    flat[:k] = vals[:k].to(x.dtype)
    return x


def _base(shape, dtype, seed: int, unsigned: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    return (x.abs() if unsigned else x).to(dtype)


# --- layouts: (name, function x -> (x view, scale)) ------------------------------------------------------------------
def _reduce_amax(x: torch.Tensor, keep: tuple) -> torch.Tensor:
    dims = [d for d in range(x.dim()) if d not in keep]
    a = x.detach().float().abs()
    return a.amax(dim=dims, keepdim=True) if dims else a


def _dead(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.clone()
    flat = amax.view(-1)
    if flat.numel() >= 3:
        flat[0], flat[2] = 0.0, 1e-26  # dead slices: scale 0 -> exact zeros
    return amax


def _blocked(x, block_sizes, amax_fn):
    sizes = blocks.normalize(block_sizes, x.shape)
    xb, _ = blocks.to_blocks(x, sizes)
    amax = amax_fn(blocks.block_amax(x, block_sizes))
    return xb, amax, sizes


def layouts(bound: float):
    def per_axis(keep):
        def f(x):
            return x, scale_from_amax(_dead(_reduce_amax(x, keep)) * 0.7, bound)

        return f

    def per_tensor(x):
        return x, scale_from_amax(x.detach().float().abs().amax() * 0.7, bound)

    def block(block_sizes, dynamic=False, double=False):
        def f(x):
            xb, amax, sizes = _blocked(x, block_sizes, lambda a: a if dynamic else _dead(a) * 0.7)
            scale = scale_from_amax(amax, bound)
            if double:  # per-block scales quantized to unsigned 8 bits with their own per-tensor amax
                s_scale = scale_from_amax(scale.amax(), 255.0)
                scale = ref.fake_quant_int(scale, s_scale, 0, 255)
            return xb, blocks.expand_amax(scale, sizes)

        return f

    return [
        ("per-tensor", per_tensor),
        ("axis0", per_axis((0,))),
        ("last", per_axis((2,))),
        ("axis-2", per_axis((1,))),
        ("axes(0,2)", per_axis((0, 2))),
        ("axes(1,2)", per_axis((1, 2))),
        ("block{-1:4}pad", block({-1: 4})),
        ("block{0:2,-1:4}", block({0: 2, -1: 4})),
        ("block-dynamic", block({-1: 3}, dynamic=True)),
        ("block-double", block({1: 4}, double=True)),
    ]


SHAPE = (6, 10, 9)


def int_checks(dtypes=DTYPES, bits=BITS, shape=SHAPE):
    """fake_quant_int / quantize_int / int_backward over bits x modes x layouts x dtypes."""
    out = []
    for di, dtype in enumerate(dtypes):
        for bi, b in enumerate(bits):
            for mi, (unsigned, narrow) in enumerate(MODES):
                bound, qmin, qmax = int_range(b, unsigned, narrow)
                for li, (name, layout) in enumerate(layouts(float(bound))):
                    seed = (((di * 16 + bi) * 4 + mi) * 16 + li) * 2
                    tag = f"{name} bits={b} unsigned={unsigned} narrow={narrow} {dtype}"

                    def make(device, seed=seed, layout=layout, unsigned=unsigned, dtype=dtype):
                        x, scale = layout(_base(shape, dtype, seed, unsigned))
                        return _special(x).to(device), scale.to(device)

                    def make_bwd(device, make=make, seed=seed, dtype=dtype, qmin=qmin, qmax=qmax, need=(b % 2 == 0)):
                        x, scale = make(device)
                        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
                        return g.to(device), x, scale, qmin, qmax, need

                    out.append(
                        Check(
                            f"fake_quant_int {tag}",
                            "fake_quant_int",
                            lambda d, m=make, lo=qmin, hi=qmax: (*m(d), lo, hi),
                        )
                    )
                    out.append(
                        Check(
                            f"quantize_int {tag}", "quantize_int", lambda d, m=make, lo=qmin, hi=qmax: (*m(d), lo, hi)
                        )
                    )
                    out.append(Check(f"int_backward {tag}", "int_backward", make_bwd))
    return out


def e4m3_checks(dtypes=DTYPES, shape=SHAPE):
    """fake_e4m3 / e4m3_backward over layouts x dtypes, with saturation (values far beyond amax)."""
    out = []
    for dtype in dtypes:
        for li, (name, layout) in enumerate(layouts(E4M3_MAX)):

            def make(device, li=li, layout=layout, dtype=dtype):
                x, scale = layout(_base(shape, dtype, 1000 + li, False))
                x = x.clone()
                x.view(-1)[10:20] = x.view(-1)[10:20] * 1e3  # beyond 448 * s: saturates
                return _special(x).to(device), scale.to(device)

            out.append(Check(f"fake_e4m3 {name} {dtype}", "fake_e4m3", make))
            for need in (True, False):

                def make_bwd(device, make=make, dtype=dtype, need=need):
                    x, scale = make(device)
                    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
                    return g.to(device), x, scale, need

                out.append(Check(f"e4m3_backward need={need} {name} {dtype}", "e4m3_backward", make_bwd))
    return out


def affine_checks(dtypes=DTYPES, shape=SHAPE):
    """fake_affine / quantize_affine / affine_backward: per-tensor and per-channel ranges, 4 and 8 bits."""
    out = []
    for dtype in dtypes:
        for b in (4, 8):
            for keep in ((), (0,), (2,)):

                def make(device, dtype=dtype, b=b, keep=keep):
                    x = _base(shape, dtype, 77 + b, False)
                    dims = [d for d in range(3) if d not in keep]
                    lo = x.float().amin(dim=dims, keepdim=True) if keep else x.float().amin()
                    hi = x.float().amax(dim=dims, keepdim=True) if keep else x.float().amax()
                    scale, zp, qmin, qmax = affine_params(lo * 0.8, hi * 0.6, b)
                    if scale.numel() > 2:
                        scale.view(-1)[1] = 0.0
                    return _special(x).to(device), scale.to(device), zp.to(device), qmin, qmax

                tag = f"bits={b} keep={keep} {dtype}"
                out.append(Check(f"fake_affine {tag}", "fake_affine", make))
                out.append(Check(f"quantize_affine {tag}", "quantize_affine", make))

                def make_bwd(device, make=make, dtype=dtype):
                    x, scale, zp, qmin, qmax = make(device)
                    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
                    return g.to(device), x, scale, zp, qmin, qmax

                out.append(Check(f"affine_backward {tag}", "affine_backward", make_bwd))
    return out


def edge_checks(dtypes=DTYPES):
    """Ties, range ends, clipped negatives (-128 with narrow_range=False), tiny/zero amax, non-contiguous views."""
    out = []
    for dtype in dtypes:

        def ties(device, dtype=dtype):
            s = torch.tensor(2.0**-5)
            k = torch.arange(-140, 140, dtype=torch.float32)
            x = torch.cat([(k + 0.5) * s, k * s, -(k + 0.5) * s]).to(dtype)
            return x.to(device), s.to(device), -128, 127

        out.append(Check(f"ties half-to-even {dtype}", "fake_quant_int", ties))
        out.append(Check(f"ties codes {dtype}", "quantize_int", ties))

        def clipped(device, dtype=dtype):
            x = torch.tensor([-10.0, -1.0, -0.9961, 1.0, 10.0]).to(dtype)
            return x.to(device), scale_from_amax(torch.tensor(1.0), 127).to(device), -128, 127

        out.append(Check(f"narrow_range=False clips to -128 {dtype}", "quantize_int", clipped))
        for amax in (0.0, 1e-26, 2.0**-24, 2.0**-23):

            def tiny(device, dtype=dtype, amax=amax):
                x = torch.tensor([-1.0, -1e-8, 0.0, 1e-8, 1.0, math.nan]).to(dtype)
                return x.to(device), scale_from_amax(torch.tensor(amax), 127).to(device), -128, 127

            out.append(Check(f"amax={amax} {dtype}", "fake_quant_int", tiny))
        for vname, view in (
            ("transposed", lambda t: t.transpose(0, 2)),
            ("strided", lambda t: t[:, :, ::2]),
            ("offset", lambda t: t.reshape(-1)[1:].reshape(7, 77)),
            ("channels_last", lambda t: t.reshape(2, 3, 10, 9).contiguous(memory_format=torch.channels_last)),
        ):

            def noncontig(device, dtype=dtype, view=view):
                x = view(_base(SHAPE, dtype, 5, False).to(device))
                amax = x.float().abs().amax(dim=0, keepdim=True) * 0.5
                return x, scale_from_amax(amax, 127), -128, 127

            out.append(Check(f"non-contiguous {vname} {dtype}", "fake_quant_int", noncontig))

            def noncontig_bwd(device, dtype=dtype, make=noncontig):
                x, scale, qmin, qmax = make(device)
                return torch.ones_like(x).transpose(0, -1).contiguous().transpose(0, -1), x, scale, qmin, qmax, True

            out.append(Check(f"non-contiguous backward {vname} {dtype}", "int_backward", noncontig_bwd))
    return out


def all_checks():
    return int_checks() + e4m3_checks() + affine_checks() + edge_checks()


def binding_checks():
    """Argument handling of the binding: lower-rank scales, mixed grad/x dtypes, empty and 0-d inputs, and a
    broadcast pattern too irregular for the general path (the binding expands the scale)."""
    out = []

    def lower_rank(device):
        x = _base((4, 5, 6), torch.float32, 9, False)
        s = scale_from_amax(x.abs().amax(dim=(0, 2)).reshape(5, 1) * 0.5, 127)
        return x.to(device), s.to(device), -128, 127

    out.append(Check("scale (5, 1) against x (4, 5, 6)", "fake_quant_int", lower_rank))
    for gd, xd in ((torch.float32, torch.float16), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)):

        def mixed(device, gd=gd, xd=xd):
            x = _special(_base((7, 9), xd, 11, False))
            s = scale_from_amax(x.float().abs().amax(dim=1, keepdim=True).nan_to_num(0, 1e3, 0) * 0.5, 7)
            g = torch.randn(7, 9, generator=torch.Generator().manual_seed(4)).to(gd)
            return g.to(device), x.to(device), s.to(device), -8, 7, True

        out.append(Check(f"int_backward grad {gd} x {xd}", "int_backward", mixed))
    out.append(
        Check(
            "empty x", "fake_quant_int", lambda d: (torch.empty(0, 5, device=d), torch.ones(1, 5, device=d), -128, 127)
        )
    )
    out.append(
        Check(
            "0-d x", "fake_quant_int", lambda d: (torch.tensor(1.3, device=d), torch.tensor(0.1, device=d), -128, 127)
        )
    )
    out.append(
        Check(
            "0-d x codes",
            "quantize_int",
            lambda d: (torch.tensor(-7.3, device=d), torch.tensor(0.1, device=d), -128, 127),
        )
    )

    def alternating(device):  # 10 alternating dims: more than the general path's 8 merged dims
        x = _base((2,) * 10, torch.float16, 12, False)
        s = torch.rand((2, 1) * 5, generator=torch.Generator().manual_seed(5)) * 0.1 + 0.01
        return x.to(device), s.to(device), -8, 7

    out.append(Check("10 alternating broadcast dims", "fake_quant_int", alternating))
    out.append(
        Check(
            "10 alternating broadcast dims, backward",
            "int_backward",
            lambda d: (torch.ones((2,) * 10, dtype=torch.float16, device=d), *alternating(d), True),
        )
    )
    return out


def unsigned_flag_failures(mod, device: str) -> list[str]:
    """The ``*_uint_flagged`` bindings (the integer forward with the unsigned-input check in its own pass): the
    output equals the plain binding's bit for bit, and the returned int32 flag is 1 exactly when x holds a negative
    value or NaN (-0.0 and +Inf pass), wherever the element sits: in a 16-byte vector, in the scalar tail, in a
    misaligned view (the scalar path)."""
    failures = []
    for dtype in DTYPES:
        base = _base((1031,), dtype, 21, True)  # 1031: vectors and a tail for every dtype
        scale = scale_from_amax(base.float().abs().amax().reshape(1), 255)
        cases = [("all >= 0", base, 0)]
        zero = base.clone()
        zero[5] = -0.0
        zero[1030] = float("inf")
        cases.append(("-0.0 and +Inf", zero, 0))
        for where in (0, 9, 517, 1030):
            for bad in (-6e-5, -3.0, float("nan"), float("-inf")):  # -6e-5: a float16 subnormal
                x = base.clone()
                x[where] = bad
                assert not float(x[where]) >= 0
                cases.append((f"{bad!r} at {where}", x, 1))
        cases += [(f"{what}, misaligned view", x[1:], want) for what, x, want in cases if " at 0" not in what]
        for what, x, want in cases:
            xd, sd = x.to(device), scale.to(device)
            for flagged, plain in (
                ("fake_quant_uint_flagged", "fake_quant_int"),
                ("quantize_uint_flagged", "quantize_int"),
            ):
                label = f"{flagged} {dtype} {what}"
                try:
                    y, flag = getattr(mod, flagged)(xd, sd, 0, 255)
                    assert flag.dtype == torch.int32 and flag.shape == (1,), f"{label}: flag {flag.dtype} {flag.shape}"
                    assert int(flag.item()) == want, f"{label}: flag {int(flag.item())}, want {want}"
                    assert_same(y, getattr(mod, plain)(xd, sd, 0, 255).cpu(), label)
                except AssertionError as e:
                    failures.append(str(e))
    empty = torch.empty(0, 4, device=device)
    y, flag = mod.fake_quant_uint_flagged(empty, torch.ones(1, device=device), 0, 255)
    if y.shape != (0, 4) or int(flag.item()) != 0:
        failures.append(f"empty x: output {tuple(y.shape)}, flag {int(flag.item())}")
    return failures


def error_cases(device: str):
    """(callable(mod), exception type, message fragment): validation in the binding, before any launch."""
    x = torch.randn(4, 5, device=device)
    s = torch.full((1,), 0.1, device=device)
    return [
        (lambda m: m.fake_quant_int(x.to(torch.int32), s, -8, 7), TypeError, "float32, float16 or bfloat16"),
        (lambda m: m.fake_quant_int(x, s, 8, 7), ValueError, "qmin must be <= qmax"),
        (lambda m: m.fake_quant_int(x, torch.ones(3, 1, device=device), -8, 7), ValueError, "does not broadcast"),
        (lambda m: m.fake_quant_int(x, torch.ones(1, 1, 5, device=device), -8, 7), ValueError, "does not broadcast"),
        (
            lambda m: m.fake_quant_int(x, torch.ones(1, dtype=torch.int32, device=device), -8, 7),
            TypeError,
            "floating-point",
        ),
        (lambda m: m.int_backward(torch.ones(4, 4, device=device), x, s, -8, 7, True), ValueError, "does not match"),
        (
            lambda m: m.histogram_rows(x, torch.zeros(4, dtype=torch.int64, device=device), 0),
            ValueError,
            "cap must be >= 1",
        ),
        (lambda m: m.histogram(x.abs(), 16, math.nan), ValueError, "max must be finite"),
    ]


def device_error_cases(device: str):
    """Tensors on the wrong device: ValueError from the quantization and the microscaling bindings. ``device`` is
    where the binding runs ("cuda"; "cpu" for the host-emulated build, which is handed meta tensors instead)."""
    other = "meta" if device == "cpu" else "cpu"
    wrong = "must be a CPU tensor in the host-emulated build" if device == "cpu" else "must be a CUDA tensor"
    x = torch.ones(2, 32, device=other)
    return [
        (lambda m: m.fake_quant_int(x, torch.ones(1, device=other), -8, 7), ValueError, wrong),
        (lambda m: m.fake_mx(x, "e4m3", 32, "floor"), ValueError, wrong),
        (lambda m: m.fake_e2m1(x, torch.ones(1, device=other)), ValueError, wrong),
    ]
