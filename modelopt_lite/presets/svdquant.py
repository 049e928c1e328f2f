"""The SVDQuant presets: ModelOpt 0.47's ``NVFP4_SVDQUANT_DEFAULT_CFG`` (NVFP4 weights and activations, blocks of 16,
``{"method": "svdquant", "lowrank": 32}``) and an INT4 weight-only variant (blocks of 128, activations float).
See :mod:`modelopt_lite.algorithms.svdquant`.
"""

from __future__ import annotations

from .base import preset
from .mx import NVFP4_ATTRS

#: the rank of the float branch when a config does not say (ModelOpt's ``lowrank`` default)
DEFAULT_RANK = 32

_ALGORITHM = {"method": "svdquant", "lowrank": DEFAULT_RANK}

#: NVFP4 W4A4 with a rank-32 float branch per Linear (ModelOpt's content)
NVFP4_SVDQUANT_DEFAULT_CFG = preset(
    {"*weight_quantizer": dict(NVFP4_ATTRS), "*input_quantizer": dict(NVFP4_ATTRS)}, _ALGORITHM
)
#: INT4 block-128 weights (static), activations float, with a rank-32 float branch per Linear
INT4_SVDQUANT_CFG = preset(
    {
        "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "enable": True},
        "*input_quantizer": {"enable": False},
    },
    _ALGORITHM,
)

#: the SVDQuant presets by name
SVDQUANT_PRESETS = {"NVFP4_SVDQUANT_DEFAULT_CFG": NVFP4_SVDQUANT_DEFAULT_CFG, "INT4_SVDQUANT_CFG": INT4_SVDQUANT_CFG}
