"""Quantized pooling: ``output_quantizer(pool(input_quantizer(x)))``; no weights.

Max pooling of a quantized tensor returns values that are already on the grid, so its output quantizer stays
disabled by default like every other. With ``return_indices=True`` the output quantizer applies to the values only.
"""

from __future__ import annotations

from torch import nn

from ._input_only import QuantInputOnlyMixin, make_input_only

_QuantPool = QuantInputOnlyMixin  # the shared body (kept under its old name)

QuantMaxPool1d = make_input_only(nn.MaxPool1d, __name__)
QuantMaxPool2d = make_input_only(nn.MaxPool2d, __name__)
QuantMaxPool3d = make_input_only(nn.MaxPool3d, __name__)
QuantAvgPool1d = make_input_only(nn.AvgPool1d, __name__)
QuantAvgPool2d = make_input_only(nn.AvgPool2d, __name__)
QuantAvgPool3d = make_input_only(nn.AvgPool3d, __name__)
QuantAdaptiveAvgPool1d = make_input_only(nn.AdaptiveAvgPool1d, __name__)
QuantAdaptiveAvgPool2d = make_input_only(nn.AdaptiveAvgPool2d, __name__)
QuantAdaptiveAvgPool3d = make_input_only(nn.AdaptiveAvgPool3d, __name__)

MaxPool1d, MaxPool2d, MaxPool3d = QuantMaxPool1d, QuantMaxPool2d, QuantMaxPool3d
AvgPool1d, AvgPool2d, AvgPool3d = QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d
AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = (
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
)
