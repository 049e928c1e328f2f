"""``QuantConvTranspose1d/2d/3d``: transposed convolution of the quantized input with the quantized weight.

Per-channel weight axis: **0**. A ``ConvTranspose`` weight is ``(in_channels, out_channels / groups, *k)``, so
axis 0 gives one scale per *input* channel. This is the axis TensorRT's deconvolution kernels support:
TensorRT treats a deconvolution as the backward pass of a convolution, whose per-output-channel weight scales
become per-input-channel scales of the deconvolution, and its maintainers state that per-output-channel
(axis 1) quantization of ConvTranspose is not supported (NVIDIA/TensorRT issues #1694, #1699, #2380: axis 1
gives wrong INT8 engines). Axis 0 is also well defined for ``groups > 1`` (axis 1 has only ``out / groups``
entries shared across groups). ONNX Runtime's QDQ path accepts any axis, so axis 0 costs nothing there; pass
``quant_desc_weight=QuantDescriptor(axis=1)`` for per-output-channel weights on runtimes that prefer it (ONNX
Runtime's own quantizer uses axis 1).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ...descriptor import (
    QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL,
    QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL,
)
from ._base import QuantModuleMixin

_FUNCS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _QuantConvTransposeNd(QuantModuleMixin):
    """Shared body: ``output_quantizer(conv_transpose(input_quantizer(x), weight_quantizer(W), b, ...))``.

    ``forward(input, output_size=None)`` as in torch. Only ``padding_mode="zeros"`` (as in torch).
    """

    _spatial: int

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def forward(self, input, output_size=None):
        if self.padding_mode != "zeros":
            raise ValueError(f"Only 'zeros' padding mode is supported for {type(self).__name__}")
        output_padding = self._output_padding(
            input, output_size, self.stride, self.padding, self.kernel_size, self._spatial, self.dilation
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


class QuantConvTranspose1d(_QuantConvTransposeNd, nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` with quantized input and weight (weight per input channel, axis 0)."""

    default_quant_desc_weight = QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL
    _float_cls = nn.ConvTranspose1d
    _spatial = 1


class QuantConvTranspose2d(_QuantConvTransposeNd, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` with quantized input and weight (weight per input channel, axis 0)."""

    default_quant_desc_weight = QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL
    _float_cls = nn.ConvTranspose2d
    _spatial = 2


class QuantConvTranspose3d(_QuantConvTransposeNd, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` with quantized input and weight (weight per input channel, axis 0)."""

    default_quant_desc_weight = QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL
    _float_cls = nn.ConvTranspose3d
    _spatial = 3


ConvTranspose1d, ConvTranspose2d, ConvTranspose3d = QuantConvTranspose1d, QuantConvTranspose2d, QuantConvTranspose3d
