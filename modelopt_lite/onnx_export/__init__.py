"""ONNX export of fake-quantized models as standard QuantizeLinear/DequantizeLinear graphs.

- :func:`export_onnx` writes a TensorRT-style (or ONNX-Runtime-fusable) Q/DQ file whose weights are stored already
  quantized, and returns an :class:`ExportReport`.
- :func:`inspect_onnx` summarizes any Q/DQ file (counts, dtypes, granularity, ops left in float).
- :func:`compare_with_onnxruntime` runs a model and its export side by side and shows, quantizer by quantizer,
  where ONNX Runtime and torch start to disagree.
"""

from .attention_check import AttentionMatMul, attention_matmuls, float_rounding_only
from .export import ExportReport, export_onnx
from .inspect import InspectReport, inspect_onnx
from .ort_divergence import DivergenceReport, QuantizerDiff, compare_with_onnxruntime

__all__ = [
    "AttentionMatMul",
    "attention_matmuls",
    "float_rounding_only",
    "DivergenceReport",
    "ExportReport",
    "InspectReport",
    "QuantizerDiff",
    "compare_with_onnxruntime",
    "export_onnx",
    "inspect_onnx",
]
