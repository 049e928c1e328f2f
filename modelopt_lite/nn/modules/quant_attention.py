"""Quantized attention: Q/DQ on both inputs of the two attention matmuls, scoped to one module's forward.

Every quantized attention module owns four quantizers (ModelOpt's names), all **disabled** until a config enables
them (``"*[qkv]_bmm_quantizer"``, ``"*softmax_quantizer"``):

- ``q_bmm_quantizer`` / ``k_bmm_quantizer``: the two inputs of the scores matmul ``Q @ K^T`` (the key is quantized
  in its ``(..., seq, head_dim)`` layout, so a per-channel ``axis`` means the same thing on every path);
- ``softmax_quantizer`` / ``v_bmm_quantizer``: the two inputs of the output matmul ``P @ V`` (``P`` after softmax
  and dropout, exactly what enters the matmul).

How: while such a module runs its forward with a quantizer enabled, an :class:`AttentionQuantMode` (a
``torch.overrides.TorchFunctionMode``) is entered for that call only. Modes are thread-local and stack-scoped:
nothing in ``torch`` or in the module's Python package is patched, other modules and threads are untouched, and
the mode is gone when the forward returns (or raises). The mode

- replaces ``F.scaled_dot_product_attention`` by :func:`quantized_sdpa` (explicit ``MatMul -> Mul -> mask ->
  Softmax -> MatMul`` with the quantizers on the matmul inputs; the ONNX export shows them as Q/DQ feeding both
  inputs of both MatMuls). With only ``k``/``v`` enabled (KV-cache style) the fused call is kept, with quantized
  ``key``/``value``;
- in an explicit ("eager") attention, quantizes the inputs of the first matmul after entering (``Q @ K^T``) and
  of the first matmul after the following softmax (``P @ V``): the pattern of Hugging Face's
  ``eager_attention_forward`` and of ``F.multi_head_attention_forward``.

With every attention quantizer disabled, the module runs its float forward untouched (bit-identical).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...descriptor import QUANT_DESC_8BIT_PER_TENSOR, ScaledQuantDescriptor
from ..tensor_quantizer import TensorQuantizer
from ._base import module_device, recast_copy

if TYPE_CHECKING:
    _MixinBase = nn.Module
else:
    _MixinBase = object

#: the attention quantizers of every quantized attention module, in the order they apply
ATTENTION_QUANTIZERS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer", "softmax_quantizer")


def _funcs(*names: tuple[Any, str]) -> frozenset:
    return frozenset(getattr(obj, n) for obj, n in names if hasattr(obj, n))


_SDPA = _funcs((F, "scaled_dot_product_attention"), (torch._C._nn, "scaled_dot_product_attention"))
_MATMULS = _funcs(
    (torch, "matmul"),
    (torch, "bmm"),
    (torch.Tensor, "matmul"),
    (torch.Tensor, "__matmul__"),
    (torch.Tensor, "bmm"),
    (torch._C.TensorBase, "matmul"),
    (torch._C.TensorBase, "__matmul__"),
    (torch._C.TensorBase, "bmm"),
)
_SOFTMAX = _funcs((F, "softmax"), (torch, "softmax"), (torch.Tensor, "softmax"), (torch._C.TensorBase, "softmax"))

_active = threading.local()  # the stack of AttentionQuantModes entered in this thread


def _mode_stack() -> list:
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    return stack


def _per_tensor(q: TensorQuantizer) -> bool:
    d = q.quant_desc
    return d.axis is None and not d.block_sizes and q.bias is None  # an affine bias is per head and channel


def quantize_key_transposed(q: TensorQuantizer, key_t: torch.Tensor) -> torch.Tensor:
    """``q`` applied to ``key_t = K^T`` in K's own layout (a per-tensor quantizer directly: same values)."""
    if not q.is_enabled or _per_tensor(q):
        return q(key_t)
    return q(key_t.transpose(-1, -2)).transpose(-1, -2)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=-3)


