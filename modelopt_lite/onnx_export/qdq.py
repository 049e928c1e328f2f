"""QuantizeLinear -> DequantizeLinear pairs for activations (tensors computed at run time).

Exactness rules (each proven by ``tests/test_onnx_contract.py`` against ONNX Runtime):

- The Q output type is the smallest standard container of the grid ``[qmin, qmax]``: int8/uint8, or int16/uint16
  at opset >= 21. When the grid is narrower than the container (narrow-range signed, or fewer than 8 bits), the
  input is first clipped to ``[(qmin - zp) * s, (qmax - zp) * s]`` in float32. Division is monotonic and
  ``fl(fl(k * s) / s)`` rounds back to the integer ``k`` (|k| < 2**22), so ``Q(clip(x))`` equals
  ``clamp(rint(x / s), qmin, qmax)`` exactly: ONNX saturation never comes into play.
- E4M3 / E5M2 / E2M1: Q/DQ with a FLOAT8E4M3FN / FLOAT8E5M2 (opset 19) / FLOAT4E2M1 (opset 23) zero point and
  ``saturate=1`` (E4M3 also as TensorRT's custom ``trt::TRT_FP8QuantizeLinear``/``TRT_FP8DequantizeLinear`` when
  asked). ONNX Runtime 1.32's CPU provider has no FLOAT4E2M1 kernels (run those with onnx's ReferenceEvaluator).
- A dead slice (scale 0: amax <= 2**-24) outputs exact zeros in torch for every input (Inf and NaN included). No
  positive finite scale sends every float32 to code 0 (``3e38 / 2**126`` rounds to 4), so the input first goes
  through ``Where(live, x, 0)`` (``live`` a constant bool mask: a scalar ``False`` for a dead tensor, one entry per
  channel otherwise): the dead slices reach Q as +0 and come out of DQ as exact zeros, while the stored scale is
  :data:`DEAD_SCALE` (2**126, positive and finite, as TensorRT requires). Live values pass the Where unchanged.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..formats import ONNX_ACTIVATION_TYPES, element_format, smallest_code_type
from .graph import Graph, OpsetTooLow
from .symbolic import AFFINE_MARKER, FLOAT_MARKERS

#: scale exported for dead activation slices (behind the Where that zeroes them): finite and positive
DEAD_SCALE = np.float32(2.0**126)
TRT_DOMAIN = "trt"


def container(qmin: int, qmax: int, opset: int, label: str):
    """``(onnx type, numpy type, lo, hi)`` of the Q output holding the grid ``[qmin, qmax]``."""
    c = smallest_code_type(qmin, qmax, ONNX_ACTIVATION_TYPES)
    if c is None:
        raise ValueError(f"{label}: the activation grid [{qmin}, {qmax}] does not fit any ONNX quantized type")
    if opset < c.onnx_opset:
        bits = math.ceil(math.log2(qmax - qmin + 1))
        raise OpsetTooLow(
            f"{label}: a {bits}-bit activation grid [{qmin}, {qmax}] needs a 16-bit "
            f"QuantizeLinear (opset >= {c.onnx_opset}); opset {opset} has no ONNX representation for it",
            c.onnx_opset,
        )
    return getattr(TensorProto, c.onnx_type), c.numpy_dtype, c.lo, c.hi


def activation_axis(scale: np.ndarray, label: str):
    """``(axis or None, 1-D or scalar scale)`` of an activation scale traced with the input's rank."""
    if scale.size == 1:
        return None, scale.reshape(())
    dims = [d for d in range(scale.ndim) if scale.shape[d] > 1]
    if len(dims) != 1:
        raise ValueError(
            f"{label}: the activation scale of shape {tuple(scale.shape)} varies along dims {dims}; "
            "ONNX QuantizeLinear supports per-tensor or a single axis (block or multi-axis "
            "quantization of activations cannot be exported)"
        )
    return dims[0], scale.reshape(-1)


