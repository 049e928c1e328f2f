"""Attention modules found on first sight: Hugging Face attention classes, and user classes by registration.

Hugging Face ``transformers`` (5.x) computes attention in one module per layer (``BertSelfAttention``,
``GPT2Attention``, ``LlamaAttention``, ...) whose forward calls the attention interface of the configured
implementation: ``eager_attention_forward`` (``torch.matmul`` / softmax / ``torch.matmul``) or
``sdpa_attention_forward`` (``F.scaled_dot_product_attention``). A finder on :data:`QuantModuleRegistry` turns each
such class into ``Quant<Name>(QuantAttentionModule, <Name>)`` the first time a model containing it is quantized, so
:func:`modelopt_lite.quantize` converts it (its Linear children are converted as usual). Only the module that
calls the interface is chosen (``BertAttention``, which wraps ``BertSelfAttention``, is not), so every attention is
quantized exactly once. transformers is never imported here: a class qualifies by its module and source.

Nothing global changes: the quantizers act through a TorchFunctionMode entered only during that module's forward
(see :mod:`.quant_attention`), never by replacing ``eager_attention_forward`` or ``ALL_ATTENTION_FUNCTIONS``.

For your own module whose forward calls ``F.scaled_dot_product_attention`` (or computes ``softmax(Q @ K^T) @ V``
with ``torch.matmul``), :func:`register_attention_module` does the same.
"""

from __future__ import annotations

import functools
import inspect

from ._registry import QuantModuleRegistry
from .quant_attention import make_quant_attention_class

#: names in a forward's source that mark the module computing the attention (the interface call itself)
_HF_MARKERS = ("attention_interface(", "eager_attention_forward(", "scaled_dot_product_attention(")


@functools.cache
def _calls_attention(cls: type) -> bool:
    try:
        src = inspect.getsource(vars(cls)["forward"])
    except (OSError, TypeError, KeyError):
        return False
    return any(m in src for m in _HF_MARKERS)


def is_hf_attention_class(cls: type) -> bool:
    """A ``transformers.models.*`` class named ``*Attention`` whose own forward calls the attention interface."""
    return (
        isinstance(cls, type)
        and cls.__module__.startswith("transformers.models.")
        and cls.__name__.endswith("Attention")
        and "forward" in vars(cls)
        and _calls_attention(cls)
    )


@functools.cache
def _quant_class(cls: type) -> type:
    return make_quant_attention_class(cls, __name__)


def find_hf_attention(cls: type) -> type | None:
    """The registry finder: the quantized attention class of a Hugging Face attention class, else None."""
    return _quant_class(cls) if is_hf_attention_class(cls) else None


def register_attention_module(float_cls: type) -> type:
    """Quantize the attention of ``float_cls`` (a module computing attention in its forward); returns the class.

    ``modelopt_lite.quantize`` then converts its instances to ``Quant<Name>``, with the four attention quantizers
    (disabled until a config enables them).
    """
    quant_cls = _quant_class(float_cls)
    QuantModuleRegistry.add(float_cls, quant_cls, float_cls.__name__)
    return quant_cls


QuantModuleRegistry.add_finder(find_hf_attention)
