"""``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` without torch's fused fast paths while quantized.

In eval mode with autograd off, ``nn.TransformerEncoderLayer.forward`` runs the whole layer as one fused op
(``torch._transformer_encoder_layer_fwd``) on the raw parameters of its children, and ``nn.TransformerEncoder``
turns a padded batch into a nested tensor first: every quantized child (``self_attn``, ``linear1``, ``linear2``)
would be bypassed, the model silently running in float (and the fused op has no ONNX export). The quantized
classes here add no quantizer of their own: while any quantizer under them is enabled they run torch's own slow
path (the same ``_sa_block`` / ``_ff_block`` / per-layer loop), so the quantized children act; with every
quantizer disabled they are the float modules (fast paths included: bit-identical).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ._base import _quantizers, recast_copy
from ._registry import QuantModuleRegistry


def _quant_active(module: nn.Module) -> bool:
    return any(q.is_enabled for q in _quantizers(module))


def _masks(src, mask, key_padding_mask, mask_name: str, kpm_name: str):
    """torch's mask canonicalisation (bool or float masks -> float), as at the top of both forwards."""
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name=kpm_name, other_type=F._none_or_dtype(mask), other_name=mask_name,
        target_type=src.dtype,
    )  # fmt: skip
    mask = F._canonical_mask(
        mask=mask, mask_name=mask_name, other_type=None, other_name="", target_type=src.dtype, check_other=False
    )
    return mask, key_padding_mask


class _FromFloat:
    _float_cls: type

    @classmethod
    def from_float(cls, module: nn.Module):
        """A deep copy of ``module`` (exactly ``cls._float_cls``) as ``cls``; its children are converted as usual."""
        return recast_copy(cls, module)


@QuantModuleRegistry.register({nn.TransformerEncoderLayer: "nn.TransformerEncoderLayer"})
class QuantTransformerEncoderLayer(_FromFloat, nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` running its slow path while a quantizer under it is enabled."""

    _float_cls = nn.TransformerEncoderLayer

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        if not _quant_active(self):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        src_mask, src_key_padding_mask = _masks(src, src_mask, src_key_padding_mask, "src_mask", "src_key_padding_mask")
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
        return self.norm2(x + self._ff_block(x))


@QuantModuleRegistry.register({nn.TransformerEncoder: "nn.TransformerEncoder"})
class QuantTransformerEncoder(_FromFloat, nn.TransformerEncoder):
    """``nn.TransformerEncoder`` without the nested-tensor fast path while a quantizer under it is enabled."""

    _float_cls = nn.TransformerEncoder

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        if not _quant_active(self):
            return super().forward(src, mask, src_key_padding_mask, is_causal)
        mask, src_key_padding_mask = _masks(src, mask, src_key_padding_mask, "mask", "src_key_padding_mask")
        batch_first = self.layers[0].self_attn.batch_first
        seq_len = nn.modules.transformer._get_seq_len(src, batch_first)
        is_causal = nn.modules.transformer._detect_is_causal_mask(mask, is_causal, seq_len)
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
        return output if self.norm is None else self.norm(output)
