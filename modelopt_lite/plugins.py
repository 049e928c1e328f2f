"""ModelOpt's ``modelopt.torch.quantization.plugins`` entry points that apply here.

``register_attention_for_kv_quant(attention_cls)``: make :func:`modelopt_lite.quantize` convert instances of your
attention class to a quantized twin whose attention quantizers (q/k/v BMM inputs, the KV cache) a config such as
``FP8_KV_CFG`` enables. Returns True when registered, False when the class's ``forward`` computes no attention that
can be quantized (no ``matmul`` / ``bmm`` / ``baddbmm`` / ``scaled_dot_product_attention`` call in its source), as
ModelOpt does. The class is never edited or re-compiled: the quantizers act during its forward only (see
:mod:`modelopt_lite.nn.modules.quant_attention`).
"""

from __future__ import annotations

import inspect

from torch import nn

from .nn.modules._registry import QuantModuleRegistry
from .nn.modules.quant_attention_hf import register_attention_module

_ATTENTION_OPS = ("matmul(", "bmm(", "baddbmm(", "scaled_dot_product_attention(", " @ ")

__all__ = ["register_attention_for_kv_quant"]


def register_attention_for_kv_quant(attention_cls: type) -> bool:
    """Register ``attention_cls`` for KV-cache / attention quantization; see the module docstring."""
    if not isinstance(attention_cls, type) or not issubclass(attention_cls, nn.Module):
        raise TypeError(f"register_attention_for_kv_quant: expected an nn.Module class, got {attention_cls!r}")
    if QuantModuleRegistry.get(attention_cls) is not None:
        return True
    try:
        src = inspect.getsource(attention_cls.forward)
    except (OSError, TypeError):
        return False
    if not any(op in src for op in _ATTENTION_OPS):
        return False
    register_attention_module(attention_cls)
    return True
