"""``inspect_onnx``: what a Q/DQ ONNX file quantizes, and where TensorRT would fall back to higher precision.

For every QuantizeLinear / DequantizeLinear (standard or TensorRT's ``trt::TRT_FP8*``) it records the quantized
dtype and the granularity (per tensor, per channel = ``axis`` with a 1-D scale, block = ``block_size``). For every
compute op (Conv, ConvTranspose, MatMul, Gemm, and the element-wise Add/Sub/Mul/Div between activations) it checks
whether its data inputs come from a DequantizeLinear (looking through shape-only ops TensorRT propagates Q/DQ
through); those that do not are listed as running in float. A residual Add whose one input is a Conv/GEMM output
and whose other input is dequantized is fused into that layer by TensorRT and counts as quantized.

The report also carries a TensorRT-readiness section (:mod:`.trt_readiness`): per fusion pattern (attention
MatMuls, GEMM/MatMul with weights, Conv, residual Add) whether Q/DQ sits where TensorRT needs it, and the float
ops left by op type.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from .graph import attr
from .trt_readiness import TrtReadiness, check_readiness

#: ops with weights: every data input must be dequantized (inputs 0 and 1; bias excluded)
WEIGHTED_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
#: element-wise ops: inputs computed at run time should be dequantized (constants are fine)
ELEMENTWISE_OPS = ("Add", "Sub", "Mul", "Div")
_PASS_THROUGH = ("Cast", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity")
_Q_OPS = ("QuantizeLinear", "TRT_FP8QuantizeLinear")
_DQ_OPS = ("DequantizeLinear", "TRT_FP8DequantizeLinear")


@dataclass
class InspectReport:
    """Summary of an ONNX file's quantization (see :func:`inspect_onnx`)."""

    path: str
    opset: int
    file_size: int
    node_counts: dict[str, int]
    qdq: dict[str, int]  # "QuantizeLinear INT8 per-tensor" -> count
    unquantized: list[str] = field(default_factory=list)  # "Gemm '/fc/Gemm' input 0 (x)"
    compute_ops: int = 0
    quantized_ops: int = 0
    tensorrt: TrtReadiness | None = None

    @property
    def num_quantize(self) -> int:
        return sum(v for k, v in self.qdq.items() if k.split()[0] in _Q_OPS)

    @property
    def num_dequantize(self) -> int:
        return sum(v for k, v in self.qdq.items() if k.split()[0] in _DQ_OPS)

    def __str__(self) -> str:
        return self.format()

    def format(self, tensorrt: bool = True) -> str:
        """A printable multi-line summary (with the TensorRT-readiness section unless ``tensorrt=False``)."""
        lines = [
            f"{self.path}: opset {self.opset}, {self.file_size / 1024:.1f} KiB",
            "nodes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.node_counts.items())),
        ]
        lines.append("Q/DQ:")
        lines += [f"  {k:<48} {v}" for k, v in sorted(self.qdq.items())] or ["  (none)"]
        lines.append(f"compute ops fed by Q/DQ: {self.quantized_ops} of {self.compute_ops}")
        if self.unquantized:
            lines.append("inputs left in float (TensorRT would run these in higher precision):")
            lines += [f"  {u}" for u in self.unquantized]
        if tensorrt and self.tensorrt is not None:
            lines += self.tensorrt.format()
        return "\n".join(lines)


def _dtype_name(model_inits, node) -> str:
    if node.op_type.startswith("TRT_FP8"):
        return "FLOAT8E4M3FN"
    if len(node.input) > 2 and node.input[2] in model_inits:
        return TensorProto.DataType.Name(model_inits[node.input[2]].data_type)
    if node.op_type == "DequantizeLinear" and node.input[0] in model_inits:
        return TensorProto.DataType.Name(model_inits[node.input[0]].data_type)
    out_dtype = attr(node, "output_dtype", 0)
    if out_dtype:
        return TensorProto.DataType.Name(out_dtype)
    return "UINT8" if node.op_type == "QuantizeLinear" else "?"


def _granularity(node, inits) -> str:
    if attr(node, "block_size", 0):
        return f"block(axis={attr(node, 'axis', 1)}, size={attr(node, 'block_size')})"
    scale = inits.get(node.input[1]) if len(node.input) > 1 else None
    if scale is not None and len(scale.dims) == 1 and scale.dims[0] > 1:
        return f"per-channel(axis={attr(node, 'axis', 1)})"
    return "per-tensor"


def _dequantized(name, producers, inits, depth=0) -> bool:
    node = producers.get(name)
    if node is None or depth > 8:
        return False
    if node.op_type in _DQ_OPS:
        return True
    if node.op_type in _PASS_THROUGH:
        return _dequantized(node.input[0], producers, inits, depth + 1)
    return False


def _is_constant(name, producers, inits, depth=0) -> bool:
    node = producers.get(name)
    if node is not None and node.op_type in _PASS_THROUGH and depth < 8:  # e.g. an Identity of a shared bias
        return _is_constant(node.input[0], producers, inits, depth + 1)
    return name in inits or (node is not None and node.op_type == "Constant")


def inspect_onnx(path_or_model) -> InspectReport:
    """Inspect an ONNX file (path) or ModelProto: Q/DQ counts by dtype and granularity, float fallbacks."""
    if isinstance(path_or_model, onnx.ModelProto):
        model, path, size = path_or_model, "<model>", path_or_model.ByteSize()
    else:
        path = os.fspath(path_or_model)
        model, size = onnx.load(path), os.path.getsize(path)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    readiness = check_readiness(model)
    fused = {c.node for c in readiness.checks if c.status == "fused"}
    qdq: Counter = Counter()
    unquantized = []
    compute = quantized = 0
    for n in g.node:
        if n.op_type in _Q_OPS + _DQ_OPS:
            qdq[f"{n.op_type} {_dtype_name(inits, n)} {_granularity(n, inits)}"] += 1
        elif n.op_type in WEIGHTED_OPS + ELEMENTWISE_OPS and n.domain in ("", "ai.onnx"):
            if n.op_type in WEIGHTED_OPS:
                data = list(enumerate(n.input[:2]))
            else:
                data = [(i, x) for i, x in enumerate(n.input) if not _is_constant(x, producers, inits)]
                if len(data) < 2:  # x + constant (a bias add): TensorRT fuses it into the producer
                    continue
                if f"{n.op_type} {n.name or n.output[0]!r}" in fused:  # residual Add fused into its Conv/GEMM
                    compute += 1
                    quantized += 1
                    continue
            compute += 1
            missing = [(i, x) for i, x in data if x and not _dequantized(x, producers, inits)]
            if missing:
                unquantized += [f"{n.op_type} {n.name or n.output[0]!r} input {i} ({x})" for i, x in missing]
            else:
                quantized += 1
    counts = Counter(n.op_type for n in g.node)
    return InspectReport(path, opset, size, dict(counts), dict(qdq), unquantized, compute, quantized, readiness)
