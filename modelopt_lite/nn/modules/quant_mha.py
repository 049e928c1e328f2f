"""``QuantMultiheadAttention``: ``nn.MultiheadAttention`` with quantized attention matmuls.

With every attention quantizer disabled (the default) it is ``nn.MultiheadAttention`` itself (same forward, fast
path included: bit-identical). With one enabled, the forward computes the same attention explicitly (the
projections, ``bias_k``/``bias_v``, ``add_zero_attn`` and the mask merging of ``F.multi_head_attention_forward``)
and runs :func:`~.quant_attention.quantized_sdpa` on the heads: ``q_bmm_quantizer(Q)``, ``k_bmm_quantizer(K)``
feed ``Q @ K^T`` (then ``* head_dim ** -0.5``, masks, softmax, dropout) and ``softmax_quantizer(P)``,
``v_bmm_quantizer(V)`` feed ``P @ V``, whatever ``need_weights`` says (so one calibration serves both); the
returned weights are the quantized ``P`` (averaged over heads when ``average_attn_weights``). The in/out
projections stay float here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._registry import QuantModuleRegistry
from .quant_attention import AttentionQuantMixin, quantized_sdpa


def _pad_key(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else F.pad(mask, (0, 1))


@QuantModuleRegistry.register({nn.MultiheadAttention: "nn.MultiheadAttention"})
class QuantMultiheadAttention(AttentionQuantMixin, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with ``q_bmm``/``k_bmm``/``v_bmm``/``softmax`` quantizers (disabled by default)."""

    _float_cls = nn.MultiheadAttention

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_attention_quantizers()

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
        if not self.attention_quant_active():
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
        self._check_attention_quantizers()
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
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        if not batched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
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
        if self._qkv_same_embed_dim:
            packed = F._in_projection_packed  # type: ignore[attr-defined]
            return packed(query, key, value, self.in_proj_weight, self.in_proj_bias)
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        separate = F._in_projection  # type: ignore[attr-defined]
        return separate(query, key, value, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight, bq, bk, bv)

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
        out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return out.view(tgt_len, bsz, out.size(1)), probs
