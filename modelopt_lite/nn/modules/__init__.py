"""Quantized counterparts of torch.nn modules (one file per family), registered in ``QuantModuleRegistry``."""

from ._base import QuantModuleMixin
from ._input_only import QuantInputOnlyMixin
from ._registry import QuantModuleRegistry, QuantModuleRegistryCls
from .clip import Clip
from .quant_activations import LeakyReLU, QuantLeakyReLU
from .quant_add import QuantResidualAdd, ResidualAdd
from .quant_attention import ATTENTION_QUANTIZERS, AttentionQuantMode, QuantAttentionModule, quantized_sdpa
from .quant_attention_hf import register_attention_module
from .quant_conv import Conv1d, Conv2d, Conv3d, QuantConv1d, QuantConv2d, QuantConv3d
from .quant_conv1d_hf import find_hf_conv1d  # noqa: F401  (installs the registry finder of HF's Conv1D)
from .quant_conv_transpose import (
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
)
from .quant_dbrx_hf import find_hf_dbrx  # noqa: F401  (installs the registry finder of HF's DBRX experts)
from .quant_embedding import Embedding, QuantEmbedding
from .quant_functional import Add, MatMul, QuantAdd, QuantMatMul
from .quant_linear import Linear, QuantLinear
from .quant_lora_peft import find_peft_lora  # noqa: F401  (installs the registry finder of peft's LoRA Linear)
from .quant_mha import QuantMultiheadAttention, QuantNonDynamicallyQuantizableLinear
from .quant_norm import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    QuantBatchNorm1d,
    QuantBatchNorm2d,
    QuantBatchNorm3d,
    QuantInstanceNorm1d,
    QuantInstanceNorm2d,
    QuantInstanceNorm3d,
)
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
from .quant_residual_hf import QuantHFResidualOutputMixin
from .quant_rnn import (
    CellQuantizers,
    GemmQuantizers,
    QuantGRU,
    QuantGRUCell,
    QuantLSTM,
    QuantLSTMCell,
    QuantRNN,
    QuantRNNCell,
)
from .quant_transformer import QuantTransformerEncoder, QuantTransformerEncoderLayer

#: every quantized module class defined here (the registry maps float classes to them)
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
    QuantBatchNorm1d,
    QuantBatchNorm2d,
    QuantBatchNorm3d,
    QuantInstanceNorm1d,
    QuantInstanceNorm2d,
    QuantInstanceNorm3d,
    QuantLeakyReLU,
    QuantEmbedding,
    QuantLSTM,
    QuantLSTMCell,
    QuantGRU,
    QuantGRUCell,
    QuantRNN,
    QuantRNNCell,
    QuantMatMul,
    QuantAdd,
    QuantResidualAdd,
    QuantMultiheadAttention,
    QuantNonDynamicallyQuantizableLinear,
    QuantTransformerEncoderLayer,
    QuantTransformerEncoder,
)

__all__ = [c.__name__ for c in QUANT_MODULE_CLASSES] + [
    "QUANT_MODULE_CLASSES",
    "QuantModuleMixin",
    "QuantInputOnlyMixin",
    "QuantModuleRegistry",
    "QuantModuleRegistryCls",
    "ATTENTION_QUANTIZERS",
    "AttentionQuantMode",
    "QuantAttentionModule",
    "quantized_sdpa",
    "register_attention_module",
    "QuantHFResidualOutputMixin",
    "Clip",
    "MatMul",
    "Add",
    "ResidualAdd",
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
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LeakyReLU",
    "Embedding",
]
