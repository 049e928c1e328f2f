"""Weight algorithms that transform a quantized model before or while it is calibrated (ModelOpt's ``model_calib``
split): each registers itself by name in :mod:`modelopt_lite.conversion.algorithm_registry`, so a config's
``"algorithm": {"method": NAME, ...}`` (alone or in a list) can name it. Importing this package registers them.
"""

from . import svdquant  # noqa: F401  (registers "svdquant")
from .svdquant import add_lowrank, svd_factors
from .svdquant_presets import INT4_SVDQUANT_CFG, NVFP4_SVDQUANT_DEFAULT_CFG, SVDQUANT_PRESETS

__all__ = ["INT4_SVDQUANT_CFG", "NVFP4_SVDQUANT_DEFAULT_CFG", "SVDQUANT_PRESETS", "add_lowrank", "svd_factors"]
