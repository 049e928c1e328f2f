"""The INT8, FP8 (per tensor, per channel / per token, 2D blocks) and INT4 presets (:data:`BASIC_PRESETS`).

Presets start with ``"default": {"enable": False}`` (output quantizers and hand-made quantizers stay off unless a
pattern enables them) and end with :data:`~.base.DEFAULT_DISABLED`, so those entries win. They are plain
dicts; :func:`modelopt_lite.quantize` deep-copies the config it is given and never mutates it.
"""

from __future__ import annotations

import copy

from .base import CONVTRANSPOSE_WEIGHT_AXIS, CT_KEYS, INT8_A, INT8_W, int8_ct_weights, preset

#: INT8 weights per channel (axis 0; ConvTranspose: CONVTRANSPOSE_WEIGHT_AXIS) and INT8 per-tensor activations,
#: max calibration.
INT8_DEFAULT_CFG = preset(
    {"*weight_quantizer": dict(INT8_W), "*input_quantizer": dict(INT8_A), **int8_ct_weights()}, "max"
)

#: As INT8_DEFAULT_CFG, but activations use histogram calibration, resolved by the 99.99th percentile.
INT8_HISTOGRAM_CFG = preset(
    {
        "*weight_quantizer": dict(INT8_W),
        "*input_quantizer": dict(INT8_A, calib_method="histogram"),
        **int8_ct_weights(),
    },
    {"method": "percentile", "percentile": 99.99},
)

#: FP8 E4M3 weights and activations, per tensor, max calibration.
FP8_DEFAULT_CFG = preset(
    {
        "*weight_quantizer": {"num_bits": (4, 3), "axis": None, "calib_method": "max", "enable": True},
        "*input_quantizer": {"num_bits": (4, 3), "axis": None, "calib_method": "max", "enable": True},
    },
    "max",
)

_FP8_CHANNEL_W = {"num_bits": (4, 3), "axis": 0, "calib_method": "max", "enable": True}
_FP8_TOKEN_A = {"num_bits": (4, 3), "axis": None, "block_sizes": {-1: None}, "dynamic": True, "enable": True}
_FP8_BLOCK2D_W = {
    "num_bits": (4, 3),
    "block_sizes": {-1: 128, -2: 128},
    "axis": None,
    "calib_method": "max",
    "enable": True,
}

#: FP8 E4M3 weights per output channel (axis 0; ConvTranspose: CONVTRANSPOSE_WEIGHT_AXIS; max calibrated from the
#: weight itself) and FP8 E4M3 activations per token: dynamic, one amax per row along the last axis
#: (``block_sizes={-1: None}``), recomputed from every input. Nothing is calibrated from data
#: (:func:`~modelopt_lite.need_calibration` is False). ModelOpt 0.47's preset of the same name.
FP8_PER_CHANNEL_PER_TOKEN_CFG = preset(
    {
        "*weight_quantizer": dict(_FP8_CHANNEL_W),
        "*input_quantizer": dict(_FP8_TOKEN_A),
        **{k: {"*weight_quantizer": dict(_FP8_CHANNEL_W, axis=CONVTRANSPOSE_WEIGHT_AXIS)} for k in CT_KEYS},
    },
    "max",
)

#: FP8 E4M3 weights in 2D blocks of 128 x 128 over the last two weight axes (static, one max-calibrated amax per
#: block; edge blocks are partial), activations not quantized. ModelOpt 0.47's preset of the same name.
FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG = preset(
    {
        "*weight_quantizer": dict(_FP8_BLOCK2D_W),
        "*input_quantizer": {"enable": False},
    },
    "max",
)

_INT4_BLOCK_W = {"num_bits": 4, "block_sizes": {-1: 128}, "axis": None, "calib_method": "max", "enable": True}

