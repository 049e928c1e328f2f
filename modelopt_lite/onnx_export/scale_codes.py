"""Double-quantized block scales (``block_sizes["scale_bits"]``) exported as standard ONNX.

In the traced graph the block scales of a weight are themselves the output of a fake-quant marker on a constant
(the raw per-block scales), followed by data-movement ops (Expand, Reshape, Slice, ...) up to the weight marker's
scale input. The post-pass folds that inner marker first (:mod:`.weights`: codes + DequantizeLinear); this module
then follows the inner codes, scale-of-scales and zero points along the same data-movement path (evaluating it with
those arrays in place of the inner DequantizeLinear's output), compacts them with the weight's own granularity and
writes

    DequantizeLinear(scale codes, scale-of-scales[, zp]) -> block scales -> DequantizeLinear(weight codes, ., axis,
    block_size)

so the file stores the quantized scales (UINT8 or FLOAT8E4M3FN codes), as the numerics contract asks, and every
runtime computes the same float32 block scales torch uses (``(code - zp) * scale_of_scale`` is one exact float32
product). A weight block whose double-quantized scale is 0 (dead: its codes are all 0) gets the scale code 1, so
every scale DequantizeLinear produces stays strictly positive while the block still dequantizes to exact zeros.
When the path is not pure data movement (the arrays do not reproduce the scales), the scales are written as float32
values (equal to torch's) instead, with a note.
"""

from __future__ import annotations

import numpy as np

from . import weights
from .graph import Graph
from .symbolic import FLOAT_MARKERS

#: ops that only move data: following the codes and the scales through them keeps code * scale == value
_DATA_MOVEMENT = {
    "Expand",
    "Reshape",
    "Slice",
    "Squeeze",
    "Unsqueeze",
    "Transpose",
    "Identity",
    "Flatten",
    "Concat",
    "Gather",
    "Tile",
    "Pad",
    "Cast",
}


def source(g: Graph, name: str, folded: dict) -> str | None:
    """The output of an already folded weight DequantizeLinear that ``name`` is computed from by data movement
    (following each op's data input), or None."""
    prod = g.producers()
    for _ in range(64):
        if name in folded:
            return name
        node = prod.get(name)
        if node is None or node.op_type not in _DATA_MOVEMENT or node.domain not in ("", "ai.onnx"):
            return None
        name = node.input[0]  # the data input; the others (shapes, indices, pads) are constants
    return None


def follow(g: Graph, name: str, src: str, inner: weights.FoldedWeight, value: np.ndarray) -> dict | None:
    """Arrays shaped like ``value`` (the constant at ``name``) holding, for every element, the inner codes,
    scale-of-scales and zero points it came from, or None when they do not reproduce ``value``."""
    out = {}
    for key, arr in (("codes", inner.codes), ("sscale", inner.scale), ("szp", inner.zero_point)):
        got = g.constants_with({src: np.asarray(arr, dtype=np.float32)}, [name]).get(name)
        if got is None or got.shape != value.shape:
            return None
        out[key] = got
    deq = _dequantize(out["codes"], out["sscale"], out["szp"])
    if not np.array_equal(deq, value.astype(np.float32)):
        return None
    out["value"] = value.astype(np.float32)
    return out


def _dequantize(codes, sscale, szp) -> np.ndarray:
    return ((codes.astype(np.float32) - szp.astype(np.float32)) * sscale.astype(np.float32)).astype(np.float32)


def scale_source(g: Graph, fw: weights.FoldedWeight, inner: weights.FoldedWeight, opset: int, label: str):
    """A :data:`weights.ScaleSource` writing the DequantizeLinear of the quantized block scales of ``fw``."""

    def make(compact, expand):
        ex = fw.extras
        parts = {k: compact(ex[k]) for k in ("codes", "sscale", "szp", "value")}
        if any(not np.array_equal(expand(parts[k]), ex[k]) for k in parts):
            return None  # the scale codes vary inside a weight block: no compact DequantizeLinear for them
        codes = np.where(parts["value"] == 0, _live_code(inner, parts["szp"]), parts["codes"])
        deq = _dequantize(codes, parts["sscale"], parts["szp"])
        if (deq <= 0).any() or not np.array_equal(np.where(parts["value"] == 0, deq, parts["value"]), deq):
            return None
        sfw = weights.FoldedWeight(
            codes, parts["sscale"].astype(np.float32), parts["szp"].astype(np.int64), inner.kind, inner.qmin, inner.qmax
        )
        name = g.fresh(f"{label.replace('/', '.')}.block_scales")
        nodes, info = weights.emit(g, sfw, name, opset, f"{label}.block_scales")
        return name, nodes, info

    return make


def _live_code(inner: weights.FoldedWeight, szp: np.ndarray):
    """The code one step above zero (1.0 for float codes), for weight blocks that are dead anyway."""
    if inner.kind in FLOAT_MARKERS:
        return np.ones_like(szp)
    return szp + 1  # a grid without it fails the positivity check of the caller (float32 scales then)


def note(label: str, info: dict | None) -> str:
    if info is None:
        return (
            f"{label}: double-quantized block scales exported as their float32 values (equal to torch's): the "
            "scale codes could not be laid out as one DequantizeLinear"
        )
    return (
        f"{label}: double-quantized block scales exported as a {info['dtype']} DequantizeLinear "
        f"({info['granularity']}) feeding the weight's DequantizeLinear"
    )
