"""``QuantMultiheadAttention``: ``nn.MultiheadAttention`` with quantized projections and attention matmuls.

Every GEMM of the module gets Q/DQ on both inputs, with the names presets reach (``"*input_quantizer"``,
``"*weight_quantizer"``, ``"*[qkv]_bmm_quantizer"``, ``"*softmax_quantizer"``):

- the in-projection, on the module itself: ``in_proj_input_quantizer`` (8-bit per tensor) on its input and, on its
  weight, ``in_proj_weight_quantizer`` (the packed ``in_proj_weight``, 8-bit per output channel: axis 0 over the
  3E rows, so the Q, K and V rows each keep their own scales) or, when ``kdim``/``vdim`` differ from
  ``embed_dim``, ``q_proj_weight_quantizer`` / ``k_proj_weight_quantizer`` / ``v_proj_weight_quantizer``. These
  are enabled by default, as ``QuantLinear``'s. **One input quantizer for query, key and value**: in
  self-attention they are one tensor projected by one packed GEMM (one Q/DQ); in cross-attention the query and the
  key/value memory are different tensors and share its scale (max calibration takes the max over both), which
  keeps every quantizer used by every forward (a quantizer per input would sit idle, uncalibrated, in every
  self-attention and block its export). In cross-attention the packed weight is quantized once and then split
  into its Q/K/V rows (per-channel scales are per row, so splitting commutes with the quantization);
- the out-projection: ``out_proj`` (torch's ``NonDynamicallyQuantizableLinear``) becomes a
  :class:`QuantNonDynamicallyQuantizableLinear`, a :class:`~.quant_linear.QuantLinear` (``out_proj.input_quantizer``,
  ``out_proj.weight_quantizer``; class key ``"nn.Linear"`` reaches it too);
- the two attention matmuls: ``q_bmm_quantizer(Q)``, ``k_bmm_quantizer(K)`` feed ``Q @ K^T`` (then
  ``* head_dim ** -0.5``, masks, softmax, dropout) and ``softmax_quantizer(P)``, ``v_bmm_quantizer(V)`` feed
  ``P @ V`` (disabled until a config enables them, see :mod:`.quant_attention`).

With every quantizer of the module disabled it is ``nn.MultiheadAttention`` itself (same forward, fast path
included: bit-identical). With one enabled, the forward computes the same attention explicitly (the projections,
``bias_k``/``bias_v``, ``add_zero_attn`` and the mask merging of ``F.multi_head_attention_forward``) with the
quantizers in place, whatever ``need_weights`` says (so one calibration serves both); the returned weights are
the quantized ``P`` (averaged over heads when ``average_attn_weights``). Weight-only calibration
(``calibrate_weights``, no forward loop) does not reach the in-projection weight quantizers (applied inside the
forward, as the RNN families' are): they quantize dynamically until a forward loop calibrates them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ...descriptor import QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW, QUANT_DESC_8BIT_PER_TENSOR, ScaledQuantDescriptor
from ..tensor_quantizer import TensorQuantizer
from ._base import _quantizers, module_device
from ._registry import QuantModuleRegistry
from .quant_attention import ATTENTION_QUANTIZERS, AttentionQuantMixin, quantized_sdpa
from .quant_linear import QuantLinear

#: the in-projection weight quantizers: packed (``kdim == vdim == embed_dim``) or separate, by the weight they quantize
PACKED_WEIGHT_QUANTIZERS = {"in_proj_weight": "in_proj_weight_quantizer"}
SEPARATE_WEIGHT_QUANTIZERS = {
    "q_proj_weight": "q_proj_weight_quantizer",
    "k_proj_weight": "k_proj_weight_quantizer",
    "v_proj_weight": "v_proj_weight_quantizer",
}


def _pad_key(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else F.pad(mask, (0, 1))


def _same_map(fn, query, key, value):
    """``fn`` on each of query/key/value, keeping which of them are the same tensor (self-attention projects the
    packed weight once, as ``nn.MultiheadAttention`` does)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = k if value is key else (q if value is query else fn(value))
    return q, k, v


@QuantModuleRegistry.register({NonDynamicallyQuantizableLinear: "nn.NonDynamicallyQuantizableLinear"})
class QuantNonDynamicallyQuantizableLinear(QuantLinear):
    """``QuantLinear`` for torch's ``NonDynamicallyQuantizableLinear`` (``nn.MultiheadAttention.out_proj``: a plain
    ``nn.Linear`` subclass that only marks the layer for torch's own dynamic quantization)."""

    _float_cls = NonDynamicallyQuantizableLinear


