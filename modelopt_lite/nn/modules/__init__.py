"""Quantized counterparts of torch.nn modules (one file per family)."""

from ._base import QuantModuleMixin
from .quant_conv import Conv1d, Conv2d, Conv3d, QuantConv1d, QuantConv2d, QuantConv3d
from .quant_conv_transpose import (
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
)
from .quant_functional import Add, MatMul, QuantAdd, QuantMatMul
from .quant_linear import Linear, QuantLinear
from .quant_pooling import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
    QuantAvgPool1d,
    QuantAvgPool2d,
    QuantAvgPool3d,
    QuantMaxPool1d,
    QuantMaxPool2d,
    QuantMaxPool3d,
)
from .quant_rnn import CellQuantizers, GemmQuantizers, QuantLSTM, QuantLSTMCell

#: every quantized module class, by name
QUANT_MODULE_CLASSES = (
    QuantLinear,
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
    QuantMaxPool1d,
    QuantMaxPool2d,
    QuantMaxPool3d,
    QuantAvgPool1d,
    QuantAvgPool2d,
    QuantAvgPool3d,
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
    QuantLSTM,
    QuantLSTMCell,
    QuantMatMul,
    QuantAdd,
)

__all__ = [c.__name__ for c in QUANT_MODULE_CLASSES] + [
    "QUANT_MODULE_CLASSES",
    "QuantModuleMixin",
    "MatMul",
    "Add",
    "GemmQuantizers",
    "CellQuantizers",
    "Linear",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
]
