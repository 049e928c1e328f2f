"""``QuantConvTranspose1d/2d/3d``: transposed convolution of the quantized input with the quantized weight.

Per-channel weight axis: **1**, the output-channel axis. A ``ConvTranspose`` weight is shaped
``(in_channels, out_channels / groups, *k)``, so axis 1 gives one scale per output channel (shared by the groups
when ``groups > 1``), as the peers' ``QUANT_DESC_8BIT_CONVTRANSPOSE{1,2,3}D_WEIGHT_PER_CHANNEL`` constants
(axis=1 in pytorch-quantization and ModelOpt) and ONNX Runtime's own quantizer do. Some TensorRT versions only
support per-*input*-channel deconvolution weights (NVIDIA/TensorRT #1694, #2380): pass
``quant_desc_weight=QuantDescriptor(axis=0)`` (or a config rule) for those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from ...descriptor import QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL
from ._base import QuantModuleMixin, reject_unused_keys
from ._registry import QuantModuleRegistry

if TYPE_CHECKING:
    from torch.nn.modules.conv import _ConvTransposeNd as _ConvTransposeTyping
else:
    _ConvTransposeTyping = object

#: the default weight descriptor of every QuantConvTransposeNd: 8-bit, one amax per output channel (axis 1; the
#: 1d/2d/3d constants of modelopt_lite.descriptor are equal)
QUANT_DESC_8BIT_CONVTRANSPOSE_WEIGHT_PER_OUTPUT_CHANNEL = QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL

_FUNCS: dict[int, Callable[..., torch.Tensor]] = {
    1: F.conv_transpose1d,
    2: F.conv_transpose2d,
    3: F.conv_transpose3d,
}


class _QuantConvTransposeNd(QuantModuleMixin, _ConvTransposeTyping):
    """Shared body: ``output_quantizer(conv_transpose(input_quantizer(x), weight_quantizer(W), b, ...))``.

    ``forward(input, output_size=None)`` as in torch. Only ``padding_mode="zeros"`` (as in torch).
    """

    default_quant_desc_weight = QUANT_DESC_8BIT_CONVTRANSPOSE_WEIGHT_PER_OUTPUT_CHANNEL
    _spatial: int

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
        reject_unused_keys(type(self), kwargs)
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def forward(self, input, output_size=None):
        if self.padding_mode != "zeros":
            raise ValueError(f"Only 'zeros' padding mode is supported for {type(self).__name__}")
        self._check_fake_quant()
        padding = cast("tuple[int, ...]", self.padding)  # always a tuple for ConvTranspose
        output_padding = self._output_padding(
            input,
            output_size,
            list(self.stride),
            list(padding),
            list(self.kernel_size),
            self._spatial,
            list(self.dilation),
        )
        out = _FUNCS[self._spatial](
            self.input_quantizer(input),
            self.weight_quantizer(self.weight),
            self.bias,
            self.stride,
            self.padding,
            output_padding,
            self.groups,
            self.dilation,
        )
        return self.output_quantizer(out)


@QuantModuleRegistry.register({nn.ConvTranspose1d: "nn.ConvTranspose1d"})
class QuantConvTranspose1d(_QuantConvTransposeNd, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` with quantized input and weight (weight per output channel, axis 1)."""

    _float_cls = nn.ConvTranspose1d
    _spatial = 1


@QuantModuleRegistry.register({nn.ConvTranspose2d: "nn.ConvTranspose2d"})
class QuantConvTranspose2d(_QuantConvTransposeNd, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` with quantized input and weight (weight per output channel, axis 1)."""

    _float_cls = nn.ConvTranspose2d
    _spatial = 2


@QuantModuleRegistry.register({nn.ConvTranspose3d: "nn.ConvTranspose3d"})
class QuantConvTranspose3d(_QuantConvTransposeNd, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` with quantized input and weight (weight per output channel, axis 1)."""

    _float_cls = nn.ConvTranspose3d
    _spatial = 3


ConvTranspose1d, ConvTranspose2d, ConvTranspose3d = QuantConvTranspose1d, QuantConvTranspose2d, QuantConvTranspose3d
