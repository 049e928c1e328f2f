"""Quantized pooling: ``output_quantizer(pool(input_quantizer(x)))``; no weights.

Max pooling of a quantized tensor returns values that are already on the grid, so its output quantizer stays
disabled by default like every other.
"""

from __future__ import annotations

from torch import nn

from ._base import QuantModuleMixin


class _QuantPool(QuantModuleMixin):
    """Shared body for pooling: accepts the float class's arguments plus ``quant_desc_input=``."""

    default_quant_desc_weight = None

    def __init__(self, *args, quant_desc_input=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input)

    def forward(self, input):
        return self._quant_output(super().forward(self.input_quantizer(input)))


def _make(float_cls):
    doc = f"``nn.{float_cls.__name__}`` with a quantized input (8-bit per tensor by default)."
    return type(
        f"Quant{float_cls.__name__}",
        (_QuantPool, float_cls),
        {"_float_cls": float_cls, "__doc__": doc, "__module__": __name__},
    )


QuantMaxPool1d = _make(nn.MaxPool1d)
QuantMaxPool2d = _make(nn.MaxPool2d)
QuantMaxPool3d = _make(nn.MaxPool3d)
QuantAvgPool1d = _make(nn.AvgPool1d)
QuantAvgPool2d = _make(nn.AvgPool2d)
QuantAvgPool3d = _make(nn.AvgPool3d)
QuantAdaptiveAvgPool1d = _make(nn.AdaptiveAvgPool1d)
QuantAdaptiveAvgPool2d = _make(nn.AdaptiveAvgPool2d)
QuantAdaptiveAvgPool3d = _make(nn.AdaptiveAvgPool3d)

MaxPool1d, MaxPool2d, MaxPool3d = QuantMaxPool1d, QuantMaxPool2d, QuantMaxPool3d
AvgPool1d, AvgPool2d, AvgPool3d = QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d
AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveAvgPool3d = (
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
)
