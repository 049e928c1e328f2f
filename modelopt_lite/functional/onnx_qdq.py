"""Standard QuantizeLinear/DequantizeLinear from a *plain* ``torch.onnx.export`` of a fake-quantized model.

ModelOpt and pytorch-quantization scripts export with ``torch.onnx.export(model, x, path)`` (dynamo, torch's
default) or ``torch.onnx.export(..., dynamo=False)`` (TorchScript). While such an export traces the model
(``torch.onnx.is_in_onnx_export()``), the fake-quant ops of :mod:`.library` are replaced by
:func:`fake_quant_int` / :func:`fake_e4m3` / :func:`fake_affine` here, which write standard nodes:

- TorchScript: an ``autograd.Function`` whose ``symbolic`` emits ``QuantizeLinear -> DequantizeLinear`` (the
  exporter's documented hook for Python functions; nothing is registered globally);
- dynamo: ``torch.onnx.ops.symbolic("::QuantizeLinear", ...)`` and ``"::DequantizeLinear"``, which the exporter
  writes as the standard ops (no ``custom_translation_table`` needed).

Exactness (the same rules as :mod:`modelopt_lite.onnx_export.qdq`): the Q output type is int8 or uint8 (the
smallest that holds ``[qmin, qmax]``); a narrower grid (narrow range, fewer than 8 bits, affine grids inside the
container) first clamps ``x`` to ``[(qmin - zp) * s, (qmax - zp) * s]`` in float32 (Max/Min nodes), so
``Q(clamp(x))`` equals ``clamp(rint(x / s), qmin, qmax)`` bit for bit. A scale broadcast along one dimension
becomes the ``axis``; a block scale (leading dims of x, size 1 after) quantizes x viewed as ``(blocks, -1)`` on
axis 0. FP8 E4M3/E5M2 is ``QuantizeLinear`` with a FLOAT8E4M3FN/FLOAT8E5M2 zero point (opset >= 19); FP4 E2M1
raises ValueError (use :func:`modelopt_lite.export_onnx`, which writes FLOAT4E2M1 at opset 23). float16/bfloat16 inputs are
cast to float32 around the pair.

What it cannot express raises ValueError naming the value: grids wider than 8 bits, a scale varying along
several non-leading dims, and (TorchScript, where values are known) dead scales (0: amax <= 2**-24), per-channel
below opset 13 and FP8 below opset 19. :func:`modelopt_lite.export_onnx` handles all of those; it traces with
:func:`raw_ops` active, so its own marker post-pass sees the original ops.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import NoReturn

import torch
from torch import Tensor

from . import eager

_state = threading.local()


@contextlib.contextmanager
def raw_ops():
    """Trace the original ``torch.ops.modelopt_lite`` ops (``export_onnx`` turns them into Q/DQ afterwards)."""
    prev = getattr(_state, "raw", False)
    _state.raw = True
    try:
        yield
    finally:
        _state.raw = prev


def active() -> bool:
    """True while a plain ``torch.onnx.export`` traces (and :func:`raw_ops` is not active). The cheap tracing checks
    come first, so an eager call pays two C calls (``torch.onnx.is_in_onnx_export`` imports on every call)."""
    if not (torch.jit.is_tracing() or torch.compiler.is_exporting()):
        return False
    return torch.onnx.is_in_onnx_export() and not getattr(_state, "raw", False)


class _TorchScriptQDQ(torch.autograd.Function):
    """``forward`` gives the eager value; the TorchScript exporter calls ``symbolic`` instead."""

    @staticmethod
    def forward(ctx, x, s, zp, axis, cast_to=None):
        return _reference_qdq(x, s, zp if cast_to is None else zp.to(_TS_CAST[cast_to]), axis)

    @staticmethod
    def symbolic(g, x, s, zp, axis, cast_to=None):  # pragma: no cover - run by the TorchScript exporter
        opset = g.opset
        if cast_to is not None:  # a zero point type TorchScript has no scalar type for: a float32 zero, cast
            if opset < 19:
                raise ValueError(f"ONNX export: FP8 E5M2 QuantizeLinear needs opset >= 19, got opset {opset}")
            zp = g.op("Cast", zp, to_i=cast_to)
        if axis is not None and opset < 13:
            raise ValueError(f"ONNX export: per-channel quantization (axis {axis}) needs opset >= 13, got {opset}")
        fp8 = {"Float8_e4m3fn": "E4M3", "Float8_e5m2": "E5M2"}.get(str(zp.type().scalarType()))
        if fp8 is not None and opset < 19:
            raise ValueError(f"ONNX export: FP8 {fp8} QuantizeLinear needs opset >= 19, got opset {opset}")
        kw = {} if axis is None else {"axis_i": axis}
        q = g.op("QuantizeLinear", x, s, zp, **kw)
        return g.op("DequantizeLinear", q, s, zp, **kw)


def _reference_qdq(x: Tensor, s: Tensor, zp: Tensor, axis) -> Tensor:
    """What ONNX's QuantizeLinear -> DequantizeLinear computes (the value the TorchScript tracer sees)."""
    if axis is not None:
        view = [-1] + [1] * (x.dim() - axis - 1)
        s, zp = s.reshape(view), zp.reshape(view)
    if zp.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # saturate=1
        top = torch.finfo(zp.dtype).max
        return (x / s).clamp(-top, top).to(zp.dtype).to(torch.float32) * s
    info = torch.iinfo(zp.dtype)
    zpf = zp.to(torch.float32)
    return (torch.clamp(torch.round(x / s) + zpf, info.min, info.max) - zpf) * s


