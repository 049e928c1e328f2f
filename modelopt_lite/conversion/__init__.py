"""Model conversion: registry, configs, ``quantize``/``calibrate``, summaries, save/restore, temporal.

The weight algorithms (AWQ, GPTQ, SmoothQuant, SVDQuant, auto_quantize) live one layer up in
:mod:`modelopt_lite.algorithms` and register themselves in :data:`ALGORITHMS`; the presets live one layer down in
:mod:`modelopt_lite.presets` (re-exported here).

The public names are re-exported from :mod:`modelopt_lite` (``modelopt_lite.quantize`` etc.).
"""

from ..presets import (
    FP8_AFFINE_KV_CFG,
    FP8_ATTENTION_CFG,
    FP8_DEFAULT_CFG,
    FP8_KV_CFG,
    INT4_AWQ_CFG,
    INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    INT8_ATTENTION_CFG,
    INT8_DEFAULT_CFG,
    INT8_HISTOGRAM_CFG,
    INT8_KV_CFG,
    INT8_ORT_CFG,
    INT8_SMOOTHQUANT_ATTENTION_CFG,
    INT8_SMOOTHQUANT_CFG,
    MXFP4_DEFAULT_CFG,
    MXFP8_DEFAULT_CFG,
    MXINT8_DEFAULT_CFG,
    NVFP4_AFFINE_KV_CFG,
    NVFP4_DEFAULT_CFG,
    NVFP4_KV_CFG,
    PRESETS,
    W4A8_AWQ_BETA_CFG,
    W4A8_CFG,
    W4A8_NVFP4_FP8_CFG,
    W4A16_NVFP4_CFG,
    with_kv_cache,
)
from .algorithm_registry import ALGORITHMS, register_algorithm
from .calibration_need import need_calibration
from .config import QuantConfigError, normalize_config
from .model_quant import (
    calibrate,
    calibrate_loop,
    make_forward_loop,
    quantize,
    replace_quant_module,
    replace_quant_modules,
    set_quantizer_by_cfg,
)
from .quant_steps import quant_step, set_quant_step
from .quantizer_attrs import disable_quantizer, enable_quantizer, set_quantizer_attribute
from .quantizer_table import print_quant_summary, summary
from .registry import QuantModuleRegistry, register, registered, unregister
from .requant import set_requant
from .save_restore import restore, save
from .utils import named_quantizers

__all__ = [
    "ALGORITHMS",
    "PRESETS",
    "FP8_DEFAULT_CFG",
    "INT4_AWQ_CFG",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "INT8_DEFAULT_CFG",
    "INT8_HISTOGRAM_CFG",
    "INT8_ORT_CFG",
    "INT8_SMOOTHQUANT_CFG",
    "W4A8_AWQ_BETA_CFG",
    "W4A8_CFG",
    "NVFP4_DEFAULT_CFG",
    "W4A16_NVFP4_CFG",
    "W4A8_NVFP4_FP8_CFG",
    "MXFP8_DEFAULT_CFG",
    "MXFP4_DEFAULT_CFG",
    "MXINT8_DEFAULT_CFG",
    "INT8_ATTENTION_CFG",
    "INT8_SMOOTHQUANT_ATTENTION_CFG",
    "FP8_ATTENTION_CFG",
    "FP8_KV_CFG",
    "INT8_KV_CFG",
    "NVFP4_KV_CFG",
    "FP8_AFFINE_KV_CFG",
    "NVFP4_AFFINE_KV_CFG",
    "with_kv_cache",
    "QuantConfigError",
    "QuantModuleRegistry",
    "calibrate",
    "calibrate_loop",
    "disable_quantizer",
    "enable_quantizer",
    "make_forward_loop",
    "named_quantizers",
    "need_calibration",
    "normalize_config",
    "print_quant_summary",
    "quant_step",
    "quantize",
    "register_algorithm",
    "register",
    "registered",
    "replace_quant_module",
    "replace_quant_modules",
    "restore",
    "save",
    "set_quant_step",
    "set_quantizer_attribute",
    "set_quantizer_by_cfg",
    "set_requant",
    "summary",
    "unregister",
]
