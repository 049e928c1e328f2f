"""``modelopt_lite.nn`` (alias ``modelopt_lite.quant_nn``): TensorQuantizer and the quantized modules.

Quantized modules: ``QuantLinear``, ``QuantConv1d/2d/3d``, ``QuantConvTranspose1d/2d/3d``, ``QuantMaxPool1/2/3d``,
``QuantAvgPool1/2/3d``, ``QuantAdaptiveAvgPool1/2/3d``, ``QuantLSTM``, ``QuantLSTMCell``, ``QuantMatMul`` and
``QuantAdd`` (with the float helper modules ``MatMul`` and ``Add``). The short aliases ``Linear``, ``Conv2d``, ...
name the quantized classes, as in pytorch-quantization's ``quant_nn``.
"""

from . import modules as _modules
from .modules import *
from .sequential_quantizer import SequentialQuantizer
from .tensor_quantizer import TensorQuantizer

__all__ = ["SequentialQuantizer", "TensorQuantizer", *_modules.__all__]  # noqa: PLE0604
