"""``modelopt_lite.nn`` (alias ``modelopt_lite.quant_nn``): TensorQuantizer, the quantized modules, their registry.

Quantized modules: ``QuantLinear``, ``QuantConv1d/2d/3d``, ``QuantConvTranspose1d/2d/3d``, ``QuantMaxPool1/2/3d``,
``QuantAvgPool1/2/3d``, ``QuantAdaptiveAvgPool1/2/3d``, ``QuantBatchNorm1/2/3d``, ``QuantInstanceNorm1/2/3d``,
``QuantLeakyReLU``, ``QuantEmbedding``, ``QuantLSTM``/``QuantGRU``/``QuantRNN`` and their cells, ``QuantMatMul`` and
``QuantAdd`` (with the float helper modules ``MatMul`` and ``Add``), ``QuantResidualAdd`` (``ResidualAdd``: the
skip branch quantized, as TensorRT fuses residual adds); ``Clip`` and :mod:`.functional` (``clip``) as in
pytorch-quantization. The short aliases ``Linear``, ``Conv2d``, ... name the quantized classes, as in
pytorch-quantization's ``quant_nn``. ``QuantModuleRegistry`` maps each float class to its quantized class.
``QuantizerAttributeConfig`` is ModelOpt's descriptor with its other quantizer settings (``bias``, ...).
"""

from . import functional
from . import modules as _modules
from ._quantizer_config import QuantizerAttributeConfig
from .modules import *
from .sequential_quantizer import SequentialQuantizer
from .tensor_quantizer import TensorQuantizer

__all__ = ["QuantizerAttributeConfig", "SequentialQuantizer", "TensorQuantizer", "functional", *_modules.__all__]  # noqa: PLE0604
