"""Fold fake-quantized constant tensors (weights) into integer / FP8 initializers followed by DequantizeLinear.

The integer codes are computed with the project's reference numerics (:mod:`modelopt_lite.functional.reference`),
so ``DequantizeLinear(codes, scale)`` reproduces the torch fake-quant output bit for bit. Shape-only ops that
follow the weight (Transpose, Reshape, Slice, Squeeze, Unsqueeze, Identity: e.g. ``F.linear``'s transpose or the
reshape that undoes block padding) are applied to the codes and to the element-wise scales, then the granularity is
recovered from the scales: per tensor, per axis (``axis``) or blocked (``axis`` + ``block_size``, opset 21).

Storage: INT8/UINT8 codes; INT4/UINT4 (opset >= 21, two codes per byte, first element in the low nibble) when the
range fits; INT16/UINT16 (opset >= 21) for wider grids; FLOAT8E4M3FN / FLOAT8E5M2 (opset >= 19) / FLOAT4E2M1 (opset
>= 23, packed as INT4) for E4M3 / E5M2 / E2M1. Dead slices (scale 0) store code 0
with scale 1.0, so they still dequantize to exact zeros while every exported scale is strictly positive.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from ..formats import CODE_TYPES, FLOAT_ELEMENTS, ONNX_WEIGHT_TYPES, element_format, float_codes, smallest_code_type
from ..functional import reference
from ..functional.microscaling import e2m1_codes
from .graph import Graph, OpsetTooLow, attr
from .symbolic import AFFINE_MARKER, FLOAT_MARKERS

#: shape-only ops a folded weight absorbs (the same op is applied to codes and scales)
ABSORBABLE = ("Transpose", "Reshape", "Slice", "Squeeze", "Unsqueeze", "Identity", "Flatten")

_NP = {getattr(TensorProto, c.onnx_type): c.numpy_dtype for c in CODE_TYPES.values() if c.numpy_dtype is not None}
#: ONNX float element type -> the torch float8 dtype its bytes are (FLOAT4E2M1 is packed by hand)
_FLOAT8 = {getattr(TensorProto, cast(str, f.onnx_type)): f.code_dtype for f in FLOAT_ELEMENTS.values() if f.code_dtype}


@dataclass
class FoldedWeight:
    """Codes, element-wise scales and zero points of a quantized constant, all with the same shape."""

    codes: np.ndarray  # int64 codes, or float32 values exactly representable in the float format
    scale: np.ndarray  # float32, strictly positive
    zero_point: np.ndarray  # int64 (zeros for symmetric formats and E4M3)
    kind: str  # marker op type
    qmin: int
    qmax: int
    #: other element-wise arrays that follow the codes through shape ops (e.g. the codes of quantized scales)
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def apply(self, fn) -> None:
        """Apply the same shape op to codes, scales, zero points and extras."""
        self.codes, self.scale, self.zero_point = fn(self.codes), fn(self.scale), fn(self.zero_point)
        self.extras = {k: fn(v) for k, v in self.extras.items()}


def _align(a, ndim: int) -> torch.Tensor:
    """A scale-shaped array as a tensor broadcastable against an ``ndim``-dimensional constant."""
    t = torch.from_numpy(np.array(a, dtype=np.float32))
    if t.dim() > ndim:
        t = t.reshape(t.shape[t.dim() - ndim :]) if t.numel() > 1 else t.reshape(())
    return t


def fold(
    kind: str, x: np.ndarray, scale: np.ndarray, zero_point, qmin: int, qmax: int, label: str, extras=None
) -> FoldedWeight:
    """Quantize a constant with the reference numerics; dead slices get scale 1.0 and code 0.

    ``extras``: arrays shaped like ``scale`` that are broadcast to the codes' shape as the scales are (kept in
    :attr:`FoldedWeight.extras`)."""
    xt = torch.from_numpy(np.array(x, dtype=np.float32))
    if bool(torch.isnan(xt).any()):
        raise ValueError(f"{label}: the constant (weight) being quantized contains NaN, which has no code")
    st = _align(scale, xt.dim())
    zp = torch.zeros_like(st)
    if kind in FLOAT_MARKERS:
        codes_np = float_codes(element_format(FLOAT_MARKERS[kind]), xt, st).float().numpy()
    elif kind == AFFINE_MARKER:
        zp = torch.from_numpy(np.ascontiguousarray(zero_point, dtype=np.float32)).reshape(st.shape)
        codes_np = reference.quantize_affine(xt, st, zp, qmin, qmax).numpy().astype(np.int64)
    else:
        codes_np = reference.quantize_int(xt, st, qmin, qmax).numpy().astype(np.int64)
    full = np.broadcast_to(st.numpy(), codes_np.shape).astype(np.float32)
    full = np.where(full == 0, np.float32(1.0), full)
    zp_full = np.broadcast_to(zp.numpy(), codes_np.shape).astype(np.int64)
    more = {k: np.broadcast_to(_align(v, xt.dim()).numpy(), codes_np.shape).copy() for k, v in (extras or {}).items()}
    return FoldedWeight(codes_np, full, zp_full, kind, qmin, qmax, more)


# --- absorbing shape ops -------------------------------------------------------------------------------------------
def _ints(g: Graph, node: onnx.NodeProto, index: int, attr_name: str | None = None):
    if len(node.input) > index and node.input[index]:
        name = node.input[index]
        v = g.array(name)
        if v is None:  # a shape computed from constants (e.g. the padding arithmetic of block quantization)
            v = g.constants([name]).get(name)
        return None if v is None else [int(i) for i in np.asarray(v).reshape(-1)]
    return attr(node, attr_name) if attr_name else None


def shape_op(g: Graph, node: onnx.NodeProto, ndim: int):
    """A numpy function doing what ``node`` does to its first input, or None when it cannot be applied."""
    op = node.op_type
    if op == "Identity":
        return lambda a: a
    if op == "Transpose":
        perm = attr(node, "perm") or list(reversed(range(ndim)))
        return lambda a: np.transpose(a, perm)
    if op == "Flatten":
        ax = attr(node, "axis", 1) % max(ndim, 1) if ndim else 0
        return lambda a: a.reshape(int(np.prod(a.shape[:ax])), -1)
    if op == "Reshape":
        shape = _ints(g, node, 1)
        if shape is None:
            return None
        allowzero = attr(node, "allowzero", 0)

        def reshape(a):
            target = [a.shape[i] if (s == 0 and not allowzero) else s for i, s in enumerate(shape)]
            return a.reshape(target)

        return reshape
    if op in ("Squeeze", "Unsqueeze"):
        axes = _ints(g, node, 1, "axes")
        if op == "Squeeze":
            return lambda a: np.squeeze(a, axis=None if axes is None else tuple(x % a.ndim for x in axes))
        if axes is None:
            return None

        def unsqueeze(a):
            out_rank = a.ndim + len(axes)
            for ax in sorted(x % out_rank for x in axes):
                a = np.expand_dims(a, ax)
            return a

        return unsqueeze
    if op == "Slice":
        starts, ends = _ints(g, node, 1, "starts"), _ints(g, node, 2, "ends")
        if starts is None or ends is None:
            return None
        axes = _ints(g, node, 3, "axes") or list(range(len(starts)))
        steps = _ints(g, node, 4) or [1] * len(starts)

        def slicer(a):
            idx = [slice(None)] * a.ndim
            for s, e, ax, st in zip(starts, ends, axes, steps):
                idx[ax % a.ndim] = slice(s, e, st)
            return a[tuple(idx)]

        return slicer
    return None


def absorb(g: Graph, fw: FoldedWeight, out: str) -> tuple[str, list[onnx.NodeProto]]:
    """Fold the chain of single-consumer shape ops after ``out`` into ``fw``; returns (final name, absorbed nodes)."""
    absorbed = []
    while out not in g.outputs:
        users = g.consumers().get(out, [])
        if len(users) != 1 or users[0].op_type not in ABSORBABLE or users[0].domain not in ("", "ai.onnx"):
            break
        node = users[0]
        if node.input[0] != out or any(i == out for i in node.input[1:]):
            break
        fn = shape_op(g, node, fw.codes.ndim)
        if fn is None:
            break
        fw.apply(fn)
        absorbed.append(node)
        out = node.output[0]
    return out, absorbed


# --- granularity ---------------------------------------------------------------------------------------------------
def granularity(s: np.ndarray):
    """``(kind, axis, block_size, compact_index)`` describing how element-wise scales vary, or None.

    ``compact_index`` turns an element-wise array into the compact scale/zero-point tensor.
    """
    if s.size == 0 or np.all(s == s.reshape(-1)[0]):
        return "tensor", None, None, lambda a: np.asarray(a.reshape(-1)[0])
    for ax in range(s.ndim):
        idx = tuple(slice(None) if d == ax else slice(0, 1) for d in range(s.ndim))
        if np.array_equal(np.broadcast_to(s[idx], s.shape), s):
            return "axis", ax, None, lambda a, ax=ax: _line(a, ax)
    for ax in range(s.ndim):
        changes = np.nonzero(np.any(np.diff(s, axis=ax) != 0, axis=tuple(d for d in range(s.ndim) if d != ax)))[0]
        if changes.size == 0:
            continue
        b = int(np.gcd.reduce(changes + 1))
        if b <= 1:
            continue
        compact = np.take(s, np.arange(0, s.shape[ax], b), axis=ax)
        if np.array_equal(np.take(np.repeat(compact, b, axis=ax), np.arange(s.shape[ax]), axis=ax), s):
            return "block", ax, b, lambda a, ax=ax, b=b: np.take(a, np.arange(0, a.shape[ax], b), axis=ax)
    return None


def _line(a: np.ndarray, ax: int) -> np.ndarray:
    idx = tuple(slice(None) if d == ax else 0 for d in range(a.ndim))
    return np.ascontiguousarray(a[idx])


# --- initializers --------------------------------------------------------------------------------------------------
def storage_type(kind: str, qmin: int, qmax: int, opset: int, label: str) -> int:
    """The ONNX element type that holds codes in ``[qmin, qmax]`` at ``opset``."""
    if kind in FLOAT_MARKERS:
        fmt = element_format(FLOAT_MARKERS[kind])
        need = cast(int, fmt.onnx_opset)  # float formats have an ONNX type and opset
        if opset < need:
            raise OpsetTooLow(f"{label}: {fmt.onnx_type} weights need opset >= {need}, got opset {opset}",
                              need)  # fmt: skip
        return getattr(TensorProto, cast(str, fmt.onnx_type))
    c = smallest_code_type(qmin, qmax, [n for n in ONNX_WEIGHT_TYPES if CODE_TYPES[n].onnx_opset <= opset])
    if c is not None:
        return getattr(TensorProto, c.onnx_type)
    bits = math.ceil(math.log2(qmax - qmin + 1))
    raise OpsetTooLow(
        f"{label}: integer codes in [{qmin}, {qmax}] ({bits} bits) have no ONNX storage type at "
        f"opset {opset}; 16-bit codes need opset >= 21",
        21,
    )


def pack_4bit(values: np.ndarray) -> bytes:
    """Pack 4-bit codes two per byte, the first element in the low nibble (ONNX INT4/UINT4 layout)."""
    flat = (np.asarray(values).reshape(-1).astype(np.int64) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()


def make_tensor(name: str, values: np.ndarray, elem_type: int) -> onnx.TensorProto:
    """An initializer of ``elem_type`` holding ``values`` (codes, or float32 values the float type represents)."""
    values = np.asarray(values)
    t = TensorProto(name=name, data_type=elem_type, dims=list(values.shape))
    if elem_type in (TensorProto.INT4, TensorProto.UINT4):
        t.raw_data = pack_4bit(values)
    elif elem_type == TensorProto.FLOAT4E2M1:  # E2M1 bit patterns, two per byte (the INT4 nibble order)
        t.raw_data = pack_4bit(e2m1_codes(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))).numpy())
    elif elem_type in _FLOAT8:
        v = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        t.raw_data = v.to(_FLOAT8[elem_type]).view(torch.uint8).numpy().tobytes()
    else:
        t.raw_data = np.ascontiguousarray(values.astype(_NP[elem_type])).tobytes()
    return t


#: ``scale_source(compact, expand) -> (scale tensor name, nodes, report entry) or None``: where the scales come from
ScaleSource = Callable[[Callable, Callable], "tuple[str, list[onnx.NodeProto], dict] | None"]


def emit(
    g: Graph, fw: FoldedWeight, out: str, opset: int, label: str, scale_source: ScaleSource | None = None
) -> tuple[list[onnx.NodeProto], dict]:
    """The DequantizeLinear node(s) producing ``out`` from new initializers, and a description for the report.

    ``scale_source`` may supply the compact scale tensor (e.g. a DequantizeLinear of quantized block scales); it is
    given the functions that compact an element-wise array and expand it back. None (or it returning None): the
    scales are a float32 initializer."""
    gran = granularity(fw.scale)
    if gran is None:
        raise ValueError(
            f"{label}: the weight scales of shape {fw.scale.shape} vary along several axes in a way "
            "ONNX DequantizeLinear cannot express (per tensor, one axis, or blocks along one axis)"
        )
    kind, axis, block, compact = gran
    if kind != "tensor" and opset < 13:
        raise OpsetTooLow(f"{label}: per-channel weights need opset >= 13, got opset {opset}", 13)
    if kind == "block" and opset < 21:
        raise OpsetTooLow(
            f"{label}: block-quantized weights need opset >= 21 (DequantizeLinear block_size), got opset {opset}", 21
        )
    zp_c = compact(fw.zero_point)
    scale_c = compact(fw.scale).astype(np.float32)
    if not np.array_equal(_expand(zp_c, fw.zero_point.shape, kind, axis, block), fw.zero_point):
        raise ValueError(f"{label}: zero points do not follow the scales' granularity")
    elem = storage_type(fw.kind, fw.qmin, fw.qmax, opset, label)
    base = label.replace("/", ".")
    codes = g.add_init(f"{base}.q", make_tensor("q", fw.codes, elem))
    sourced = None if scale_source is None else scale_source(compact, lambda a: _expand(a, fw.codes.shape, *gran[:3]))
    pre: list[onnx.NodeProto] = []
    if sourced is None:
        scale = g.add_init(f"{base}.scale", np.asarray(scale_c, dtype=np.float32))
    else:
        scale, pre, scale_info = sourced
    inputs = [codes, scale]
    if fw.kind in FLOAT_MARKERS or np.any(zp_c != 0):  # an all-zero integer zero point is the default: left out
        inputs.append(g.add_init(f"{base}.zp", make_tensor("zp", zp_c, elem)))
    attrs = {}
    if kind in ("axis", "block"):
        attrs["axis"] = axis
    if kind == "block":
        attrs["block_size"] = block
    node = helper.make_node("DequantizeLinear", inputs, [out], name=g.fresh(f"{base}.DQ"), **attrs)
    info = {
        "granularity": kind,
        "axis": axis,
        "block_size": block,
        "dtype": TensorProto.DataType.Name(elem),
        "shape": tuple(fw.codes.shape),
    }
    if sourced is not None:
        info["scales"] = scale_info
    return pre + [node], info


def _expand(compact: np.ndarray, shape, kind, axis, block) -> np.ndarray:
    if kind == "tensor":
        return np.broadcast_to(compact, shape)
    if kind == "axis":
        view = [1] * len(shape)
        view[axis] = shape[axis]
        return np.broadcast_to(compact.reshape(view), shape)
    return np.take(np.repeat(compact, block, axis=axis), np.arange(shape[axis]), axis=axis)
