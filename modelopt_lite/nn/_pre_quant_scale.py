"""The optional ``pre_quant_scale`` of a :class:`~modelopt_lite.nn.TensorQuantizer` (SmoothQuant).

A per-channel float32 vector over the input's last dimension (or one value for every channel): the quantizer
computes ``x * pre_quant_scale``
first, and then collects or quantizes that. It is applied whenever it is set, even with quantization off or the
quantizer disabled, because the layer's weights were rescaled to match (see
:func:`modelopt_lite.algorithms.smoothquant.smooth_quant`). It lives in the ``_pre_quant_scale`` buffer (absent
until set), round-trips through ``state_dict`` (also into a fresh quantizer) and exports as a ``Mul``.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import torch
from torch import nn


class PreQuantScaleState(nn.Module):
    """``pre_quant_scale`` storage for TensorQuantizer (mixed into it; relies on ``_label()`` and ``_device_now()``).

    Accepted values: a 1-D tensor of one value per input channel; a tensor of shape ``(1, ..., 1, C)`` (ModelOpt's
    ``(1, C)``), stored as ``(C,)``; a Python number or a one-element tensor, stored as ``(1,)`` and applied to every
    channel. All are finite and > 0.
    """

    if TYPE_CHECKING:

        def _label(self) -> str: ...

        def _device_now(self) -> torch.device: ...

    @property
    def pre_quant_scale(self) -> torch.Tensor | None:
        """The input multiplier (1-D float32: one value per last-dim channel, or ``(1,)`` for all), or None."""
        return self._buffers.get("_pre_quant_scale")

    @pre_quant_scale.setter
    def pre_quant_scale(self, value) -> None:
        if value is None:
            self._buffers.pop("_pre_quant_scale", None)
            return
        self.register_buffer("_pre_quant_scale", self._checked_pqs(value, self._label()))

    def _checked_pqs(self, value, label: str) -> torch.Tensor:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = torch.tensor([float(value)], dtype=torch.float32)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{label}: pre_quant_scale must be a tensor or None, got {type(value).__name__} "
                "(a number is accepted too)"
            )
        if not value.is_floating_point():
            raise TypeError(f"{label}: pre_quant_scale must be a floating-point tensor, got {value.dtype}")
        if value.numel() == 0 or any(n != 1 for n in value.shape[:-1]):
            raise ValueError(
                f"{label}: pre_quant_scale must be a non-empty 1-D tensor (one value per input channel; (1, C) is "
                f"accepted too) or a single value, got shape {tuple(value.shape)}"
            )
        t = value.detach().to(torch.float32).reshape(-1).clone()
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            raise ValueError(f"{label}: pre_quant_scale must be finite and > 0, got {t[bad][0].item()!r}")
        return t.to(self._device_now())

    def _apply_pre_quant_scale(self, x: torch.Tensor) -> torch.Tensor:
        pqs = self._buffers.get("_pre_quant_scale")
        if pqs is None:
            return x
        if pqs.numel() != 1 and (x.dim() == 0 or x.shape[-1] != pqs.numel()):
            raise ValueError(
                f"{self._label()}: pre_quant_scale has {pqs.numel()} channels but the input's last "
                f"dimension is {x.shape[-1] if x.dim() else 'missing (a scalar)'}"
            )
        return x * (pqs.reshape(()) if pqs.numel() == 1 else pqs).to(x.dtype)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "_pre_quant_scale"
        if key in state_dict:
            cur = self._buffers.get("_pre_quant_scale")
            label = f"{self._label()} at {prefix[:-1] or '<root>'!r}"
            new = self._checked_pqs(state_dict[key], label)
            if cur is not None and cur.shape != new.shape:
                raise ValueError(
                    f"{label}: pre_quant_scale in the state dict has shape {tuple(new.shape)} but this "
                    f"quantizer's has shape {tuple(cur.shape)}"
                )
            if cur is None:
                self.register_buffer("_pre_quant_scale", new)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
