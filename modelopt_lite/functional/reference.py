"""The pure-torch reference: the one definition of every numeric format.

Every backend (C++ CPU, CUDA) is tested bit for bit against these functions. They work on *scales*, already
computed by the caller as ``float32(amax) / float32(bound)``; a scale of exactly 0 marks a dead slice
(``amax <= 2**-24``), which quantizes to exact zeros. ``scale`` is float32 and broadcastable to ``x`` (same rank,
each dim 1 or equal to x's). Everything is computed in float32 and the fake-quant result is cast back to x's dtype.

Formulas (``rint`` = round half to even, ``/`` = IEEE float32 division, as in ONNX Runtime's QuantizeLinear):

- integer:  ``q = clamp(rint(x / s), qmin, qmax)``, ``y = q * s``; code 0 is ``+0.0`` (an integer has no sign:
  ``y`` is ``+0.0`` where a negative ``x`` rounds to 0, as ONNX Runtime's DequantizeLinear gives)
- E4M3:     ``y = e4m3(clamp(x / s, -448, 448)) * s`` (round to nearest even, saturating; float8 has a ``-0``
  code, and ONNX Runtime's FP8 QuantizeLinear/DequantizeLinear keep it: a negative ``x`` that rounds to 0 gives
  ``-0.0``)
- affine:   ``q = clamp(rint(x / s) + zp, qmin, qmax)``, ``y = (q - zp) * s`` (``q - zp`` is ``+0.0`` when equal)

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


def _scaled(x: torch.Tensor, s: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``float32(x) / s`` as a fresh float32 tensor of the broadcast shape, which the callers then update in place
    (one float32 buffer for the whole formula: a float16/bfloat16 input needs no further temporaries)."""
    shape = torch.broadcast_shapes(x.shape, s.shape, *(o.shape for o in others))
    if shape == x.shape:
        return x.to(torch.float32, copy=True).div_(s)
    return torch.div(x.float(), s).expand(shape).contiguous()


def _int_codes(x: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``clamp(rint(x / s), qmin, qmax)`` with code 0 as ``+0.0``: a negative value that rounds to 0 gives ``-0.0``
    in IEEE arithmetic, but an integer code has no sign (ONNX Runtime's ``DequantizeLinear(0)`` is ``+0.0``), so
    ``+ 0.0`` (which turns ``-0.0`` into ``+0.0`` and leaves every other value alone) makes ``q * s`` match it."""
    return _scaled(x, s).round_().clamp_(qmin, qmax).add_(0.0)


def quantize_int(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Integer codes ``q`` as float32 (NaN where x is NaN; 0 in dead slices)."""
    dead, s = _safe(scale)
    return _int_codes(x, s, qmin, qmax).masked_fill_(dead, 0.0)


def fake_quant_int(x: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``clamp(rint(x / s), qmin, qmax) * s`` in float32, returned in x's dtype."""
    dead, s = _safe(scale)
    return _int_codes(x, s, qmin, qmax).mul_(s).masked_fill_(dead, 0.0).to(x.dtype)


def _e4m3_round_(v: torch.Tensor) -> torch.Tensor:
    """:func:`e4m3_round` in place (v: a float32 tensor the caller owns)."""
    return v.copy_(v.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even into float8_e4m3fn, returned as float32 (NaN stays NaN)."""
    return to_e4m3(v).float()


def fake_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(x / s, -448, 448)) * s`` in float32, returned in x's dtype."""
    dead, s = _safe(scale)
    return _e4m3_round_(_scaled(x, s)).mul_(s).masked_fill_(dead, 0.0).to(x.dtype)


def quantize_affine(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int):
    """Affine codes ``clamp(rint(x / s) + zp, qmin, qmax)`` as float32 (zp in dead slices)."""
    dead, s = _safe(scale)
    q = _scaled(x, s, zero_point).round_().add_(zero_point).clamp_(qmin, qmax)
    return torch.where(dead, zero_point.float().expand_as(q), q)


def fake_affine(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int):
    """``(clamp(rint(x / s) + zp, qmin, qmax) - zp) * s``, returned in x's dtype."""
    dead, s = _safe(scale)
    y = _scaled(x, s, zero_point).round_().add_(zero_point).clamp_(qmin, qmax).sub_(zero_point).mul_(s)
    return y.masked_fill_(dead, 0.0).to(x.dtype)


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
