"""Presets that also quantize attention: the inputs of both attention matmuls (``Q @ K^T`` and ``P @ V``).

Each is a base preset plus ``"*[qkv]_bmm_quantizer"`` and ``"*softmax_quantizer"`` entries (the quantizers of
``nn.MultiheadAttention``, Hugging Face attention modules and modules registered with
``modelopt_lite.nn.register_attention_module``; see :mod:`modelopt_lite.nn.modules.quant_attention`), per tensor,
max calibrated, in the base preset's format. Exported to ONNX, every attention MatMul then has Q/DQ on both inputs,
the layout TensorRT needs to fuse an INT8/FP8 attention. The other presets leave these quantizers off.
"""

from __future__ import annotations

from .base import INT8_A, INT8_W, int8_ct_weights, preset

_FP8 = {"num_bits": (4, 3), "axis": None, "calib_method": "max", "enable": True}


def _attention(attrs: dict) -> dict:
    return {"*[qkv]_bmm_quantizer": dict(attrs), "*softmax_quantizer": dict(attrs)}


def _int8(algorithm) -> dict:
    return preset(
        {
            "*weight_quantizer": dict(INT8_W),
            "*input_quantizer": dict(INT8_A),
            **int8_ct_weights(),
            **_attention(INT8_A),
        },
        algorithm,
    )


#: INT8_DEFAULT_CFG plus INT8 per-tensor Q, K, V and softmax-probability quantizers on every attention
INT8_ATTENTION_CFG = _int8("max")

#: INT8_SMOOTHQUANT_CFG (alpha 0.8) plus INT8 per-tensor attention matmul inputs
INT8_SMOOTHQUANT_ATTENTION_CFG = _int8({"method": "smoothquant", "alpha": 0.8})

#: FP8_DEFAULT_CFG plus FP8 E4M3 per-tensor attention matmul inputs
FP8_ATTENTION_CFG = preset({"*weight_quantizer": dict(_FP8), "*input_quantizer": dict(_FP8), **_attention(_FP8)}, "max")

#: the attention presets by name (merged into :data:`~.presets.PRESETS`)
ATTENTION_PRESETS = {
    "INT8_ATTENTION_CFG": INT8_ATTENTION_CFG,
    "INT8_SMOOTHQUANT_ATTENTION_CFG": INT8_SMOOTHQUANT_ATTENTION_CFG,
    "FP8_ATTENTION_CFG": FP8_ATTENTION_CFG,
}