#: INT4 weights in blocks of 128 along the last weight axis (static, max calibrated); activations not quantized.
INT4_BLOCKWISE_WEIGHT_ONLY_CFG = preset(
    {"*weight_quantizer": copy.deepcopy(_INT4_BLOCK_W), "*input_quantizer": {"enable": False}}, "max"
)

#: INT4 block-128 weights (as INT4_BLOCKWISE_WEIGHT_ONLY_CFG) with INT8 per-tensor activations.
W4A8_CFG = preset({"*weight_quantizer": copy.deepcopy(_INT4_BLOCK_W), "*input_quantizer": dict(INT8_A)}, "max")

#: INT8_DEFAULT_CFG plus INT8 per-tensor *output* quantizers on Conv, Linear and QuantMatMul. ONNX Runtime fuses
#: ``DQ -> Conv/Gemm/MatMul -> Q`` into QLinearConv / QGemm / QLinearMatMul only when the op's output is quantized,
#: so this layout runs as int8 kernels in ORT (INT8_DEFAULT_CFG, TensorRT style, leaves outputs in float).
#: ``"requant": "integer"``: those layers compute their outputs as ORT's int8 kernels do (bit-identical to ORT).
INT8_ORT_CFG = {
    **preset(
        {
            "*weight_quantizer": dict(INT8_W),
            "*input_quantizer": dict(INT8_A),
            **int8_ct_weights(),
            **{
                k: {"*output_quantizer": dict(INT8_A)}
                for k in ("nn.Conv1d", "nn.Conv2d", "nn.Conv3d", "nn.Linear", "QuantMatMul")
            },
        },
        "max",
    ),
    "requant": "integer",
}

#: INT8_ORT_CFG with 7-bit weights (signed, codes in [-64, 63]: the range of ORT's ``reduce_range``; activations
#: and outputs stay 8-bit). Exported with ``target="onnxruntime"`` (default ``ort_weights="auto"``) the weights are
#: stored as int8 and run ORT's fast u8 x s8 kernels exactly on every CPU, also on x86 CPUs without VNNI, whose
#: int16 pair sums would saturate on full-range 8-bit weights (2 * 255 * 64 = 32640 fits). Bit-identical to ORT.
INT8_ORT_REDUCED_RANGE_CFG = copy.deepcopy(INT8_ORT_CFG)
INT8_ORT_REDUCED_RANGE_CFG["quant_cfg"].update(
    {
        "*weight_quantizer": dict(INT8_W, num_bits=7),
        **{k: {"*weight_quantizer": dict(INT8_W, num_bits=7, axis=CONVTRANSPOSE_WEIGHT_AXIS)} for k in CT_KEYS},
    }
)

#: INT8_DEFAULT_CFG with SmoothQuant (alpha 0.8) before the max calibration: activation outliers moved into the
#: weights, so every Linear input can stay per-tensor INT8 (all-MiniLM-L6-v2: cosine to FP32 0.986 -> 0.997).
INT8_SMOOTHQUANT_CFG = preset(
    {"*weight_quantizer": dict(INT8_W), "*input_quantizer": dict(INT8_A), **int8_ct_weights()},
    {"method": "smoothquant", "alpha": 0.8},
)

#: the presets of this module by name (:data:`modelopt_lite.presets.PRESETS` merges every family)
BASIC_PRESETS = {
    "INT8_DEFAULT_CFG": INT8_DEFAULT_CFG,
    "INT8_HISTOGRAM_CFG": INT8_HISTOGRAM_CFG,
    "FP8_DEFAULT_CFG": FP8_DEFAULT_CFG,
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": FP8_PER_CHANNEL_PER_TOKEN_CFG,
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    "W4A8_CFG": W4A8_CFG,
    "INT8_ORT_CFG": INT8_ORT_CFG,
    "INT8_ORT_REDUCED_RANGE_CFG": INT8_ORT_REDUCED_RANGE_CFG,
    "INT8_SMOOTHQUANT_CFG": INT8_SMOOTHQUANT_CFG,
}
