"""Standard-ONNX nodes for NVFP4 and OCP MX quantizers (weights and activations); no custom ops.

Weights (constant inputs) are stored already quantized, one DequantizeLinear (or two) reading them:

- NVFP4: the E2M1 codes as a ``FLOAT4E2M1`` initializer (opset 23), the block scales as a ``FLOAT8E4M3FN``
  initializer of shape ``(..., nblocks)``, dequantized by the float32 global scale (``DequantizeLinear(s, gs)`` is
  ``s * gs``, the reference's ``ds``), feeding a blocked ``DequantizeLinear(codes, ds, axis=-1, block_size)``
  (``code * ds``, the reference's ``y``): bit-identical to :func:`~modelopt_lite.functional.microscaling.fake_nvfp4`.
- MX: the element codes as ``FLOAT8E4M3FN`` / ``FLOAT8E5M2`` / ``FLOAT4E2M1`` / ``INT8`` initializers and the shared
  scales as a ``FLOAT8E8M0`` initializer (opset 24: E8M0 as a DequantizeLinear scale) or, at opset 23, the same
  powers of two as float32 (exact). MXINT8 codes ``q`` mean ``q / 64``, so their scale is ``2**(k - 6)``.

Activations are quantized at run time with the same float32 operations as the reference, flattened to blocks of
``B`` along the last axis (``Reshape(x, [-1, K])``, a zero ``Pad`` up to a multiple of ``B``, ``Reshape(., [-1, B])``;
rank- and batch-agnostic, undone at the end):

- NVFP4: ``a = ReduceMax(Abs(xb))``, ``s = DQ(Q(a / d))`` with ``d = 6 * gs`` and an E4M3 QuantizeLinear of scale 1
  (the saturating rne cast), ``ds = s * gs``, ``v = xb / ds`` (``Where`` keeps dead blocks at 0), ``q = DQ(Q(v))`` with
  a ``FLOAT4E2M1`` QuantizeLinear of scale 1, ``y = Where(dead, 0, q * ds)``.
- MX: ``p = Cast(Cast(a, FLOAT8E8M0, round_mode="down"), FLOAT)`` is ``2**floor_log2(a)`` exactly (opset 24); the
  shared scale ``X = p / 2**emax`` (``* 2`` more for ``rounding="rceil"`` where ``a / p`` exceeds the element's
  maximum significand), kept within ``[2**-127, 2**127]``; ``v = xb / X``, element rounding by a QuantizeLinear of
  scale 1 (INT8: scale 1/64 after a Clip to +-127/64), ``y = DQ(.) * X``.

ONNX Runtime 1.32's CPU provider implements neither FLOAT4E2M1 nor FLOAT8E8M0: these graphs are checked with
``onnx.reference.ReferenceEvaluator`` (the executable reference where ORT lacks a type).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from ..functional import microscaling as mx
from .graph import Graph, OpsetTooLow
from .weights import pack_4bit

#: the first opset whose Q/DQ take FLOAT4E2M1 (and a scale type different from the input's)
FP4_OPSET = 23
#: the first opset whose DequantizeLinear takes FLOAT8E8M0 scales and whose Cast has ``round_mode``
E8M0_OPSET = 24

#: ONNX element type of each MX element's codes
MX_CODE_TYPES = {
    "e4m3": TensorProto.FLOAT8E4M3FN,
    "e5m2": TensorProto.FLOAT8E5M2,
    "e2m1": TensorProto.FLOAT4E2M1,
    "int8": TensorProto.INT8,
}


def _need(opset: int, required: int, label: str, what: str) -> None:
    if opset < required:
        raise OpsetTooLow(f"{label}: {what} need opset >= {required}, got opset {opset}", required)


# --- initializers --------------------------------------------------------------------------------------------------
def _tensor(name: str, codes: torch.Tensor, elem_type: int) -> onnx.TensorProto:
    """An initializer of ``elem_type`` from codes as :mod:`~modelopt_lite.functional.microscaling` returns them
    (E2M1: uint8 bit patterns; E4M3/E5M2: float8 tensors; INT8: int8; E8M0: uint8 biased exponents)."""
    t = TensorProto(name=name, data_type=elem_type, dims=list(codes.shape))
    c = codes.detach().cpu().contiguous()
    if elem_type == TensorProto.FLOAT4E2M1:
        t.raw_data = pack_4bit(c.numpy())  # FP4 codes: the INT4 nibble order
    else:
        t.raw_data = (c.view(torch.uint8) if c.is_floating_point() else c).numpy().tobytes()
    return t


def nvfp4_weight(
    g: Graph,
    w: torch.Tensor,
    global_scale: float,
    block: int,
    out: str,
    opset: int,
    label: str,
    block_amax: torch.Tensor | None = None,
) -> tuple[list[onnx.NodeProto], dict]:
    """Nodes producing ``out`` = the NVFP4 fake-quantized constant ``w`` (see the module docstring); ``block_amax``:
    static NVFP4's stored block amaxes (None: each block's own max |w|)."""
    _need(opset, FP4_OPSET, label, "FP4 (FLOAT4E2M1) weights")
    gs = torch.tensor(global_scale, dtype=torch.float32)
    if block_amax is not None:
        block_amax = block_amax.reshape(*w.shape[:-1], -1)  # as the op received it (ModelOpt's flat layout reshaped)
    codes, scales = mx.quantize_nvfp4(w.float(), gs, block, block_amax)
    base = label.replace("/", ".")
    c = g.add_init(f"{base}.q", _tensor("q", codes, TensorProto.FLOAT4E2M1))
    s = g.add_init(f"{base}.block_scale", _tensor("s", scales, TensorProto.FLOAT8E4M3FN))
    gsn = g.add_init(f"{base}.global_scale", np.asarray(gs.item(), dtype=np.float32))
    ds = g.fresh(f"{base}.scale")
    nodes = [
        helper.make_node("DequantizeLinear", [s, gsn], [ds], name=g.fresh(f"{base}.scale_DQ")),
        helper.make_node("DequantizeLinear", [c, ds], [out], name=g.fresh(f"{base}.DQ"), axis=-1, block_size=block),
    ]
    info = {"granularity": "block", "axis": -1, "block_size": block, "dtype": "FLOAT4E2M1", "shape": tuple(w.shape)}
    info["scales"] = {"dtype": "FLOAT8E4M3FN", "global_scale": float(gs)}
    return nodes, info


def mx_weight(
    g: Graph, w: torch.Tensor, elem: str, block: int, rounding: str, out: str, opset: int, label: str
) -> tuple[list[onnx.NodeProto], dict]:
    """Nodes producing ``out`` = the MX fake-quantized constant ``w`` (see the module docstring)."""
    code_type = MX_CODE_TYPES[elem]
    _need(opset, FP4_OPSET if code_type == TensorProto.FLOAT4E2M1 else 21, label, f"MX ({elem}) weights")
    codes, e8 = mx.quantize_mx(w.float(), elem, block, rounding)
    k = e8.to(torch.int32) - mx.E8M0_BIAS
    if elem == "int8":
        k = k - 6  # q / 64 * 2**k
    base = label.replace("/", ".")
    c = g.add_init(f"{base}.q", _tensor("q", codes, code_type))
    if opset >= E8M0_OPSET and bool((k >= mx.E8M0_MIN_EXP).all()):
        s = g.add_init(f"{base}.scale", _tensor("s", (k + mx.E8M0_BIAS).to(torch.uint8), TensorProto.FLOAT8E8M0))
        scale_type = "FLOAT8E8M0"
    else:  # the same powers of two as float32 (2**-133 .. 2**127 are exact float32 values)
        s = g.add_init(f"{base}.scale", torch.ldexp(torch.ones_like(k, dtype=torch.float32), k).numpy())
        scale_type = "FLOAT"
    attrs: dict[str, Any] = {"axis": -1, "block_size": block}
    if opset >= FP4_OPSET:
        attrs["output_dtype"] = TensorProto.FLOAT
    nodes = [helper.make_node("DequantizeLinear", [c, s], [out], name=g.fresh(f"{base}.DQ"), **attrs)]
    info = {
        "granularity": "block",
        "axis": -1,
        "block_size": block,
        "dtype": TensorProto.DataType.Name(code_type),
        "shape": tuple(w.shape),
        "scales": {"dtype": scale_type, "rounding": rounding},
    }
    return nodes, info


# --- activations ---------------------------------------------------------------------------------------------------
class _Builder:
    """Appends nodes with fresh names under one label."""

    def __init__(self, g: Graph, label: str):
        self.g, self.base = g, label.replace("/", ".")
        self.nodes: list[onnx.NodeProto] = []

    def const(self, name: str, value, dtype=np.float32) -> str:
        return self.g.add_init(f"{self.base}.{name}", np.asarray(value, dtype=dtype))

    def zero(self, elem_type: int) -> str:
        """A scalar zero point of ``elem_type`` (code 0 is +0 in every type used here)."""
        t = TensorProto(name="zp", data_type=elem_type, dims=[], raw_data=b"\x00")  # one byte holds each type's 0
        return self.g.add_init(f"{self.base}.zp", t)

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.g.fresh(f"{self.base}.{op_type}")
        self.nodes.append(
            helper.make_node(op_type, inputs, [out], name=self.g.fresh(f"{self.base}.{op_type}"), **attrs)
        )
        return out

    def qdq(self, v: str, scale: str, elem_type: int) -> str:
        """``DQ(Q(v, scale, zero of elem_type))``: the saturating rne cast of ``v / scale`` onto the element grid."""
        zp = self.zero(elem_type)
        return self.op("DequantizeLinear", [self.op("QuantizeLinear", [v, scale, zp]), scale, zp])


def _blocked(b: _Builder, x: str, block: int) -> tuple[str, Callable[[str, str], None]]:
    """``xb`` of shape ``(-1, block)`` (zero-padded along the last axis) and the function that undoes it."""
    shape = b.op("Shape", [x])
    k = b.op("Shape", [x], start=-1)
    minus1 = b.const("minus_one", [-1], np.int64)
    bsz = b.const("block", [block], np.int64)
    x2 = b.op("Reshape", [x, b.op("Concat", [minus1, k], axis=0)])
    pad = b.op("Mod", [b.op("Sub", [bsz, b.op("Mod", [k, bsz])]), bsz])
    zeros3 = b.const("zeros3", [0, 0, 0], np.int64)
    xp = b.op("Pad", [x2, b.op("Concat", [zeros3, pad], axis=0)])
    xb = b.op("Reshape", [xp, b.op("Concat", [minus1, bsz], axis=0)])

    def undo(yb: str, out: str) -> None:
        padded = b.op("Reshape", [yb, b.op("Shape", [xp])])
        zero1 = b.const("zero1", [0], np.int64)
        one1 = b.const("one1", [1], np.int64)
        sliced = b.op("Slice", [padded, zero1, k, one1])
        b.op("Reshape", [sliced, shape], out)

    return xb, undo


def nvfp4_activation(
    g: Graph, x: str, out: str, global_scale: float, block: int, opset: int, label: str
) -> tuple[list[onnx.NodeProto], dict]:
    """Run-time NVFP4 quantization of ``x`` into ``out`` (static global scale; see the module docstring)."""
    _need(opset, FP4_OPSET, label, "FP4 (FLOAT4E2M1) activations")
    b = _Builder(g, label)
    xb, undo = _blocked(b, x, block)
    gs = np.float32(global_scale)
    one = b.const("one", 1.0)
    zero = b.const("zero", 0.0)
    if gs == 0:  # a dead tensor: zeros of x's shape
        b.op("Mul", [x, zero], out)
        return b.nodes, {"granularity": "block", "block_size": block, "dtype": "FLOAT4E2M1", "dead": True}
    d = b.const("d", np.float32(mx.E2M1_MAX) * gs)  # 6 * gs: one float32 multiply, as the reference
    a = b.op("ReduceMax", [b.op("Abs", [xb]), b.const("axes", [-1], np.int64)], keepdims=1)
    s = b.qdq(b.op("Div", [a, d]), one, TensorProto.FLOAT8E4M3FN)
    ds = b.op("Mul", [s, b.const("global_scale", gs)])
    dead = b.op("Equal", [ds, zero])
    v = b.op("Div", [xb, b.op("Where", [dead, one, ds])])
    q = b.qdq(v, one, TensorProto.FLOAT4E2M1)
    yb = b.op("Where", [dead, zero, b.op("Mul", [q, ds])])
    undo(yb, out)
    return b.nodes, {"granularity": "block", "block_size": block, "dtype": "FLOAT4E2M1", "scales": "FLOAT8E4M3FN"}


def mx_activation(
    g: Graph, x: str, out: str, elem: str, block: int, rounding: str, opset: int, label: str
) -> tuple[list[onnx.NodeProto], dict]:
    """Run-time MX quantization of ``x`` into ``out`` (see the module docstring)."""
    _need(opset, E8M0_OPSET, label, f"MX ({elem}) activations (E8M0 Cast)")
    e = mx.MX_ELEMENTS[elem]
    b = _Builder(g, label)
    xb, undo = _blocked(b, x, block)
    a = b.op("ReduceMax", [b.op("Abs", [xb]), b.const("axes", [-1], np.int64)], keepdims=1)
    p = b.op("Cast", [b.op("Cast", [a], to=TensorProto.FLOAT8E8M0, round_mode="down")], to=TensorProto.FLOAT)
    scale = b.op("Mul", [p, b.const("inv_emax", np.ldexp(np.float32(1), -e.emax))])
    if rounding == "rceil":
        over = b.op("Greater", [b.op("Div", [a, p]), b.const("max_significand", e.max_significand)])
        scale = b.op("Mul", [scale, b.op("Where", [over, b.const("two", 2.0), b.const("one_r", 1.0)])])
    scale = b.op("Max", [scale, b.const("min_scale", np.ldexp(np.float32(1), mx.E8M0_MIN_EXP))])
    v = b.op("Div", [xb, scale])
    if elem == "int8":
        lim = np.float32(127.0 / 64.0)
        v = b.op("Clip", [v, b.const("lo", -lim), b.const("hi", lim)])
        q = b.qdq(v, b.const("step", np.float32(1.0 / 64.0)), TensorProto.INT8)
    else:
        q = b.qdq(v, b.const("one", 1.0), MX_CODE_TYPES[elem])
    undo(b.op("Mul", [q, scale]), out)
    info = {"granularity": "block", "block_size": block, "dtype": TensorProto.DataType.Name(MX_CODE_TYPES[elem])}
    info["scales"] = {"dtype": "FLOAT8E8M0 (computed)", "rounding": rounding}
    return b.nodes, info
