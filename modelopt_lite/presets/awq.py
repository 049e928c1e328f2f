"""The AWQ presets (ModelOpt's content): INT4 weights in blocks of 128 along the input axis, searched with
``awq_lite`` (see :mod:`.awq`).

- ``INT4_AWQ_CFG``: weight-only INT4 (W4A16), activations float.
- ``W4A8_AWQ_BETA_CFG``: the weight quantized twice, INT4 blocks then FP8 E4M3 per tensor (a
  :class:`~modelopt_lite.nn.SequentialQuantizer`), FP8 E4M3 per-tensor activations.
- ``NVFP4_AWQ_LITE_CFG``: ``NVFP4_DEFAULT_CFG``'s NVFP4 weights and activations, searched with ``awq_lite``.
"""

from __future__ import annotations

from .base import preset
from .mx import NVFP4_ATTRS

_INT4_BLOCK = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "enable": True}
_FP8_TENSOR = {"num_bits": (4, 3), "axis": None, "enable": True}

#: INT4 block-128 weights (static), activations not quantized; AWQ lite (alpha grid step 0.1)
INT4_AWQ_CFG = preset(
    {"*weight_quantizer": dict(_INT4_BLOCK), "*input_quantizer": {"enable": False}},
    {"method": "awq_lite", "alpha_step": 0.1},
)

#: INT4 block-128 then FP8 per-tensor weights, FP8 per-tensor activations; AWQ lite
W4A8_AWQ_BETA_CFG = preset(
    {"*weight_quantizer": [dict(_INT4_BLOCK), dict(_FP8_TENSOR)], "*input_quantizer": dict(_FP8_TENSOR)},
    "awq_lite",
)

#: NVFP4 weights and activations (NVFP4_DEFAULT_CFG's), AWQ lite with ModelOpt's defaults
NVFP4_AWQ_LITE_CFG = preset({"*weight_quantizer": dict(NVFP4_ATTRS), "*input_quantizer": dict(NVFP4_ATTRS)}, "awq_lite")

#: the AWQ presets by name (merged into ``presets.PRESETS``)
AWQ_PRESETS = {
    "INT4_AWQ_CFG": INT4_AWQ_CFG,
    "W4A8_AWQ_BETA_CFG": W4A8_AWQ_BETA_CFG,
    "NVFP4_AWQ_LITE_CFG": NVFP4_AWQ_LITE_CFG,
}