def quantized_sdpa(
    owner: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.scaled_dot_product_attention`` with ``owner``'s attention quantizers; returns ``(output, probs)``.

    ``scores = (q_bmm(Q) @ k_bmm(K)^T) * scale``, then the causal and ``attn_mask`` masks (bool: True attends;
    float: added), ``P = softmax(scores)`` (rows with no key to attend give 0, as torch's SDPA), dropout, and
    ``softmax_quantizer(P) @ v_bmm(V)``. ``probs`` is the quantized ``P`` that entered the second matmul.
    """
    qh, kh = query.size(-3) if query.dim() >= 3 else 1, key.size(-3) if key.dim() >= 3 else 1
    if enable_gqa and qh != kh and (kh == 0 or qh % kh):
        raise ValueError(
            f"{type(owner).__name__}: enable_gqa needs the query heads ({qh}) to be a multiple of the key heads ({kh})"
        )
    if attn_mask is not None and attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"{type(owner).__name__}: attn_mask must be bool or floating point, got {attn_mask.dtype}")
    q = owner.q_bmm_quantizer(query)
    k = owner.k_bmm_quantizer(key)
    v = owner.v_bmm_quantizer(value)
    if enable_gqa:
        k, v = _repeat_kv(k, qh // kh), _repeat_kv(v, qh // kh)
    s = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * s
    masked = is_causal or attn_mask is not None
    if is_causal:
        L, S = query.size(-2), key.size(-2)
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if masked:  # a row that attends to nothing: 0, not NaN (torch's SDPA does the same)
        empty = scores.amax(dim=-1, keepdim=True) == float("-inf")
        probs = torch.where(empty, torch.zeros((), dtype=probs.dtype, device=probs.device), probs)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    p = owner.softmax_quantizer(probs)
    return torch.matmul(p, v), p


def _sdpa_args(args, kwargs) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    out = dict(zip(names, args, strict=False))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"scaled_dot_product_attention: unexpected keyword argument {k!r}")
        out[k] = v
    return out


class AttentionQuantMode(TorchFunctionMode):
    """Quantizes the attention of one forward call of ``owner`` (see the module docstring).

    ``probs``: the quantized probabilities of the last attention computed (the input of ``P @ V``).
    """

    def __init__(self, owner: Any):
        super().__init__()
        self.owner = owner
        self.probs: torch.Tensor | None = None
        self._scores_done = False  # a Q @ K^T matmul ran and its P @ V has not yet
        self._softmax_seen = False

    def __enter__(self):
        _mode_stack().append(self)
        try:
            return super().__enter__()
        except BaseException:
            _mode_stack().pop()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            stack = _mode_stack()
            if stack and stack[-1] is self:
                stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stack = _mode_stack()
        if stack and stack[-1] is not self:  # a nested quantized attention module handles its own calls
            return func(*args, **kwargs)
        if func in _SDPA:
            return self._sdpa(func, args, kwargs)
        if func in _MATMULS and len(args) >= 2 and not kwargs:
            return self._matmul(func, args)
        out = func(*args, **kwargs)
        if func in _SOFTMAX and self._scores_done:
            self._softmax_seen = True
        return out

    def _sdpa(self, func, args, kwargs):
        o = self.owner
        if not (o.q_bmm_quantizer.is_enabled or o.softmax_quantizer.is_enabled):
            a = _sdpa_args(args, kwargs)  # k/v only: keep the fused kernel
            a["key"] = o.k_bmm_quantizer(a["key"])
            a["value"] = o.v_bmm_quantizer(a["value"])
            return func(**a)
        out, self.probs = quantized_sdpa(o, **_sdpa_args(args, kwargs))
        return out

    def _matmul(self, func, args):
        o = self.owner
        a, b, rest = args[0], args[1], args[2:]
        if self._scores_done and self._softmax_seen:
            a, b = o.softmax_quantizer(a), o.v_bmm_quantizer(b)
            self.probs = a
            self._scores_done = self._softmax_seen = False
        else:
            a, b = o.q_bmm_quantizer(a), quantize_key_transposed(o.k_bmm_quantizer, b)
            self._scores_done, self._softmax_seen = True, False
        return func(a, b, *rest)


class AttentionQuantMixin(_MixinBase):
    """Adds the four attention quantizers (disabled) and ``from_float``; see the module docstring.

    ``default_quant_desc_attention``: the descriptor they are built with (8-bit per tensor; a config sets the
    format). ``_float_cls``: the float class this one converts.
    """

    default_quant_desc_attention: ClassVar[ScaledQuantDescriptor] = QUANT_DESC_8BIT_PER_TENSOR
    _float_cls: ClassVar[type]

    def _init_attention_quantizers(self) -> None:
        device = module_device(self)
        for name in ATTENTION_QUANTIZERS:
            setattr(self, name, TensorQuantizer(self.default_quant_desc_attention, disabled=True).to(device))

    @classmethod
    def from_float(cls, module: nn.Module):
        """A quantized deep copy of ``module`` (exactly ``cls._float_cls``), attention quantizers disabled."""
        new = recast_copy(cls, module)
        new._init_attention_quantizers()
        return new

    def attention_quant_active(self) -> bool:
        """True when an attention quantizer is enabled (the forward then runs under an AttentionQuantMode)."""
        return any(getattr(self, n).is_enabled for n in ATTENTION_QUANTIZERS)

    def _check_attention_quantizers(self) -> None:
        for n in ATTENTION_QUANTIZERS:
            q = getattr(self, n)
            if q.is_enabled and not q.fake_quant:
                raise ValueError(
                    f"{type(self).__name__}: quantizer {n!r} ({q.name or 'unnamed'}) has fake_quant=False; "
                    "attention is only fake-quantized (the float matmuls would run on integer codes)"
                )


class QuantAttentionModule(AttentionQuantMixin):
    """Base of ``Quant<Name>(QuantAttentionModule, <Name>)``: the float forward, run under an
    :class:`AttentionQuantMode` while an attention quantizer is enabled. Build one with
    :func:`make_quant_attention_class` (for any module whose forward calls ``F.scaled_dot_product_attention`` or
    computes ``softmax(Q @ K^T) @ V`` with ``torch.matmul``)."""

    def forward(self, *args, **kwargs):
        if not self.attention_quant_active():
            return super().forward(*args, **kwargs)
        self._check_attention_quantizers()
        with AttentionQuantMode(self):
            return super().forward(*args, **kwargs)


def make_quant_attention_class(float_cls: type, module: str | None = None) -> type:
    """``Quant<Name>(QuantAttentionModule, float_cls)`` (not registered; see :func:`register_attention_module`)."""
    if not (isinstance(float_cls, type) and issubclass(float_cls, nn.Module)):
        raise TypeError(f"make_quant_attention_class: expected an nn.Module subclass, got {float_cls!r}")
    return type(
        f"Quant{float_cls.__name__}",
        (QuantAttentionModule, float_cls),
        {
            "_float_cls": float_cls,
            "__module__": module or __name__,
            "__doc__": f"``{float_cls.__qualname__}`` with quantized attention matmuls (quantizers disabled).",
        },
    )
