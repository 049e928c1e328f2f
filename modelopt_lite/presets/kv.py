"""KV-cache presets: quantize the keys and values that enter a decoder's attention matmuls.

The ``k_bmm_quantizer`` / ``v_bmm_quantizer`` of a quantized attention module (Hugging Face GPT-2, Llama, ...:
:mod:`modelopt_lite.nn.modules.quant_attention`) see K and V as attention uses them: with a KV cache, the cached
keys/values of earlier steps concatenated with the new ones. A per-tensor static scale makes that the same as
storing the cache quantized (fake quantization is element-wise and idempotent for a fixed scale), which is what
TensorRT-LLM's FP8/INT8 KV cache computes.

- :data:`FP8_KV_CFG`: ModelOpt's preset of that name: ``"*[kv]_bmm_quantizer"`` FP8 E4M3 per tensor;
- :data:`INT8_KV_CFG`: the same with INT8 per tensor;
- :data:`NVFP4_KV_CFG`: ModelOpt's preset of that name: NVFP4 (E2M1 in blocks of 16 along the head dimension, E4M3
  block scales under a calibrated per-tensor global amax).

- :data:`FP8_AFFINE_KV_CFG`: ModelOpt's preset of that name: FP8 E4M3 per tensor with a static affine bias
  ``{-2: None, -4: None, "type": "static"}``: the mean over batch and sequence, one value per head and channel
  (shape ``(1, heads, 1, head_dim)``), calibrated with the amax (which sees ``K - b``); the quantizer computes
  ``fq(K - b) + b`` (see :mod:`modelopt_lite.nn._affine_bias`);
- :data:`NVFP4_AFFINE_KV_CFG`: ModelOpt's preset of that name: NVFP4 with the same bias. ModelOpt 0.47 calibrates
  the bias (and the global amax on ``K - b``) but its dynamic-block NVFP4 forward drops the bias (it quantizes
  ``K`` itself); here ``fq(K - b) + b`` is computed, as for FP8.

As in ModelOpt, a KV preset is meant to be combined with a model preset: :func:`with_kv_cache` adds its KV entries
to another config (``with_kv_cache(FP8_DEFAULT_CFG, FP8_KV_CFG)``). Used alone, it quantizes the KV cache only
(everything else off: presets start with ``"default": {"enable": False}``), max calibrated.
"""

from __future__ import annotations

import copy

from .base import DEFAULT_DISABLED, preset
from .mx import NVFP4_ATTRS

#: the pattern ModelOpt's KV presets use: the key and value inputs of the attention matmuls
KV_PATTERN = "*[kv]_bmm_quantizer"

#: FP8 E4M3 per-tensor keys and values (ModelOpt's FP8_KV_CFG entry), max calibration
FP8_KV_CFG = preset({KV_PATTERN: {"num_bits": (4, 3), "axis": None, "enable": True}}, "max")

#: INT8 per-tensor keys and values, max calibration
INT8_KV_CFG = preset({KV_PATTERN: {"num_bits": 8, "axis": None, "calib_method": "max", "enable": True}}, "max")

#: NVFP4 keys and values (ModelOpt's NVFP4_KV_CFG entry), the global amax max calibrated
NVFP4_KV_CFG = preset({KV_PATTERN: dict(NVFP4_ATTRS)}, "max")

#: ModelOpt's affine KV bias: reduced over batch (-4) and sequence (-2), so one value per head and channel
KV_AFFINE_BIAS = {-2: None, -4: None, "type": "static"}

#: FP8 E4M3 per-tensor keys and values with a static per-head, per-channel bias (ModelOpt's FP8_AFFINE_KV_CFG)
FP8_AFFINE_KV_CFG = preset(
    {KV_PATTERN: {"num_bits": (4, 3), "axis": None, "bias": dict(KV_AFFINE_BIAS), "enable": True}}, "max"
)

#: NVFP4 keys and values with the same bias (ModelOpt's NVFP4_AFFINE_KV_CFG; the bias is applied here, see above)
NVFP4_AFFINE_KV_CFG = preset({KV_PATTERN: {**NVFP4_ATTRS, "bias": dict(KV_AFFINE_BIAS)}}, "max")

#: the KV presets by name (merged into :data:`~.presets.PRESETS`)
KV_PRESETS = {
    "FP8_KV_CFG": FP8_KV_CFG,
    "INT8_KV_CFG": INT8_KV_CFG,
    "NVFP4_KV_CFG": NVFP4_KV_CFG,
    "FP8_AFFINE_KV_CFG": FP8_AFFINE_KV_CFG,
    "NVFP4_AFFINE_KV_CFG": NVFP4_AFFINE_KV_CFG,
}


def with_kv_cache(config: dict, kv_config: dict) -> dict:
    """A new config: ``config`` plus the KV-cache entries of ``kv_config`` (neither is modified).

    The KV entries are inserted before ``config``'s trailing default-disabled entries, so those still win; the
    algorithm and the other settings are ``config``'s.

    Raises:
        TypeError: either config is not a dict with a ``"quant_cfg"`` dict.
    """
    for what, c in (("config", config), ("kv_config", kv_config)):
        if not isinstance(c, dict) or not isinstance(c.get("quant_cfg"), dict):
            raise TypeError(f"with_kv_cache: {what} must be a dict with a 'quant_cfg' dict, got {c!r:.80}")
    kv = {k: v for k, v in kv_config["quant_cfg"].items() if k != "default" and k not in DEFAULT_DISABLED}
    if not kv:
        raise ValueError("with_kv_cache: kv_config has no KV-cache entries (e.g. '*[kv]_bmm_quantizer')")
    out = copy.deepcopy(config)
    base = out["quant_cfg"]
    head = {k: v for k, v in base.items() if k not in DEFAULT_DISABLED and k not in kv}
    tail = {k: v for k, v in base.items() if k in DEFAULT_DISABLED and k not in kv}
    out["quant_cfg"] = {**head, **copy.deepcopy(kv), **tail}
    return out
