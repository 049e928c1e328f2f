"""The NVFP4 and OCP MX presets, under ModelOpt 0.47's names and with its quant_cfg content.

NVFP4 (``num_bits=(2, 1)``, E4M3 block scales, ``"scale_bits": (4, 3)``) calibrates a per-tensor global amax
("max"); static NVFP4 weights (``"type": "static"``, the ``NVFP4_W4A4_WEIGHT_*`` presets) store one amax per block,
chosen by a scale search; the MX presets (``"scale_bits": (8, 0)``) are dynamic and need no calibration (algorithm None). ModelOpt's
``"effective_bits"`` entry (4.5 for NVFP4: informational) is left out. Numerics: :mod:`modelopt_lite.functional.
microscaling`. ``export_onnx`` writes them as standard ONNX (FLOAT4E2M1 / FP8 codes with E4M3 or E8M0 block scales,
opset 23/24: see :mod:`modelopt_lite.onnx_export.microscaling`); ``fake2real`` packs them (:mod:`modelopt_lite.real.
microscaling`).
"""

from __future__ import annotations

from .base import preset

#: the NVFP4 quantizer attributes (ModelOpt's config shape), shared by the NVFP4 presets here and in presets.kv
NVFP4_ATTRS = {
    "num_bits": (2, 1),
    "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
    "axis": None,
    "enable": True,
}


#: static NVFP4 weights (ModelOpt's StaticBlockScaleQuantizer): one stored amax per block and a global amax
NVFP4_STATIC_WEIGHT_ATTRS = {**NVFP4_ATTRS, "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}


def _mx(num_bits) -> dict:
    return {"num_bits": num_bits, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}, "axis": None,
            "enable": True}  # fmt: skip


#: NVFP4 weights and activations (blocks of 16, calibrated per-tensor global amax).
NVFP4_DEFAULT_CFG = preset({"*weight_quantizer": dict(NVFP4_ATTRS), "*input_quantizer": dict(NVFP4_ATTRS)}, "max")
#: NVFP4 weights only; activations stay in float.
W4A16_NVFP4_CFG = preset({"*weight_quantizer": dict(NVFP4_ATTRS), "*input_quantizer": {"enable": False}}, "max")
#: NVFP4 weights in blocks of 32 with FP8 E4M3 per-tensor activations.
W4A8_NVFP4_FP8_CFG = preset(
    {
        "*weight_quantizer": {**NVFP4_ATTRS, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (4, 3)}},
        "*input_quantizer": {"num_bits": (4, 3), "axis": None, "enable": True},
    },
    "max",
)
#: static NVFP4 weights whose block scales are swept over every E4M3 value (least squared weight error, the global
#: amax fixed), dynamic NVFP4 activations
NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG = preset(
    {"*weight_quantizer": dict(NVFP4_STATIC_WEIGHT_ATTRS), "*input_quantizer": dict(NVFP4_ATTRS)},
    {"method": "mse", "fp8_scale_sweep": True},
)
#: the same sweep, the weight error weighted by each Linear's per-block input Hessian
NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG = preset(
    {"*weight_quantizer": dict(NVFP4_STATIC_WEIGHT_ATTRS), "*input_quantizer": dict(NVFP4_ATTRS)},
    {"method": "local_hessian", "fp8_scale_sweep": True},
)
#: OCP MXFP8 (E4M3 elements, E8M0 scales per 32) weights and activations.
MXFP8_DEFAULT_CFG = preset({"*weight_quantizer": _mx((4, 3)), "*input_quantizer": _mx((4, 3))}, None)
#: OCP MXFP4 (E2M1 elements) weights and activations.
MXFP4_DEFAULT_CFG = preset({"*weight_quantizer": _mx((2, 1)), "*input_quantizer": _mx((2, 1))}, None)
#: OCP MXINT8 (INT8 elements read as 1.6 fixed point) weights and activations.
MXINT8_DEFAULT_CFG = preset({"*weight_quantizer": _mx(8), "*input_quantizer": _mx(8)}, None)

MX_PRESETS = {
    "NVFP4_DEFAULT_CFG": NVFP4_DEFAULT_CFG,
    "W4A16_NVFP4_CFG": W4A16_NVFP4_CFG,
    "W4A8_NVFP4_FP8_CFG": W4A8_NVFP4_FP8_CFG,
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG": NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG,
    "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG": NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG,
    "MXFP8_DEFAULT_CFG": MXFP8_DEFAULT_CFG,
    "MXFP4_DEFAULT_CFG": MXFP4_DEFAULT_CFG,
    "MXINT8_DEFAULT_CFG": MXINT8_DEFAULT_CFG,
}
