"""ModelOpt's module path for the quantized instance norms (``modelopt.torch.quantization.nn.modules.
quant_instancenorm``): ``QuantInstanceNorm1d/2d/3d``, defined in :mod:`.quant_norm`."""

from __future__ import annotations

from .quant_norm import QuantInstanceNorm1d, QuantInstanceNorm2d, QuantInstanceNorm3d

__all__ = ["QuantInstanceNorm1d", "QuantInstanceNorm2d", "QuantInstanceNorm3d"]