@QuantModuleRegistry.register({nn.MultiheadAttention: "nn.MultiheadAttention"})
class QuantMultiheadAttention(AttentionQuantMixin, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with in-projection input/weight quantizers (enabled by default, as QuantLinear's),
    a quantized ``out_proj`` and ``q_bmm``/``k_bmm``/``v_bmm``/``softmax`` quantizers (disabled by default)."""

    _float_cls = nn.MultiheadAttention
    in_proj_input_quantizer: TensorQuantizer
    in_proj_weight_quantizer: TensorQuantizer
    default_quant_desc_input: ClassVar[ScaledQuantDescriptor] = QUANT_DESC_8BIT_PER_TENSOR
    default_quant_desc_weight: ClassVar[ScaledQuantDescriptor] = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_attention_quantizers()

    def _init_attention_quantizers(self) -> None:
        """The four attention quantizers, the in-projection ones and a quantized ``out_proj``."""
        super()._init_attention_quantizers()
        device = module_device(self)
        self.in_proj_input_quantizer = TensorQuantizer(self.default_quant_desc_input).to(device)
        weights = PACKED_WEIGHT_QUANTIZERS if self._qkv_same_embed_dim else SEPARATE_WEIGHT_QUANTIZERS
        for qname in weights.values():
            setattr(self, qname, TensorQuantizer(self.default_quant_desc_weight).to(device))
        if type(self.out_proj) is NonDynamicallyQuantizableLinear:
            self.out_proj = QuantNonDynamicallyQuantizableLinear.from_float(self.out_proj)

    def projection_quantizer_names(self) -> tuple[str, ...]:
        """The in-projection quantizers of this module (input first, then the weights)."""
        weights = PACKED_WEIGHT_QUANTIZERS if self._qkv_same_embed_dim else SEPARATE_WEIGHT_QUANTIZERS
        return ("in_proj_input_quantizer", *weights.values())

    def quant_active(self) -> bool:
        """True when a quantizer of the module (out_proj's included) is enabled: the explicit forward runs."""
        return any(q.is_enabled for q in _quantizers(self))

    def _check_quantizers(self) -> None:
        for n in (*ATTENTION_QUANTIZERS, *self.projection_quantizer_names()):
            q = getattr(self, n)
            if q.is_enabled and not q.fake_quant:
                raise ValueError(
                    f"{type(self).__name__}: quantizer {n!r} ({q.name or 'unnamed'}) has fake_quant=False; "
                    "the module is only fake-quantized (the float matmuls would run on integer codes)"
                )

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        if not self.quant_active():
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        self._check_quantizers()
        if query.dim() not in (2, 3):
            raise ValueError(f"{type(self).__name__}: query must be 2-D or 3-D, got shape {tuple(query.shape)}")
        batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )  # fmt: skip
        if self.batch_first and batched:
            query, key, value = _same_map(lambda x: x.transpose(1, 0), query, key, value)
        if not batched:
            query, key, value = _same_map(lambda x: x.unsqueeze(1), query, key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        out, probs = self._attention(query, key, value, key_padding_mask, attn_mask, is_causal)
        if self.batch_first and batched:
            out = out.transpose(1, 0)
        if not batched:
            out = out.squeeze(1)
        if not need_weights:
            return out, None
        if average_attn_weights:
            probs = probs.mean(dim=1)
        return out, (probs if batched else probs.squeeze(0))

    def _project(self, query, key, value):
        """The quantized in-projection: one input quantizer on query/key/value (identity kept: self-attention
        stays one packed GEMM), the weight quantizer(s) on the weight(s)."""
        query, key, value = _same_map(self.in_proj_input_quantizer, query, key, value)
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight_quantizer(self.in_proj_weight)
            packed = F._in_projection_packed  # type: ignore[attr-defined]
            return packed(query, key, value, w, self.in_proj_bias)
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        wq, wk, wv = (getattr(self, qn)(getattr(self, wn)) for wn, qn in SEPARATE_WEIGHT_QUANTIZERS.items())
        separate = F._in_projection  # type: ignore[attr-defined]
        return separate(query, key, value, wq, wk, wv, bq, bk, bv)

    def _attention(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """Sequence-first ``(L, N, E)`` inputs -> ``(L, N, E)`` output and ``(N, H, L, S)`` quantized weights."""
        tgt_len, bsz, embed_dim = query.shape
        heads, head_dim = self.num_heads, self.head_dim
        if is_causal and attn_mask is None:
            raise RuntimeError(
                f"{type(self).__name__}: is_causal needs attn_mask (as nn.MultiheadAttention: the flag is a hint)"
            )
        q, k, v = self._project(query, key, value)
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
        q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            attn_mask, key_padding_mask = _pad_key(attn_mask), _pad_key(key_padding_mask)
        src_len = k.size(1)
        if key_padding_mask is not None:
            kpm = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
            attn_mask = kpm if attn_mask is None else attn_mask + kpm
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(bsz, heads, -1, src_len)
        dropout_p = self.dropout if self.training else 0.0
        out, probs = quantized_sdpa(
            self,
            q.reshape(bsz, heads, tgt_len, head_dim),
            k.reshape(bsz, heads, src_len, head_dim),
            v.reshape(bsz, heads, src_len, head_dim),
            attn_mask,
            dropout_p,
        )
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        out = self.out_proj(out)  # a QuantLinear: its own input/weight quantizers
        return out.view(tgt_len, bsz, out.size(1)), probs
