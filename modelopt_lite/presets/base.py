"""What every preset shares: the default-disabled entries, the INT8 attribute dicts and :func:`preset`.

A preset family lives in its own module (``presets.py`` for the INT8/FP8/INT4 ones) and builds its configs with
:func:`preset`; :data:`modelopt_lite.presets.basic.PRESETS` lists every family's presets by name.
"""

from __future__ import annotations

import copy

from ..nn.modules.quant_conv_transpose import QUANT_DESC_8BIT_CONVTRANSPOSE_WEIGHT_PER_OUTPUT_CHANNEL as _CT_DESC

#: the per-channel axis of ConvTranspose weights, shaped (in, out / groups, *kernel): the quantized modules' default
#: (axis 1, one scale per output channel, as the peers' constants; see quant_conv_transpose.py)
CONVTRANSPOSE_WEIGHT_AXIS = _CT_DESC.axis

#: entries every preset ends with, so they win: quantizers the peers leave off by default
DEFAULT_DISABLED = {
    "nn.BatchNorm1d": {"*": {"enable": False}},
    "nn.BatchNorm2d": {"*": {"enable": False}},
    "nn.BatchNorm3d": {"*": {"enable": False}},
    "nn.LeakyReLU": {"*": {"enable": False}},
    # QuantEmbedding is converted but off in every preset (they keep their behaviour): enable it by a config entry
    "nn.Embedding": {"*": {"enable": False}},
    # Hugging Face inline residual adds (nn/modules/quant_residual_hf.py): off unless a later entry enables them
    "QuantHFResidualOutputMixin": {"*residual_input_quantizer": {"enable": False}},
    "*lm_head*": {"enable": False},
    "*output_layer*": {"enable": False},
    "*router*": {"enable": False},
    "*block_sparse_moe.gate*": {"enable": False},
    "*mlp.gate.*": {"enable": False},
}
INT8_W = {"num_bits": 8, "axis": 0, "calib_method": "max", "enable": True}
INT8_A = {"num_bits": 8, "axis": None, "calib_method": "max", "enable": True}
CT_KEYS = ("nn.ConvTranspose1d", "nn.ConvTranspose2d", "nn.ConvTranspose3d")


def preset(quant_cfg: dict, algorithm) -> dict:
    """``{"quant_cfg": {"default": off, **quant_cfg, **DEFAULT_DISABLED}, "algorithm": algorithm}`` (fresh copies)."""
    return {
        "quant_cfg": {"default": {"enable": False}, **copy.deepcopy(quant_cfg), **copy.deepcopy(DEFAULT_DISABLED)},
        "algorithm": copy.deepcopy(algorithm),
    }


def int8_ct_weights() -> dict:
    """Per-channel INT8 ConvTranspose weights on :data:`CONVTRANSPOSE_WEIGHT_AXIS`, one entry per class key."""
    return {k: {"*weight_quantizer": dict(INT8_W, axis=CONVTRANSPOSE_WEIGHT_AXIS)} for k in CT_KEYS}
