"""The NVFP4 / MX / E5M2 / E2M1 exactness matrix, shared by tests/gpu/test_cuda_mx.py (real GPU) and the
host-emulated binding test (tests/test_cuda_binding_emulated.py).

Forward (:func:`forward_checks`): the extension's fake_nvfp4 / fake_mx / fake_e5m2 / fake_e2m1 against the CPU
reference (:mod:`modelopt_lite.functional.microscaling`, :mod:`modelopt_lite.functional.library_minifloat`), bit
for bit, over fp32 / fp16 / bf16 (fp32 matters: a one-ulp float32 error vanishes when rounded to 16 bits),
partial last blocks, blocks smaller than one block, 3-D inputs, non-contiguous / strided / misaligned views, zero,
tiny and saturating blocks, E2M1 ties, both NVFP4 block sizes, every MX element with floor and rceil scales, and
per-tensor / per-channel / lower-rank / dead-channel / per-element E5M2 and E2M1 scales.

Backward (:func:`grad_checks`): the public autograd ops (``nvfp4_fake_quant``, ``mx_fake_quant``, ``fake_e5m2`` /
``fake_e2m1`` with a learned scale) run on the device against the same code on the CPU with the reference backend:
the output, x's gradient and the scale's gradient (the NVFP4 case also computes its global scale on the device).

The binding's own backward kernels (:func:`backward_checks`: ``nvfp4_backward`` / ``mx_backward``) against the
reference's, over the forward matrix's inputs (the STE mask, -0.0 for a masked negative gradient, dead blocks).

The error cases (bad arguments, NaN / Inf inputs, the flagged bindings) are in mx_error_cases.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from cuda_cases import DTYPES, assert_same

from modelopt_lite.functional import library_minifloat as lm
from modelopt_lite.functional import library_mx as lx
from modelopt_lite.functional import microscaling as ms

REFERENCE: dict[str, Callable] = {
    "fake_nvfp4": ms.fake_nvfp4,
    "fake_mx": ms.fake_mx,
    "fake_e5m2": lm.fake_e5m2_reference,
    "fake_e2m1": lm.fake_e2m1_reference,
    "nvfp4_backward": ms.nvfp4_backward,
    "mx_backward": ms.mx_backward,
    # the global scale computed by the kernel from amax (flag 0: these checks' amaxes are all valid)
    "fake_nvfp4_amax_flagged": lambda x, a, b: (ms.fake_nvfp4(x, ms.nvfp4_global_scale(a), b), _NO_FLAG),
    "nvfp4_backward_amax_flagged": lambda g, x, a, b: (ms.nvfp4_backward(g, x, ms.nvfp4_global_scale(a), b), _NO_FLAG),
}
_NO_FLAG = torch.zeros(1, dtype=torch.int32)
ELEMS = ("e4m3", "e5m2", "e2m1", "int8")
ROUNDINGS = ("floor", "rceil")


class Check(NamedTuple):
    what: str
    fn: str
    make: Callable[[str], tuple]  # device -> positional args of the binding function / its reference


class GradCheck(NamedTuple):
    what: str
    run: Callable[[str], tuple]  # device -> (y, x.grad[, scale.grad]); the caller picks the backend


def run_check(mod, device: str, check: Check) -> None:
    got = getattr(mod, check.fn)(*check.make(device))
    want = REFERENCE[check.fn](*check.make("cpu"))
    assert_same(got, want, check.what)


def compare_grads(got: tuple, want: tuple, what: str) -> None:
    """Output and x's gradient bit for bit; a scale's gradient (a sum over its elements, reduced by torch in an order
    that differs across devices) to float32 rounding."""
    assert_same(got[:2], want[:2], what)
    if len(want) > 2:
        torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-5, atol=1e-7, msg=f"{what}: scale gradient")


# --- inputs ----------------------------------------------------------------------------------------------------------
def _top(dtype) -> int:
    return 12 if dtype == torch.float16 else 40  # dynamic range in powers of two (fp16 overflows past 65504)


def data(shape, dtype, seed: int) -> torch.Tensor:
    """Random values over a wide dynamic range (one power of two per row), with the edge blocks written in."""
    g = torch.Generator().manual_seed(seed)
    rows = math.prod(shape[:-1])
    top = _top(dtype)
    x = torch.randn(rows, shape[-1], generator=g) * 2.0 ** torch.randint(-top // 2, top // 2, (rows, 1), generator=g)
    n = shape[-1]
    if rows >= 4:
        x[0, : min(n, 32)] = 0.0  # a zero block (both block sizes)
        x[1, : min(n, 32)] = torch.tensor([6.0, -6.0, 5.0, 3.5, 2.5, 1.25, 0.75, 0.25, -0.0, 0.5, 1.5, 3.0] * 3)[
            : min(n, 32)
        ]  # ties and grid points of E2M1 (times a power of two: the block max is 6)
        x[2, : min(n, 32)] = 1e-30 if dtype != torch.float16 else 1e-8  # a tiny block (fp16/bf16: flushes to 0)
        x[3, : min(n, 16)] *= 2.0 ** (top // 2)  # a block far above the others
    return x.reshape(shape).to(dtype)


SHAPES = {
    "6x83 partial last block": (6, 83),
    "4x64 full blocks": (4, 64),
    "2x3x48 3-D": (2, 3, 48),
    "5x7 shorter than a block": (5, 7),
    "3x4104 many blocks, partial last warp tile": (3, 4104),
    "1x1000 one row, partial last vector block": (1, 1000),
}
VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "transposed": lambda t: t.reshape(-1, 40)[:, :40].t(),  # (40, rows): non-contiguous
    "strided": lambda t: t[..., ::2],
    "misaligned": lambda t: t.reshape(-1)[1 : 1 + 17 * 37].reshape(17, 37),  # storage offset of 1 element
    # whole 16-byte vectors per row but a storage offset of 1 element: the element-load path over the same lanes
    "misaligned, vector-sized rows": lambda t: t.reshape(-1)[1 : 1 + 9 * 64].reshape(9, 64),
    "column slice (row stride 80)": lambda t: t[:, 16:64],
}


def _inputs(dtype):
    """(name, x maker(device)) over shapes and views, for one dtype."""
    out = []
    for si, (name, shape) in enumerate(SHAPES.items()):
        out.append((name, lambda d, s=shape, k=si: data(s, dtype, 100 + k).to(d)))
    for vi, (name, view) in enumerate(VIEWS.items()):
        out.append((name, lambda d, v=view, k=vi: v(data((8, 80), dtype, 200 + k).to(d))))
    return out


def amax_of(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().abs().amax().cpu()


# --- forward ---------------------------------------------------------------------------------------------------------
def _nvfp4_matrix(dtype):
    """``(input name, x maker, block, amax factor)`` of the NVFP4 forward matrix for one dtype: every input, both
    block sizes, the global amax max |x| and a quarter of it (saturating block scales)."""
    for name, mk in _inputs(dtype):
        for block in (16, 32):
            for factor in (1.0, 0.25):
                yield name, mk, block, factor


def _far_nvfp4(d: str, power: int):
    x = (data((6, 83), torch.float32, 11) * 2.0**power).to(torch.bfloat16)
    return x.to(d), ms.nvfp4_global_scale(amax_of(x)).to(d), 16


def nvfp4_checks(dtypes=DTYPES):
    out = []
    for dtype in dtypes:
        for name, mk, block, factor in _nvfp4_matrix(dtype):

            def make(d, mk=mk, block=block, factor=factor):
                x = mk(d)
                gs = ms.nvfp4_global_scale(amax_of(x) * factor)  # computed on the CPU: the kernel's exactness
                return x, gs.to(d), block

            gname = "" if factor == 1.0 else " gs from amax/4 (saturating block scales)"
            out.append(Check(f"nvfp4 block={block}{gname} {name} {dtype}", "fake_nvfp4", make))
        if dtype == torch.bfloat16:  # block scales below 2**-64 and above 2**16: the 16-bit kernels' true division
            for far in (-100, 40):
                out.append(
                    Check(
                        f"nvfp4 x * 2**{far} (true division, mx_elem.h rcp_div_ok) {dtype}",
                        "fake_nvfp4",
                        lambda d, far=far: _far_nvfp4(d, far),
                    )
                )
        out.append(
            Check(
                f"nvfp4 global scale 0 {dtype}",
                "fake_nvfp4",
                lambda d, dtype=dtype: (data((4, 48), dtype, 7).to(d), torch.tensor(0.0, device=d), 16),
            )
        )
    return out


def mx_checks(dtypes=DTYPES):
    out = []
    for dtype in dtypes:
        for name, mk in _inputs(dtype):
            for elem in ELEMS:
                for rounding in ROUNDINGS:
                    out.append(
                        Check(
                            f"mx {elem} {rounding} {name} {dtype}",
                            "fake_mx",
                            lambda d, mk=mk, e=elem, r=rounding: (mk(d), e, 32, r),
                        )
                    )
    return out


def _scales(bound: float):
    """(name, scale maker(x on the CPU) -> float32 scale) for the elementwise formats."""

    def per_tensor(x):
        return (amax_of(x) / bound).reshape(1)

    def dim0(x):
        s = x.detach().float().abs().amax(dim=-1, keepdim=True) / bound
        s.view(-1)[0] = 0.0  # a dead channel: +0.0 outputs
        return s

    def last(x):
        return x.detach().float().abs().amax(dim=tuple(range(x.dim() - 1)), keepdim=True) / bound

    def lower_rank(x):
        return last(x).reshape(-1)

    def per_element(x):
        return x.detach().float().abs().clamp(min=1e-3) / bound  # two live dims: expanded to x's shape

    return [
        ("per-tensor", per_tensor),
        ("per-channel dim 0", dim0),
        ("per-channel last", last),
        ("lower-rank scale", lower_rank),
        ("per-element", per_element),
    ]


#: bfloat16 inputs for the 16-bit elementwise kernels' division through the reciprocal: scales below 2**-64 and
#: above 2**16 (true division), and a scale 2**40 below the data's with +-Inf in x (the clamped product, saturation)
_FAR_ELEMENTWISE = (
    ("x * 2**-100 (true division)", -100, 1.0),
    ("x * 2**40 (true division)", 40, 1.0),
    ("scale 2**-40 of the amax's, +-Inf in x (clamped product)", 0, 2.0**-40),
)


def _far_elementwise(d: str, power: int, clip: float, bound: float):
    x = (data((6, 83), torch.float32, 12) * 2.0**power).to(torch.bfloat16)
    s = (amax_of(x) / bound * clip).reshape(1)
    if clip != 1.0:
        x[1, :2] = torch.tensor([math.inf, -math.inf])
    return x.to(d), s.to(d)


def minifloat_checks(dtypes=DTYPES):
    out = []
    for fn, bound in (("fake_e5m2", ms.E5M2_MAX), ("fake_e2m1", ms.E2M1_MAX)):
        for dtype in dtypes:
            for name, mk in _inputs(dtype):
                for sname, scale_of in _scales(bound):

                    def make(d, mk=mk, scale_of=scale_of):
                        x = mk(d)
                        return x, scale_of(x.cpu()).to(d)

                    out.append(Check(f"{fn} {sname} {name} {dtype}", fn, make))
            if dtype == torch.bfloat16:
                for what, power, clip in _FAR_ELEMENTWISE:
                    out.append(
                        Check(
                            f"{fn} {what} {dtype}", fn, lambda d, p=power, c=clip, b=bound: _far_elementwise(d, p, c, b)
                        )
                    )
            x_nan = lambda d, dtype=dtype: _with_specials(data((4, 40), dtype, 9)).to(d)  # noqa: E731
            out.append(
                Check(
                    f"{fn} NaN/Inf propagate {dtype}", fn, lambda d, xm=x_nan: (xm(d), torch.tensor([0.01], device=d))
                )
            )
    return out


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[5:9] = torch.tensor([math.nan, math.inf, -math.inf, -0.0]).to(x.dtype)
    return x


def _grad_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    """An incoming gradient of x's shape and dtype with negative values and zeros (the STE mask gives -0.0 for a
    masked negative gradient, as grad * keep does)."""
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    g.view(-1)[::7] = 0.0
    return g.to(x.dtype)


def backward_checks(dtypes=DTYPES):
    """The binding's nvfp4_backward / mx_backward against the reference's, over the inputs of the forward matrix."""
    out = []
    for dtype in dtypes:
        for name, mk in _inputs(dtype):
            for block in (16, 32):

                def make(d, mk=mk, block=block):
                    x = mk(d)
                    gs = ms.nvfp4_global_scale(amax_of(x) * 0.25)  # saturating block scales: both mask branches
                    return _grad_like(x, 5).to(d), x, gs.to(d), block

                out.append(Check(f"nvfp4_backward block={block} {name} {dtype}", "nvfp4_backward", make))
            for elem in ELEMS:
                for rounding in ROUNDINGS:
                    out.append(
                        Check(
                            f"mx_backward {elem} {rounding} {name} {dtype}",
                            "mx_backward",
                            lambda d, mk=mk, e=elem, r=rounding: (_grad_like(mk("cpu"), 6).to(d), mk(d), e, 32, r),
                        )
                    )
        out.append(
            Check(
                f"nvfp4_backward global scale 0 {dtype}",
                "nvfp4_backward",
                lambda d, dtype=dtype: (
                    _grad_like(torch.zeros(4, 48, dtype=dtype), 8).to(d),
                    data((4, 48), dtype, 7).to(d),
                    torch.tensor(0.0, device=d),
                    16,
                ),
            )
        )
    return out


#: amaxes whose global scale the kernel computes: dead (<= 2**-24, -0.0), the threshold and just above it, values
#: whose true quotient by 2688 differs from the product with its reciprocal (0.7, 1.3, 3e5: the division must be
#: IEEE), and one near float32's maximum
SPECIAL_AMAX = (0.0, -0.0, 1e-8, 2.0**-24, 2.0**-23, 0.7, 1.3, 3e5, 3.4e38)


def nvfp4_amax_checks(dtypes=DTYPES):
    """The *_amax_flagged bindings (the global scale computed in the kernel from the per-tensor amax) against the
    reference with the global scale computed on the CPU, forward and backward, over the forward matrix's inputs
    (amax = max |x| and a quarter of it) and the special amaxes; the flag must stay 0."""
    out = []
    for dtype in dtypes:
        for name, mk, block, factor in _nvfp4_matrix(dtype):

            def fwd(d, mk=mk, block=block, factor=factor):
                x = mk(d)
                return x, (amax_of(x) * factor).to(d), block

            def bwd(d, mk=mk, block=block, factor=factor):
                x = mk(d)
                return _grad_like(x, 5).to(d), x, (amax_of(x) * factor).to(d), block

            what = f"block={block} {'amax' if factor == 1.0 else 'amax/4'} {name} {dtype}"
            out.append(Check(f"fake_nvfp4_amax {what}", "fake_nvfp4_amax_flagged", fwd))
            out.append(Check(f"nvfp4_backward_amax {what}", "nvfp4_backward_amax_flagged", bwd))
        for a in SPECIAL_AMAX:
            x_of = lambda d, dtype=dtype: data((4, 48), dtype, 7).to(d)  # noqa: E731
            amax = lambda d, a=a: torch.tensor(a, device=d)  # noqa: E731
            out.append(
                Check(
                    f"fake_nvfp4_amax amax={a} {dtype}",
                    "fake_nvfp4_amax_flagged",
                    lambda d, x_of=x_of, amax=amax: (x_of(d), amax(d), 16),
                )
            )
            out.append(
                Check(
                    f"nvfp4_backward_amax amax={a} {dtype}",
                    "nvfp4_backward_amax_flagged",
                    lambda d, x_of=x_of, amax=amax: (_grad_like(x_of("cpu"), 9).to(d), x_of(d), amax(d), 16),
                )
            )
    return out


def forward_checks():
    return nvfp4_checks() + mx_checks() + minifloat_checks()


GROUPS: dict[str, Callable[[], list]] = {
    "nvfp4": nvfp4_checks,
    "mx": mx_checks,
    "minifloat": minifloat_checks,
    "backward": backward_checks,
    "nvfp4_amax": nvfp4_amax_checks,
}


# --- backward through the public autograd ops -----------------------------------------------------------------------
def _grad_run(x0: torch.Tensor, op: Callable, scale0: torch.Tensor | None = None):
    def run(device):
        # fresh leaves each run: x0.to("cpu") is x0 itself, whose .grad a second run would accumulate into (and
        # share with the first run's result), and once x0 requires grad, x0.to("cuda") is no leaf at all
        x = x0.detach().clone().to(device).requires_grad_()
        s = scale0.detach().clone().to(device).requires_grad_() if scale0 is not None else None
        y = op(x, s) if s is not None else op(x)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
        y.backward(g.to(device))
        return (y.detach(), x.grad) + ((s.grad,) if s is not None else ())

    return run


def grad_failures(run_native: Callable) -> list[str]:
    """Every :func:`grad_checks` case: ``run_native(check)`` (the CUDA or emulated kernels) against the reference
    backend on the CPU (:func:`compare_grads`); the failure messages."""
    from modelopt_lite.functional import backend

    failures = []
    for check in grad_checks():
        got = run_native(check)
        with backend.use_backend("reference"):
            want = check.run("cpu")
        try:
            compare_grads(got, want, check.what)
        except AssertionError as e:
            failures.append(str(e))
    return failures


def grad_checks(dtypes=DTYPES):
    out = []
    for dtype in dtypes:
        x0 = data((6, 83), dtype, 11)
        for block in (16, 32):
            out.append(
                GradCheck(
                    f"nvfp4_fake_quant block={block} {dtype} (global scale computed on the device)",
                    _grad_run(x0, lambda x, b=block: lx.nvfp4_fake_quant(x, x.detach().float().abs().amax() * 0.5, b)),
                )
            )
        for elem in ELEMS:
            for rounding in ROUNDINGS:
                out.append(
                    GradCheck(
                        f"mx_fake_quant {elem} {rounding} {dtype}",
                        _grad_run(x0, lambda x, e=elem, r=rounding: lx.mx_fake_quant(x, e, 32, r)),
                    )
                )
        for name, op, bound in (("fake_e5m2", lm.fake_e5m2, ms.E5M2_MAX), ("fake_e2m1", lm.fake_e2m1, ms.E2M1_MAX)):
            per_row = x0.float().abs().amax(dim=1, keepdim=True) * 0.5 / bound  # clips: both gradient branches
            per_row[2] = 0.0
            for sname, s0 in (("per-tensor", per_row.amax().reshape(1)), ("per-channel", per_row)):
                out.append(
                    GradCheck(
                        f"{name} learned {sname} scale {dtype}",
                        _grad_run(x0, lambda x, s, op=op: op(x, s), s0),
                    )
                )
    return out
