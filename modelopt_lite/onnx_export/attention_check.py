"""Attention in an exported graph: which activation x activation MatMuls have Q/DQ on both inputs.

TensorRT fuses an INT8/FP8 attention only when both matmuls of it (``Q @ K^T`` and ``P @ V``) read
``DequantizeLinear`` outputs, possibly through layout ops (Transpose/Reshape/...). :func:`attention_matmuls` finds
the MatMuls whose two inputs are both activations (a weight MatMul reads an initializer or a constant, through its
``DequantizeLinear`` if quantized) and says, for each input, whether a DequantizeLinear feeds it.

:func:`float_rounding_only` states the per-node agreement rule for a :class:`~.ort_divergence.DivergenceReport`:
ORT and torch agree quantizer by quantizer up to the first that differs, and there the float input already differs
(float ops computed in another order) and the quantized values move by at most one step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnx

from .graph import Graph
from .ort_divergence import DivergenceReport

#: ops that only move or repeat values: a Q/DQ before them still feeds the MatMul
LAYOUT_OPS = frozenset({"Transpose", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Tile", "Flatten", "Identity"})
#: ops that take part of a tensor: a part of a (dequantized) weight is a (dequantized) weight, e.g. the Q/K/V rows of
#: ``nn.MultiheadAttention``'s packed in-projection weight in cross-attention
SLICE_OPS = frozenset({"Slice", "Split", "Gather"})


@dataclass
class AttentionMatMul:
    """One activation x activation MatMul: its name and, per input, whether a DequantizeLinear feeds it."""

    name: str
    inputs: tuple[str, str]
    quantized: tuple[bool, bool]

    @property
    def both_quantized(self) -> bool:
        return all(self.quantized)


def _source(tensor: str, prod: dict, constants: set, depth: int = 0) -> tuple[str, bool]:
    """``(kind, quantized)``: kind "constant" when ``tensor`` is a weight (through layout ops, slices of a weight and
    a DQ), else "activation"; quantized when a DequantizeLinear is met before any other op."""
    quantized = False
    seen: set[str] = set()
    while tensor not in seen:
        seen.add(tensor)
        if tensor in constants:
            return "constant", quantized
        node = prod.get(tensor)
        if node is None:
            return "activation", quantized
        if node.op_type == "Constant":
            return "constant", quantized
        if node.op_type in SLICE_OPS and depth < 4:  # a constant slice of a weight is a weight
            parts = [_source(i, prod, constants, depth + 1) for i in node.input if i]
            if all(kind == "constant" for kind, _ in parts):
                return "constant", quantized or parts[0][1]
            return "activation", quantized
        if node.op_type == "DequantizeLinear":
            quantized = True
        elif node.op_type not in LAYOUT_OPS:
            return "activation", quantized
        tensor = node.input[0]
    return "activation", quantized


def attention_matmuls(model) -> list[AttentionMatMul]:
    """The MatMuls of ``model`` (a path or ``onnx.ModelProto``) whose two inputs are activations, in graph order."""
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))
    g = Graph(proto)
    prod = g.producers()
    constants = set(g.inits)
    out = []
    for n in g.nodes:
        if n.op_type != "MatMul" or len(n.input) != 2:
            continue
        a, b = (_source(t, prod, constants) for t in n.input)
        if a[0] == "activation" and b[0] == "activation":
            out.append(AttentionMatMul(n.name, (n.input[0], n.input[1]), (a[1], b[1])))
    return out


def float_rounding_only(report: DivergenceReport, ulps: float = 1e-5) -> tuple[bool, str]:
    """``(ok, why)``: the per-node rule (module docstring). ``ulps`` bounds the float input difference where the
    first quantized values differ; there at most one value in a thousand may move, by at most one scale step (for
    FP8, one unit of the scale, which is one FP8 step for values of 2 to 4 scales). A first difference whose input
    is not exposed (see :mod:`.ort_divergence`) is accepted on those two counts alone, and ``why`` says so."""
    first = report.first_divergence
    if first is None:
        return True, "every quantizer agrees"
    idx = report.rows.index(first)
    for r in report.rows[:idx]:
        if r.input_max_diff is not None and r.input_max_diff > ulps:
            return False, f"{r.name}: input differs by {r.input_max_diff:.3g} > {ulps:g} before any value differs"
    if first.max_steps > 1.0 + 1e-5 or first.differing > max(1, first.elements // 1000):
        return False, (
            f"{first.name}: first difference is {first.differing} of {first.elements} value(s), up to "
            f"{first.max_steps:.3g} scale step(s): more than float rounding moves"
        )
    where = f"first difference at {first.name}: {first.differing} value(s) by <= 1 step"
    if first.input_max_diff is None:
        return True, where + " (its float input is not exposed)"
    if not 0 < first.input_max_diff <= ulps:
        return False, f"{first.name}: values differ while the float input differs by {first.input_max_diff:.3g}"
    return True, where + f", where the float input already differs by {first.input_max_diff:.3g}"
