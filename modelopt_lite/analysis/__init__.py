"""Quantization analysis: error metrics, model size, layer comparison, sensitivity, summaries, plots.

- :func:`calculate_quantization_error`, :func:`calculate_model_size` (:mod:`.metrics`)
- :func:`compare_models` (:mod:`.compare`): per-layer error of a quantized model against its float original
- :func:`sensitivity`, :func:`auto_skip` (:mod:`.sensitivity`): rank layers, leave the most sensitive in float
- :func:`print_quantization_summary` (:mod:`.summary`)
- :class:`Int8Quantizer` (:mod:`.int8_quantizer`): a standalone calibrate/quantize/dequantize helper
- plots (:mod:`.plots`, needs matplotlib): :func:`plot_calibration_histogram`, :func:`plot_layer_errors`,
  :func:`plot_sensitivity`
"""

from .int8_quantizer import Int8Quantizer
from .layer_error import compare_models, format_rows
from .metrics import (
    calculate_model_size,
    calculate_quantization_error,
    state_dict_bytes,
)
from .plots import (
    calibration_amaxes,
    plot_calibration_histogram,
    plot_layer_errors,
    plot_sensitivity,
)
from .sensitivity import AutoSkipReport, SensitivityReport, auto_skip, sensitivity
from .tensor_summary import print_quantization_summary

__all__ = [
    "AutoSkipReport",
    "Int8Quantizer",
    "SensitivityReport",
    "auto_skip",
    "calculate_model_size",
    "calculate_quantization_error",
    "calibration_amaxes",
    "compare_models",
    "format_rows",
    "plot_calibration_histogram",
    "plot_layer_errors",
    "plot_sensitivity",
    "print_quantization_summary",
    "sensitivity",
    "state_dict_bytes",
]
