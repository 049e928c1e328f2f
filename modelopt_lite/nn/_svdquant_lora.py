"""The optional SVDQuant low-rank factors of a weight :class:`~modelopt_lite.nn.TensorQuantizer`.

SVDQuant (:mod:`modelopt_lite.algorithms.svdquant`) splits a Linear weight into a float low-rank part and a
quantized residual: ``W = svdquant_lora_b @ svdquant_lora_a + R``; the layer keeps ``R`` as its weight and adds
``F.linear(F.linear(x_s, svdquant_lora_a), svdquant_lora_b)`` to its output, where ``x_s`` is its input after the
input quantizer's ``pre_quant_scale`` (the float input, not quantized). As in ModelOpt, the factors live on the
weight quantizer: ``svdquant_lora_a`` of shape ``(rank, in_features)`` in the buffer ``_svdquant_lora_a`` and
``svdquant_lora_b`` of shape ``(out_features, rank)`` in ``_svdquant_lora_b`` (absent until set; state_dict keys
``<layer>.weight_quantizer._svdquant_lora_a`` / ``_b``). They round-trip through ``state_dict`` (also into a fresh
quantizer) and export to ONNX as two float MatMuls beside the Q/DQ weight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ._pre_quant_scale import PreQuantScaleState

#: the buffer names (ModelOpt's)
LORA_A, LORA_B = "_svdquant_lora_a", "_svdquant_lora_b"


class LowRankState(nn.Module):
    """``svdquant_lora_a`` / ``svdquant_lora_b`` storage for TensorQuantizer (mixed into it; relies on ``_label()``).

    Accepted values: floating-point 2-D tensors with finite values, stored as float32 (as every quantizer tensor;
    ModelOpt keeps the weight's dtype) on the quantizer's device. Setting None removes a factor. The two factors must agree on the rank when both
    are set; :func:`lowrank_output` checks them against the layer.
    """

    if TYPE_CHECKING:

        def _label(self) -> str: ...

        def _device_now(self) -> torch.device: ...

    @property
    def svdquant_lora_a(self) -> torch.Tensor | None:
        """``(rank, in_features)``: the first factor, applied to the layer's (scaled) input; or None."""
        return self._buffers.get(LORA_A)

    @svdquant_lora_a.setter
    def svdquant_lora_a(self, value) -> None:
        self._set_factor(LORA_A, value)

    @property
    def svdquant_lora_b(self) -> torch.Tensor | None:
        """``(out_features, rank)``: the second factor (U times the singular values); or None."""
        return self._buffers.get(LORA_B)

    @svdquant_lora_b.setter
    def svdquant_lora_b(self, value) -> None:
        self._set_factor(LORA_B, value)

    @property
    def has_lowrank(self) -> bool:
        """Whether both SVDQuant factors are set (the layer then adds the low-rank branch)."""
        return LORA_A in self._buffers and LORA_B in self._buffers

    def _set_factor(self, key: str, value) -> None:
        if value is None:
            self._buffers.pop(key, None)
            return
        self.register_buffer(key, checked_factor(value, f"{self._label()}: {key[1:]}").to(self._device_now()))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        for key in (LORA_A, LORA_B):
            if prefix + key in state_dict:
                label = f"{self._label()} at {prefix[:-1] or '<root>'!r}: {key[1:]}"
                new = checked_factor(state_dict[prefix + key], label)
                cur = self._buffers.get(key)
                if cur is not None and cur.shape != new.shape:
                    raise ValueError(
                        f"{label} in the state dict has shape {tuple(new.shape)} but this quantizer's has shape "
                        f"{tuple(cur.shape)}"
                    )
                if cur is None:
                    self.register_buffer(key, new)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def checked_factor(value, label: str) -> torch.Tensor:
    """A detached, contiguous float32 copy of a low-rank factor (TypeError/ValueError naming ``label`` when it is not
    a finite 2-D float tensor). Contiguous whatever the caller's layout (e.g. a slice of ``torch.linalg.svd``'s
    column-major ``V^T``), so the branch's GEMMs, and thus its bits, do not depend on it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{label} must be a tensor or None, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{label} must be a floating-point tensor, got {value.dtype}")
    if value.dim() != 2 or value.numel() == 0:
        raise ValueError(f"{label} must be a non-empty 2-D tensor, got shape {tuple(value.shape)}")
    t = value.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)  # layout-free forward
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{label} must be finite, got {t[~torch.isfinite(t)][0].item()!r}")
    return t


def lowrank_output(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The low-rank branch ``F.linear(F.linear(x_s, A), B)`` of a quantized Linear with SVDQuant factors (None
    without them); ``x_s`` is ``x`` times the input quantizer's ``pre_quant_scale``, in float."""
    wq = getattr(module, "weight_quantizer", None)
    if not isinstance(wq, LowRankState) or not wq.has_lowrank:
        return None
    a, b = wq.svdquant_lora_a, wq.svdquant_lora_b
    w = module.weight
    assert isinstance(w, torch.Tensor) and a is not None and b is not None
    if a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"{type(module).__name__}: the SVDQuant factors svdquant_lora_a {tuple(a.shape)} and svdquant_lora_b "
            f"{tuple(b.shape)} do not fit the weight {tuple(w.shape)} (need (rank, in) and (out, rank))"
        )
    iq = module.input_quantizer
    xs = iq._apply_pre_quant_scale(x) if isinstance(iq, PreQuantScaleState) else x
    return nn.functional.linear(nn.functional.linear(xs, a.to(xs.dtype)), b.to(xs.dtype))