def emit(
    g: Graph,
    kind: str,
    x: str,
    out: str,
    scale: np.ndarray,
    zero_point,
    qmin: int,
    qmax: int,
    *,
    opset: int,
    target: str,
    fp8_custom_ops: bool,
    label: str,
) -> tuple[list[onnx.NodeProto], dict]:
    """Nodes computing ``out`` from ``x``, and a description for the report (granularity, dtype, notes)."""
    scale = np.asarray(scale, dtype=np.float32)
    base = label.replace("/", ".")
    axis, s = activation_axis(scale, label)
    if axis is not None and opset < 13:
        raise OpsetTooLow(f"{label}: per-channel quantization (axis) needs opset >= 13, got opset {opset}", 13)
    dead = s == 0
    notes = []
    pre: list[onnx.NodeProto] = []
    if dead.any():
        s = np.where(dead, DEAD_SCALE, s).astype(np.float32)
        what = "all of it" if dead.all() else f"{int(dead.sum())} of {dead.size} channels"
        notes.append(
            f"{label}: dead activation scale (amax <= 2**-24) for {what}: exported with scale 2**126 after a "
            "Where that sets those values to 0, so they dequantize to exact zeros for every input"
        )
        x, pre = _zero_dead(g, x, base, dead, axis, scale.ndim)
    info = {"granularity": "tensor" if axis is None else "axis", "axis": axis, "notes": notes}
    attrs = {} if axis is None else {"axis": axis}
    s_name = g.add_init(f"{base}.scale", s)
    if kind in FLOAT_MARKERS:
        fmt = element_format(FLOAT_MARKERS[kind])
        custom = fp8_custom_ops and fmt.is_e4m3  # TensorRT's custom FP8 ops are E4M3 only: the others stay standard
        need = cast(int, fmt.onnx_opset)  # float formats have an ONNX type and opset
        if opset < need and not custom:
            raise OpsetTooLow(
                f"{label}: {fmt.title} Q/DQ needs opset >= {need} ({fmt.onnx_type}), got opset {opset}",
                need,
            )
        if custom:
            if axis is not None:
                raise ValueError(f"{label}: trt::TRT_FP8QuantizeLinear supports per-tensor scales only")
            q = g.fresh(f"{base}.q")
            info["dtype"] = "FLOAT8E4M3FN(trt)"
            return pre + [
                helper.make_node(
                    "TRT_FP8QuantizeLinear",
                    [x, s_name],
                    [q],
                    domain=TRT_DOMAIN,
                    name=g.fresh(f"{base}.TRT_FP8QuantizeLinear"),
                ),
                helper.make_node(
                    "TRT_FP8DequantizeLinear",
                    [q, s_name],
                    [out],
                    domain=TRT_DOMAIN,
                    name=g.fresh(f"{base}.TRT_FP8DequantizeLinear"),
                ),
            ], info
        from .weights import make_tensor

        elem = getattr(TensorProto, cast(str, fmt.onnx_type))
        zp_name = g.add_init(f"{base}.zp", make_tensor("zp", np.zeros(s.shape, np.float32), elem))
        info["dtype"] = fmt.onnx_type
        return pre + _pair(g, x, out, base, s_name, zp_name, dict(attrs, saturate=1), attrs), info
    zp = np.zeros(s.shape, np.int64) if zero_point is None else np.asarray(zero_point).reshape(s.shape)
    zp = np.rint(zp).astype(np.int64)
    if kind == AFFINE_MARKER and target == "tensorrt" and np.any(zp != 0):
        raise ValueError(
            f"{label}: affine quantization needs a non-zero zero point, which TensorRT does not "
            "support; export with target='onnxruntime'"
        )
    elem, np_t, lo, hi = container(qmin, qmax, opset, label)
    info["dtype"] = TensorProto.DataType.Name(elem)
    zp_name = g.shared_zero(np_t) if zp.ndim == 0 and zp == 0 else g.add_init(f"{base}.zp", zp.astype(np_t))
    nodes = pre
    if (qmin, qmax) != (lo, hi):
        x, clip_nodes = _clip(g, x, base, s, zp, qmin, qmax, axis, scale.ndim)
        nodes += clip_nodes
        notes.append(
            f"{label}: grid [{qmin}, {qmax}] exported as {info['dtype']} Q/DQ after a Clip "
            f"(exact: {'narrow range' if qmin == -qmax else 'sub-range grid'})"
        )
    return nodes + _pair(g, x, out, base, s_name, zp_name, attrs, attrs), info


def _pair(g: Graph, x, out, base, s_name, zp_name, q_attrs, dq_attrs) -> list[onnx.NodeProto]:
    q = g.fresh(f"{base}.q")
    return [
        helper.make_node("QuantizeLinear", [x, s_name, zp_name], [q], name=g.fresh(f"{base}.Q"), **q_attrs),
        helper.make_node("DequantizeLinear", [q, s_name, zp_name], [out], name=g.fresh(f"{base}.DQ"), **dq_attrs),
    ]


def _zero_dead(g: Graph, x: str, base: str, dead: np.ndarray, axis, rank: int):
    """``Where(live, x, 0)``: +0 in the dead slices whatever x holds there (Inf and NaN included), x elsewhere."""
    if axis is None:
        live = np.array(False)
    else:
        view = [1] * rank
        view[axis] = -1
        live = np.logical_not(dead).reshape(view)
    live_n = g.add_init(f"{base}.live", live)
    zero_n = g.add_init(f"{base}.dead_zero", np.zeros((), np.float32))
    zeroed = g.fresh(f"{base}.live_only")
    return zeroed, [helper.make_node("Where", [live_n, x, zero_n], [zeroed], name=g.fresh(f"{base}.ZeroDead"))]


def _clip(g: Graph, x, out, s, zp, qmin, qmax, axis, rank):  # ``out``: a base for the new names
    with np.errstate(over="ignore"):
        lo = ((qmin - zp).astype(np.float32) * s).astype(np.float32)
        hi = ((qmax - zp).astype(np.float32) * s).astype(np.float32)
    dead = s == DEAD_SCALE
    lo, hi = np.where(dead, -np.inf, lo).astype(np.float32), np.where(dead, np.inf, hi).astype(np.float32)
    clipped = g.fresh(f"{out}.clipped")
    if axis is None:
        lo_n, hi_n = g.add_init(f"{out}.clip_min", lo.reshape(())), g.add_init(f"{out}.clip_max", hi.reshape(()))
        return clipped, [helper.make_node("Clip", [x, lo_n, hi_n], [clipped], name=g.fresh(f"{out}.Clip"))]
    view = [1] * rank
    view[axis] = -1
    lo_n, hi_n = g.add_init(f"{out}.clip_min", lo.reshape(view)), g.add_init(f"{out}.clip_max", hi.reshape(view))
    upper = g.fresh(f"{out}.clip_upper")
    return clipped, [
        helper.make_node("Min", [x, hi_n], [upper], name=g.fresh(f"{out}.Min")),
        helper.make_node("Max", [upper, lo_n], [clipped], name=g.fresh(f"{out}.Max")),
    ]
