"""The named quantization configs (ModelOpt's ``*_CFG`` presets), one module per family.

- :mod:`.basic`: INT8 (max, histogram, ORT layouts, SmoothQuant), FP8 (per tensor, per channel/token, 2D blocks),
  INT4 blocks, W4A8;
- :mod:`.mx`: NVFP4, MXFP8, MXFP4, MXINT8; :mod:`.awq`: INT4 AWQ, W4A8 AWQ; :mod:`.attention`: attention BMMs;
- :mod:`.svdquant`: NVFP4 / INT4 with SVDQuant's low-rank float branch;
- :mod:`.kv`: KV-cache quantization (and :func:`with_kv_cache`, which adds it to any preset);
- :mod:`.base`: the pieces every family builds from (:func:`~.base.preset`, the shared attribute dicts).

Presets are plain data: this package imports only :mod:`modelopt_lite.nn` (for a descriptor constant), so the
configuration layer (:mod:`modelopt_lite.conversion`) validates them without the presets knowing about it. A new
family is one module here and one line in :data:`PRESETS`.
"""

from .attention import ATTENTION_PRESETS, FP8_ATTENTION_CFG, INT8_ATTENTION_CFG, INT8_SMOOTHQUANT_ATTENTION_CFG
from .awq import AWQ_PRESETS, INT4_AWQ_CFG, NVFP4_AWQ_LITE_CFG, W4A8_AWQ_BETA_CFG
from .base import CONVTRANSPOSE_WEIGHT_AXIS, DEFAULT_DISABLED, preset
from .basic import (
    BASIC_PRESETS,
    FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
    FP8_DEFAULT_CFG,
    FP8_PER_CHANNEL_PER_TOKEN_CFG,
    INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    INT8_DEFAULT_CFG,
    INT8_HISTOGRAM_CFG,
    INT8_ORT_CFG,
    INT8_ORT_REDUCED_RANGE_CFG,
    INT8_SMOOTHQUANT_CFG,
    W4A8_CFG,
)
from .kv import FP8_AFFINE_KV_CFG, FP8_KV_CFG, INT8_KV_CFG, KV_PRESETS, NVFP4_AFFINE_KV_CFG, NVFP4_KV_CFG, with_kv_cache
from .mx import (
    MX_PRESETS,
    MXFP4_DEFAULT_CFG,
    MXFP8_DEFAULT_CFG,
    MXINT8_DEFAULT_CFG,
    NVFP4_DEFAULT_CFG,
    NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG,
    NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG,
    W4A8_NVFP4_FP8_CFG,
    W4A16_NVFP4_CFG,
)
from .svdquant import INT4_SVDQUANT_CFG, NVFP4_SVDQUANT_DEFAULT_CFG, SVDQUANT_PRESETS

#: every preset by name
PRESETS = {**BASIC_PRESETS, **MX_PRESETS, **ATTENTION_PRESETS, **KV_PRESETS, **AWQ_PRESETS, **SVDQUANT_PRESETS}

__all__ = [
    "CONVTRANSPOSE_WEIGHT_AXIS",
    "DEFAULT_DISABLED",
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    "FP8_AFFINE_KV_CFG",
    "FP8_ATTENTION_CFG",
    "FP8_DEFAULT_CFG",
    "FP8_KV_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "INT4_AWQ_CFG",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "INT4_SVDQUANT_CFG",
    "INT8_ATTENTION_CFG",
    "INT8_DEFAULT_CFG",
    "INT8_HISTOGRAM_CFG",
    "INT8_KV_CFG",
    "INT8_ORT_CFG",
    "INT8_ORT_REDUCED_RANGE_CFG",
    "INT8_SMOOTHQUANT_ATTENTION_CFG",
    "INT8_SMOOTHQUANT_CFG",
    "MXFP4_DEFAULT_CFG",
    "MXFP8_DEFAULT_CFG",
    "MXINT8_DEFAULT_CFG",
    "NVFP4_AFFINE_KV_CFG",
    "NVFP4_AWQ_LITE_CFG",
    "NVFP4_DEFAULT_CFG",
    "NVFP4_KV_CFG",
    "NVFP4_SVDQUANT_DEFAULT_CFG",
    "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG",
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG",
    "PRESETS",
    "W4A8_AWQ_BETA_CFG",
    "W4A8_CFG",
    "W4A8_NVFP4_FP8_CFG",
    "W4A16_NVFP4_CFG",
    "preset",
    "with_kv_cache",
]
