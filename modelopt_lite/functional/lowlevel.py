"""The low-level quantize/dequantize pair: explicit scale (and zero point), per tensor or per axis.

These are thin, validated wrappers over the same ``torch.ops.modelopt_lite.*`` ops the rest of the library uses
(bit-exact with ONNX Runtime's QuantizeLinear/DequantizeLinear):

- symmetric (``zero_point=None``): ``q = clamp(rint(x / scale), qmin, qmax)``
- asymmetric: ``q = clamp(rint(x / scale) + zero_point, qmin, qmax)``; ``dequantize`` gives ``(q - zero_point) * scale``

``mode="simulate"`` returns the fake-quantized tensor in x's dtype (what training and accuracy studies use);
``mode="hardware"`` returns the integer codes in the smallest integer dtype that holds ``[qmin, qmax]``.
Exposed as ``modelopt_lite.quantize_tensor`` / ``modelopt_lite.dequantize_tensor``.
"""

from __future__ import annotations

import numbers

import torch

from ..formats import smallest_code_type
from . import library
from .checks import check_axes, check_input, first_bad

_MODES = ("simulate", "hardware")
_QLIMIT = 2**24  # integers beyond this are not exact in float32, where the kernels compute


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _check_qrange(qmin, qmax) -> tuple[int, int]:
    for name, v in (("qmin", qmin), ("qmax", qmax)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"quantize: {name} must be an int, got {v!r}")
        if not -_QLIMIT <= int(v) <= _QLIMIT:
            raise ValueError(f"quantize: {name}={v} is outside [-2**24, 2**24] (not exact in float32)")
    if qmin >= qmax:
        raise ValueError(f"quantize: qmin must be < qmax, got qmin={qmin}, qmax={qmax}")
    return int(qmin), int(qmax)


def code_dtype(qmin: int, qmax: int) -> torch.dtype:
    """The smallest integer dtype holding ``[qmin, qmax]`` (int8, uint8, int16 or int32)."""
    c = smallest_code_type(qmin, qmax)
    if c is None or c.torch_dtype is None:
        raise ValueError(f"no integer dtype holds [{qmin}, {qmax}]")
    return c.torch_dtype


