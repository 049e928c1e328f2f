"""The pure-torch reference: the one definition of every numeric format.

Every backend (C++ CPU, CUDA) is tested bit for bit against these functions. They work on *scales*, already
computed by the caller as ``float32(amax) / float32(bound)``; a scale of exactly 0 marks a dead slice
(``amax <= 2**-24``), which quantizes to exact zeros. ``scale`` is float32 and broadcastable to ``x`` (same rank,
each dim 1 or equal to x's). Everything is computed in float32 and the fake-quant result is cast back to x's dtype.

Formulas (``rint`` = round half to even, ``/`` = IEEE float32 division, as in ONNX Runtime's QuantizeLinear):

- integer:  ``q = clamp(rint(x / s), qmin, qmax)``, ``y = q * s``
- E4M3:     ``y = e4m3(clamp(x / s, -448, 448)) * s`` (round to nearest even, saturating)
- affine:   ``q = clamp(rint(x / s) + zp, qmin, qmax)``, ``y = (q - zp) * s``

Backward (straight-through estimator with clipping, both ends included):
``dy/dx = 1[qmin * s <= x <= qmax * s]`` and, for learnable ranges, ``dy/ds = q - x/s`` inside the grid,
``qmin`` below it, ``qmax`` above it (so ``dy/damax = (dy/ds) / bound``, the LSQ gradient).
"""

from __future__ import annotations

import torch

from ..formats import E4M3_MAX, to_e4m3


def _safe(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dead = scale == 0
    return dead, torch.where(dead, torch.ones_like(scale), scale)


def quantize_int(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Integer codes ``q`` as float32 (NaN where x is NaN; 0 in dead slices)."""
    dead, s = _safe(scale)
    q = torch.clamp(torch.round(x.float() / s), qmin, qmax)
    return torch.where(dead, torch.zeros_like(q), q)


def fake_quant_int(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``clamp(rint(x / s), qmin, qmax) * s`` in float32, returned in x's dtype."""
    dead, s = _safe(scale)
    y = torch.clamp(torch.round(x.float() / s), qmin, qmax) * s
    return torch.where(dead, torch.zeros_like(y), y).to(x.dtype)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even into float8_e4m3fn, returned as float32 (NaN stays NaN)."""
    return to_e4m3(v).float()


def fake_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x / s, -448, 448)) * s`` in float32, returned in x's dtype."""
    dead, s = _safe(scale)
    y = e4m3_round(x.float() / s) * s
    return torch.where(dead, torch.zeros_like(y), y).to(x.dtype)


def quantize_affine(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int):
    """Affine codes ``clamp(rint(x / s) + zp, qmin, qmax)`` as float32 (zp in dead slices)."""
    dead, s = _safe(scale)
    q = torch.clamp(torch.round(x.float() / s) + zero_point, qmin, qmax)
    return torch.where(dead, zero_point.expand_as(q), q)


def fake_affine(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int):
    """``(clamp(rint(x / s) + zp, qmin, qmax) - zp) * s``, returned in x's dtype."""
    dead, s = _safe(scale)
    y = (torch.clamp(torch.round(x.float() / s) + zero_point, qmin, qmax) - zero_point) * s
    return torch.where(dead, torch.zeros_like(y), y).to(x.dtype)


def ste_mask(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``lo <= x <= hi`` evaluated in float32 (bounds already multiplied by the scale)."""
    xf = x.float()
    return (xf >= lo) & (xf <= hi)


def int_backward(grad, x, scale, qmin: int, qmax: int, need_scale_grad: bool):
    """STE gradient for x, and (optionally) the per-element gradient for the scale (not yet reduced)."""
    g = grad.float()
    grad_x = torch.where(ste_mask(x, qmin * scale, qmax * scale), g, torch.zeros_like(g)).to(grad.dtype)
    if not need_scale_grad:
        return grad_x, None
    dead, s = _safe(scale)
    v = x.float() / s
    q = torch.clamp(torch.round(v), qmin, qmax)
    term = torch.where(v < qmin, torch.full_like(v, qmin), torch.where(v > qmax, torch.full_like(v, qmax), q - v))
    return grad_x, torch.where(dead, torch.zeros_like(term), term * g)


def e4m3_backward(grad, x, scale, need_scale_grad: bool):
    """STE gradient for x over ``[-448 s, 448 s]`` and the per-element scale gradient."""
    g = grad.float()
    grad_x = torch.where(ste_mask(x, -E4M3_MAX * scale, E4M3_MAX * scale), g, torch.zeros_like(g)).to(grad.dtype)
    if not need_scale_grad:
        return grad_x, None
    dead, s = _safe(scale)
    v = x.float() / s
    m = E4M3_MAX
    term = torch.where(v < -m, torch.full_like(v, -m), torch.where(v > m, torch.full_like(v, m), e4m3_round(v) - v))
    return grad_x, torch.where(dead, torch.zeros_like(term), term * g)


def affine_backward(grad, x, scale, zero_point, qmin: int, qmax: int):
    """STE gradient for affine quantization: pass where ``(qmin - zp) s <= x <= (qmax - zp) s``."""
    g = grad.float()
    mask = ste_mask(x, (qmin - zero_point) * scale, (qmax - zero_point) * scale)
    return torch.where(mask, g, torch.zeros_like(g)).to(grad.dtype)