#: ONNX element type (``TensorProto.FLOAT8E5M2``) -> torch dtype, for zero points TorchScript cannot hold
_TS_CAST = {19: torch.float8_e5m2}
_TS_CAST_OF = {v: k for k, v in _TS_CAST.items()}


def _pair(x: Tensor, s: Tensor, zp: Tensor, axis) -> Tensor:
    if torch.jit.is_tracing():
        return _TorchScriptQDQ.apply(x, s, zp, axis)
    attrs = {} if axis is None else {"axis": axis}
    q = torch.onnx.ops.symbolic("::QuantizeLinear", (x, s, zp), attrs, dtype=zp.dtype, shape=x.shape)
    return torch.onnx.ops.symbolic("::DequantizeLinear", (q, s, zp), attrs, dtype=torch.float32, shape=x.shape)


def _fail(message: str) -> NoReturn:
    """Raise ValueError; under the dynamo exporter also warn, because torch retries the capture with other
    strategies and reports only its own last error ("No ONNX function found for modelopt_lite.fake_quant_int")."""
    if not torch.jit.is_tracing():
        warnings.warn(message, UserWarning, stacklevel=3)
    raise ValueError(message)


def _layout(x: Tensor, scale: Tensor):
    """``(x view, 1-D or scalar scale, axis or None, restore)`` for a scale broadcast against ``x``."""
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return x, s.reshape(()), None, lambda y: y
    lead = x.dim() - s.dim()
    shape = [1] * lead + list(s.shape)
    dims = [d for d, n in enumerate(shape) if n != 1]
    if len(dims) == 1:
        return x, s.reshape(-1), dims[0], lambda y: y
    k = dims[-1] + 1
    if dims == list(range(k)) and list(x.shape[:k]) == shape[:k]:
        xs = x.shape
        return x.reshape(s.numel(), -1), s.reshape(-1), 0, lambda y: y.reshape(xs)
    _fail(
        f"ONNX export: a scale of shape {tuple(scale.shape)} for a tensor of shape {tuple(x.shape)} varies along "
        f"dims {dims}; QuantizeLinear takes one axis (use modelopt_lite.export_onnx for this quantizer)"
    )


def _check_live(scale: Tensor) -> None:
    if torch.jit.is_tracing() and bool((scale <= 0).any()):
        _fail(
            "ONNX export: a quantizer has a dead scale (amax <= 2**-24), which a plain QuantizeLinear cannot "
            "express exactly; export with modelopt_lite.export_onnx (it writes a Where that zeroes those values)"
        )


def _int_qdq(x: Tensor, scale: Tensor, zero_point, qmin: int, qmax: int) -> Tensor:
    if -128 <= qmin and qmax <= 127:
        code, lo, hi = torch.int8, -128, 127
    elif 0 <= qmin and qmax <= 255:
        code, lo, hi = torch.uint8, 0, 255
    else:
        _fail(
            f"ONNX export: the grid [{qmin}, {qmax}] needs a 16-bit QuantizeLinear (opset >= 21), which a plain "
            "torch.onnx.export does not write; use modelopt_lite.export_onnx"
        )
    _check_live(scale)
    dtype = x.dtype
    xv, s, axis, restore = _layout(x.to(torch.float32), scale)
    zpf = torch.zeros_like(s) if zero_point is None else zero_point.to(torch.float32).reshape(s.shape)
    if (qmin, qmax) != (lo, hi):
        view = s if axis is None else s.reshape([-1] + [1] * (xv.dim() - axis - 1))
        zv = zpf if axis is None else zpf.reshape(view.shape)
        xv = torch.minimum(torch.maximum(xv, (qmin - zv) * view), (qmax - zv) * view)
    y = _pair(xv, s, zpf.round().to(code), axis)
    return restore(y).to(dtype)


def fake_quant_int(op, x: Tensor, scale: Tensor, qmin: int, qmax: int) -> Tensor:
    return _int_qdq(x, scale, None, qmin, qmax)


def fake_affine(op, x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int) -> Tensor:
    return _int_qdq(x, scale, zero_point, qmin, qmax)


def _float_qdq(x: Tensor, scale: Tensor, code_dtype: torch.dtype) -> Tensor:
    _check_live(scale)
    dtype = x.dtype
    xv, s, axis, restore = _layout(x.to(torch.float32), scale)
    cast_to = _TS_CAST_OF.get(code_dtype) if torch.jit.is_tracing() else None
    if cast_to is not None:  # TorchScript has no scalar type for it: a float32 zero point, cast in the graph
        y = _TorchScriptQDQ.apply(xv, s, torch.zeros(s.shape, dtype=torch.float32), axis, cast_to)
    else:
        y = _pair(xv, s, torch.zeros(s.shape, dtype=code_dtype), axis)
    return restore(y).to(dtype)


def fake_e4m3(op, x: Tensor, scale: Tensor) -> Tensor:
    return _float_qdq(x, scale, torch.float8_e4m3fn)


def fake_e5m2(op, x: Tensor, scale: Tensor) -> Tensor:
    return _float_qdq(x, scale, torch.float8_e5m2)


def fake_e2m1(op, x: Tensor, scale: Tensor) -> NoReturn:
    _fail(
        "ONNX export: FP4 E2M1 needs a FLOAT4E2M1 QuantizeLinear (opset >= 23), which a plain torch.onnx.export "
        "does not write; use modelopt_lite.export_onnx"
    )


def export_aware(op, emit):
    """``op`` (a ``torch.library`` op) that writes standard Q/DQ during a plain ONNX export."""

    def call(*args):
        if active():
            return emit(op, *args)
        return eager.call(op, *args)

    call.op = op  # type: ignore[attr-defined]
    call.__doc__ = op.__doc__
    call.__name__ = getattr(op, "__name__", "op")
    return call
