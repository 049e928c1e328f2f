"""From ranges to scales: the only place that turns amax (or min/max) into the scales the kernels use.

``scale = float32(amax) / float32(bound)``; a dead slice (``amax <= 2**-24``) gets scale 0, which every kernel
turns into exact zeros. These are ordinary differentiable torch expressions, so a learnable amax receives its
gradient through them (the kernels supply ``dy/dscale``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..formats import AMAX_EPS, format_range, int_range
from .checks import first_bad
from .division import scalar_tensor, true_div

_ONE_ULP_DOWN = 1.0 - 2.0**-24  # s * this == the float32 just below s (for any normal s > 0)


_THRESHOLDS: dict[float, float | None] = {}


@torch.compiler.assume_constant_result  # torch.compile calls it eagerly: a constant per bound
def _overflow_threshold(bound: float) -> float | None:
    """The smallest float32 ``a`` whose grid end ``float32(float32(a / bound) * bound)`` overflows to Inf, or None
    when no finite ``a`` does (most bounds: 448, 255, 6, ...; 127 only at float32's largest value). Both roundings
    are monotone in ``a``, so the overflowing amaxes are exactly ``a >= threshold``: a bisection over the bit
    patterns of the non-negative finite float32 values, once per bound, in numpy float32 arithmetic (IEEE, as the
    kernels'; no torch op, so a first call during torch.jit tracing records nothing in the traced graph)."""
    if bound in _THRESHOLDS:
        return _THRESHOLDS[bound]
    b = np.float32(bound)

    def as_f32(bits: int) -> np.float32:
        return np.array([bits], dtype=np.int32).view(np.float32)[0]

    def overflows(bits: int) -> bool:
        with np.errstate(over="ignore"):
            return bool(np.isinf((as_f32(bits) / b) * b))

    lo, hi = 0, 0x7F7FFFFF  # +0.0 .. float32's largest finite value
    found = None
    if overflows(hi):
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if overflows(mid) else (mid + 1, hi)
        found = float(as_f32(lo))
    if len(_THRESHOLDS) >= 256:  # bounds come from bit widths and formats: a handful in practice
        _THRESHOLDS.clear()
    _THRESHOLDS[bound] = found
    return found


def scale_from_amax(amax: torch.Tensor, bound: float) -> torch.Tensor:
    """float32 scale, 0 where amax <= 2**-24.

    Where ``float32(amax / bound)`` rounds up far enough that the grid's end ``bound * scale`` overflows float32
    (an amax within a rounding step of float32's largest value, ~3.4e38), the scale is the float32 just below it,
    so that every finite input quantizes to a finite value (the stored and exported scale is that value too).

    Few ops (each is a kernel launch on a GPU, paid on every quantizer call): the overflowing amaxes are found by
    one comparison with a threshold computed once per bound (``a = Inf`` takes that branch too, and stays Inf;
    NaN never does), and the dead slices by one ``masked_fill`` (+0.0, also for a negative amax)."""
    a = amax.float()
    b = scalar_tensor(float(bound), torch.float32, a.device)  # no host sync on CUDA
    s = a / b
    threshold = _overflow_threshold(float(bound))
    if threshold is not None:
        s = torch.where(a >= threshold, s * _ONE_ULP_DOWN, s)
    return s.masked_fill(a <= AMAX_EPS, 0.0)


def bound_of(num_bits, unsigned: bool = False, narrow_range: bool = False) -> float:
    """The value amax maps to: 448 for E4M3, else ``int_range(...).bound``."""
    return float(format_range(num_bits, unsigned, narrow_range).bound)


def positive_scale(scale: torch.Tensor) -> torch.Tensor:
    """The scale users see and exports store: dead slices (scale 0) report 1.0 (their codes are all 0)."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def affine_params(min_range: torch.Tensor, max_range: torch.Tensor, num_bits: int):
    """``(scale, zero_point, qmin, qmax)`` for asymmetric quantization with b bits stored signed.

    The range is widened to include 0; ``scale = float32(hi - lo) / (2**b - 1)``;
    ``zp = clamp(rint(qmin - lo / scale), qmin, qmax)`` (``+0.0``, never ``-0.0``). A degenerate range
    (``hi - lo <= 2**-24``) is dead. A range wider than float32 holds (``hi - lo`` above ~3.4e38, e.g.
    ``[-3e38, 3e38]``) gets the same scale computed in float64 (``hi - lo`` of two float32 values is exact there,
    and rounding it to float32 first gives the float32 result whenever that is finite, so ordinary ranges keep their
    bit pattern). A range whose grid ends ``(qmin - zp) * scale`` / ``(qmax - zp) * scale`` overflow float32 (only
    ranges reaching ~3.4e38) raises ValueError, as does a NaN or Inf ``min_range`` / ``max_range``.
    """
    _, qmin, qmax = int_range(num_bits, False, False)
    lo = torch.clamp(min_range.float(), max=0.0)
    hi = torch.clamp(max_range.float(), min=0.0)
    width = hi - lo
    scale = scale_from_amax(width, float(2**num_bits - 1))
    wide = torch.isinf(width) & torch.isfinite(lo) & torch.isfinite(hi)
    if bool(wide.any()):  # float32(hi - lo) overflowed: the float64 width and division, rounded once to float32
        wide_scale = true_div(hi.double() - lo.double(), float(2**num_bits - 1)).float()
        scale = torch.where(wide, wide_scale, scale)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    zp = torch.clamp(torch.round(qmin - lo / safe), qmin, qmax).add_(0.0)
    zp = torch.where(scale == 0, torch.zeros_like(zp), zp)
    if not torch.compiler.is_compiling():
        ends = torch.stack([(qmin - zp) * scale, (qmax - zp) * scale])
        if not bool(torch.isfinite(ends).all()):  # NaN/Inf in the range make the ends non-finite too: no extra sync
            for name, t in (("min_range", min_range), ("max_range", max_range)):
                nonfinite = ~torch.isfinite(t.detach())
                if bool(nonfinite.any()):
                    v = first_bad(t, nonfinite)
                    raise ValueError(f"affine quantization: {name} must be finite, got {v!r}")
            bad = (~torch.isfinite(ends)).any(dim=0)
            raise ValueError(
                f"the affine range [{first_bad(lo, bad)!r}, {first_bad(hi, bad)!r}] is too wide "
                f"for {num_bits}-bit quantization in float32: its grid ends dequantize to Inf; narrow the range"
            )
    return scale, zp.detach(), qmin, qmax


def amax_for_scale(scale: torch.Tensor, bound: float) -> tuple[torch.Tensor, bool]:
    """A float32 amax whose :func:`scale_from_amax` is ``scale`` (a positive finite float32 scalar), and whether it is
    exact: the inverse used where only the scale was stored (an HF checkpoint's ``k_scale = amax / 448``).

    Starts at ``float32(scale * bound)`` and walks a few float32 steps either way; every scale that a true division
    ``float32(amax) / bound`` produced has such an amax. A scale no amax maps to (written by other arithmetic, e.g.
    a multiplication by ``1 / bound``) gets the amax whose scale is nearest, and ``False``."""
    s = scale.detach().to("cpu", torch.float32).reshape(())
    start = (s.double() * float(bound)).float()
    up, down = start.clone(), start.clone()
    inf = torch.tensor(float("inf"))
    best, best_err = start, float("inf")
    for _ in range(16):
        for a in (up, down):
            got = scale_from_amax(a, bound)
            if torch.equal(got, s):
                return a, True
            err = abs(float(got) - float(s))
            if err < best_err:
                best, best_err = a, err
        up, down = torch.nextafter(up, inf), torch.nextafter(down, -inf)
    return best, False
