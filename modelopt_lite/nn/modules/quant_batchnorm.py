"""ModelOpt's module path for the quantized batch norms (``modelopt.torch.quantization.nn.modules.quant_batchnorm``):
``QuantBatchNorm1d/2d/3d``, defined in :mod:`.quant_norm`."""

from __future__ import annotations

from .quant_norm import QuantBatchNorm1d, QuantBatchNorm2d, QuantBatchNorm3d

__all__ = ["QuantBatchNorm1d", "QuantBatchNorm2d", "QuantBatchNorm3d"]
