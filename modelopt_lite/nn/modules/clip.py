"""``Clip``: pytorch-quantization's clip module, with optionally learnable (PACT) bounds."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ..functional import clip


def _scalar(value, what: str, learn: bool) -> torch.Tensor | nn.Parameter:
    t = torch.as_tensor(value, dtype=torch.float32).clone()
    if learn:
        if t.numel() != 1:
            raise ValueError(f"Clip: a learnable {what} must be a scalar, got shape {tuple(t.shape)}")
        return nn.Parameter(t.reshape(()))
    return t


class Clip(nn.Module):
    """``clip(x, clip_value_min, clip_value_max)``; with ``learn_min`` / ``learn_max`` the bound is a parameter
    (a scalar) trained with the gradients of :func:`modelopt_lite.nn.functional.clip`."""

    def __init__(self, clip_value_min, clip_value_max, learn_min: bool = False, learn_max: bool = False):
        super().__init__()
        lo = _scalar(clip_value_min, "clip_value_min", learn_min)
        hi = _scalar(clip_value_max, "clip_value_max", learn_max)
        for name, t in (("clip_value_min", lo), ("clip_value_max", hi)):
            if isinstance(t, nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return clip(inputs, self.clip_value_min, self.clip_value_max)

    def extra_repr(self) -> str:
        lo, hi = cast(torch.Tensor, self.clip_value_min), cast(torch.Tensor, self.clip_value_max)
        return f"min={lo.tolist()}, max={hi.tolist()}, learn_min={lo.requires_grad}, learn_max={hi.requires_grad}"
