"""``QuantConv1d/2d/3d``: the convolution of the quantized input with the quantized weight (bias stays float).

``QuantConvTranspose1d/2d/3d`` (defined in :mod:`.quant_conv_transpose`) are importable from here too, where
ModelOpt keeps them (``modelopt.torch.quantization.nn.modules.quant_conv``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ...descriptor import (
    QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL,
)
from . import _integer_requant
from ._base import QuantModuleMixin, reject_unused_keys
from ._integer_requant import IntegerRequantLayer
from ._registry import QuantModuleRegistry
from .quant_conv_transpose import QuantConvTranspose1d, QuantConvTranspose2d, QuantConvTranspose3d

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.nn.modules.conv import _ConvNd as _ConvTyping
else:
    _ConvTyping = object


class _QuantConvNd(IntegerRequantLayer, QuantModuleMixin, _ConvTyping):
    """Shared body: ``output_quantizer(conv(input_quantizer(x), weight_quantizer(W), b))``.

    Accepts the float class's arguments plus ``quant_desc_input=`` / ``quant_desc_weight=`` (keyword only);
    anything else raises TypeError. Default weight quantization: per output channel (axis 0 of
    ``(out, in/groups, *k)``). Every ``padding_mode`` of the float module works (padding is applied to the
    quantized input, as the float module pads its input).
    """

    if TYPE_CHECKING:  # provided by the nn.ConvNd class it is combined with
        _conv_forward: Callable[..., torch.Tensor]

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
        reject_unused_keys(type(self), kwargs)
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def _float_forward(self, quantized_input):
        """The float path from the input quantizer's output on."""
        out = self._conv_forward(quantized_input, self.weight_quantizer(self.weight), self.bias)
        return self.output_quantizer(out)

    def _integer_product(self, codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(codes, weight_codes, None)

    def _integer_unfit(self) -> str | None:
        return None if self.padding_mode == "zeros" else f"padding_mode={self.padding_mode!r} (only 'zeros')"

    def forward(self, input):
        self._check_fake_quant()
        if _integer_requant.active(self, input):
            return _integer_requant.integer_forward(self, input, self._float_forward)
        return self._float_forward(self.input_quantizer(input))


@QuantModuleRegistry.register({nn.Conv1d: "nn.Conv1d"})
class QuantConv1d(_QuantConvNd, nn.Conv1d):
    """``nn.Conv1d`` with quantized input and weight (weight per output channel by default)."""

    default_quant_desc_weight = QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL
    _float_cls = nn.Conv1d


@QuantModuleRegistry.register({nn.Conv2d: "nn.Conv2d"})
class QuantConv2d(_QuantConvNd, nn.Conv2d):
    """``nn.Conv2d`` with quantized input and weight (weight per output channel by default)."""

    default_quant_desc_weight = QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL
    _float_cls = nn.Conv2d


@QuantModuleRegistry.register({nn.Conv3d: "nn.Conv3d"})
class QuantConv3d(_QuantConvNd, nn.Conv3d):
    """``nn.Conv3d`` with quantized input and weight (weight per output channel by default)."""

    default_quant_desc_weight = QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL
    _float_cls = nn.Conv3d


Conv1d, Conv2d, Conv3d = QuantConv1d, QuantConv2d, QuantConv3d

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantConvTranspose1d",
    "QuantConvTranspose2d",
    "QuantConvTranspose3d",
]
