"""ONNX export of fake-quantized models as standard QuantizeLinear/DequantizeLinear graphs.

- :func:`export_onnx` writes a TensorRT-style (or ONNX-Runtime-fusable) Q/DQ file whose weights are stored already
  quantized, and returns an :class:`ExportReport`.
- :func:`inspect_onnx` summarizes any Q/DQ file (counts, dtypes, granularity, ops left in float).
"""

from .export import ExportReport, export_onnx
from .inspect import InspectReport, inspect_onnx

__all__ = ["ExportReport", "InspectReport", "export_onnx", "inspect_onnx"]