def _broadcast_param(value, x: torch.Tensor, axes: tuple[int, ...] | None, axis, what: str) -> torch.Tensor:
    """``value`` (number or tensor) as a float32 tensor broadcastable against x, checked against ``axis``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number or a tensor, got {value!r}")
    if isinstance(value, numbers.Real):
        return torch.tensor(float(value), dtype=torch.float32, device=x.device)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a number or a tensor, got {type(value).__name__}")
    if value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{what} must be a real floating or integer tensor, got {value.dtype}")
    t = value.to(device=x.device, dtype=torch.float32)  # float32: the precision the kernels and exports use
    if t.numel() == 1:
        return t.reshape(())
    if axes is None:
        raise ValueError(
            f"{what} has {t.numel()} elements (shape {tuple(t.shape)}) but axis is None; pass axis= for "
            "per-channel quantization or a single-element tensor for per-tensor quantization"
        )
    keep = [x.shape[a] if a in axes else 1 for a in range(x.dim())]
    compact = tuple(x.shape[a] for a in axes)
    if tuple(t.shape) == compact:
        order = sorted(range(len(axes)), key=lambda i: axes[i])  # the scale's dims in the tensor's dim order
        return t.permute(order).reshape(keep)
    if tuple(t.shape) == tuple(keep):
        return t
    raise ValueError(
        f"{what} of shape {tuple(t.shape)} does not match axis={axis!r} for x of shape "
        f"{tuple(x.shape)}: expected {compact} (or {tuple(keep)}, or one element)"
    )


def _check_scale(scale: torch.Tensor) -> None:
    if _compiling():
        return
    bad = ~torch.isfinite(scale) | (scale <= 0)
    if bool(bad.any()):
        raise ValueError(f"scale must be finite and > 0, got {first_bad(scale, bad)!r}")


def _check_zero_point(zp: torch.Tensor, qmin: int | None = None, qmax: int | None = None) -> None:
    if _compiling():
        return
    bad = ~torch.isfinite(zp) | (zp != torch.round(zp))
    if bool(bad.any()):
        raise ValueError(f"zero_point must hold integers, got {first_bad(zp, bad)!r}")
    if qmin is None or qmax is None:
        return
    out = (zp < qmin) | (zp > qmax)
    if bool(out.any()):
        raise ValueError(f"zero_point must lie in [qmin, qmax] = [{qmin}, {qmax}], got {first_bad(zp, out)!r}")


def _params(x, scale, zero_point, qmin, qmax, axis):
    axes = None if axis is None else check_axes(axis, x.dim(), "axis")
    s = _broadcast_param(scale, x, axes, axis, "scale")
    _check_scale(s)
    zp = None
    if zero_point is not None:
        zp = _broadcast_param(zero_point, x, axes, axis, "zero_point")
        _check_zero_point(zp, qmin, qmax)
    return s, zp


def quantize(x, scale, zero_point=None, qmin: int = -128, qmax: int = 127, axis=None, mode: str = "simulate"):
    """Quantize ``x`` with an explicit ``scale`` (and optional ``zero_point``).

    Args:
        x: float32/float16/bfloat16 tensor (any layout).
        scale: a positive finite number, a one-element tensor (per tensor), or per-axis values (used as float32):
            1-D of length ``x.shape[axis]`` for one axis, shaped ``[x.shape[a] for a in axis]`` for a tuple of
            axes (a tensor with x's rank and size 1 elsewhere is accepted too).
        zero_point: None (symmetric) or integers in ``[qmin, qmax]``, shaped like ``scale``.
        qmin, qmax: the integer grid, ``qmin < qmax`` (e.g. -128/127, 0/255, -8/7).
        axis: None (per tensor), an int, or a tuple of ints (negative allowed).
        mode: ``"simulate"`` (fake-quantized values in x's dtype) or ``"hardware"`` (integer codes in the smallest
            integer dtype holding ``[qmin, qmax]``).

    Raises:
        TypeError / ValueError naming the argument and the bad value (non-finite or non-positive scale,
        qmin >= qmax, fractional or out-of-range zero point, bad axis, NaN input in hardware mode).
    """
    check_input(x, "x")
    if mode not in _MODES:
        raise ValueError(f"quantize: mode must be one of {_MODES}, got {mode!r}")
    qmin, qmax = _check_qrange(qmin, qmax)
    s, zp = _params(x, scale, zero_point, qmin, qmax, axis)
    if mode == "simulate":
        return library.fake_quant_int(x, s, qmin, qmax) if zp is None else library.fake_affine(x, s, zp, qmin, qmax)
    q = library.quantize_int(x, s, qmin, qmax) if zp is None else library.quantize_affine(x, s, zp, qmin, qmax)
    if not _compiling() and bool(torch.isnan(q).any()):
        raise ValueError(
            "quantize: x contains NaN, which has no integer code (mode='hardware'); clean the input "
            "or use mode='simulate'"
        )
    return q.to(code_dtype(qmin, qmax))


def dequantize(q, scale, zero_point=None, axis=None):
    """Map codes back to real values: ``(q - zero_point) * scale`` (``q * scale`` if symmetric), in float32.

    ``q`` is an integer or floating tensor of codes (e.g. from ``quantize(..., mode="hardware")``); ``scale``,
    ``zero_point`` and ``axis`` follow :func:`quantize`. For float32 inputs,
    ``dequantize(quantize(x, s, mode="hardware"), s)`` equals ``quantize(x, s)`` exactly.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype == torch.bool or q.is_complex():
        raise TypeError(f"q must be an integer or floating tensor of codes, got {q.dtype}")
    axes = None if axis is None else check_axes(axis, q.dim(), "axis")
    s = _broadcast_param(scale, q, axes, axis, "scale")
    _check_scale(s)
    qf = q.to(torch.float32)
    if zero_point is None:
        return qf * s
    zp = _broadcast_param(zero_point, q, axes, axis, "zero_point")
    _check_zero_point(zp)
    return (qf - zp) * s
