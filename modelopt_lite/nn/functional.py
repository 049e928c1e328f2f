"""``modelopt_lite.nn.functional`` (pytorch-quantization's ``pytorch_quantization.nn.functional``): ``clip``.

``clip(x, clip_value_min, clip_value_max)`` is ``min(max(x, min), max)`` with the gradients of a learnable clip
(PACT): ``dL/dx = g`` where ``min < x < max`` and 0 elsewhere; ``dL/dmin = sum(g where x <= min)`` and
``dL/dmax = sum(g where x >= max)``. Learnable bounds must be scalars (one value for the whole tensor).
"""

from __future__ import annotations

import torch

__all__ = ["ClipFunction", "clip"]


def _bound(v, like: torch.Tensor, what: str) -> torch.Tensor:
    t = v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=like.dtype, device=like.device)
    if torch.isnan(t).any():
        raise ValueError(f"clip: {what} is NaN")
    return t


class ClipFunction(torch.autograd.Function):
    """Clip with straight-through gradients inside the range and summed gradients for the bounds."""

    @staticmethod
    def forward(ctx, input, clip_value_min, clip_value_max):
        ctx.save_for_backward(input, clip_value_min, clip_value_max)
        return torch.maximum(torch.minimum(input, clip_value_max), clip_value_min)

    @staticmethod
    def backward(ctx, grad_output):
        x, lo, hi = ctx.saved_tensors
        above_lo = x > lo
        below_hi = x < hi
        grad_input = grad_output * (above_lo & below_hi).to(grad_output.dtype)
        grad_lo = grad_hi = None
        for bound, what in ((lo, "clip_value_min"), (hi, "clip_value_max")):
            if ctx.needs_input_grad[1 if what == "clip_value_min" else 2] and bound.numel() != 1:
                raise ValueError(f"clip: a learnable {what} must be a scalar, got shape {tuple(bound.shape)}")
        if ctx.needs_input_grad[1]:
            grad_lo = grad_output.masked_fill(above_lo, 0).sum().reshape(lo.shape)
        if ctx.needs_input_grad[2]:
            grad_hi = grad_output.masked_fill(below_hi, 0).sum().reshape(hi.shape)
        return grad_input, grad_lo, grad_hi


def clip(input: torch.Tensor, clip_value_min, clip_value_max) -> torch.Tensor:
    """``input`` clipped to ``[clip_value_min, clip_value_max]`` (tensors broadcast, or Python numbers).

    Raises:
        ValueError: a NaN bound, or ``clip_value_min > clip_value_max`` somewhere.
    """
    lo = _bound(clip_value_min, input, "clip_value_min")
    hi = _bound(clip_value_max, input, "clip_value_max")
    if bool((lo > hi).any()):
        raise ValueError(f"clip: clip_value_min must be <= clip_value_max, got {lo.tolist()} > {hi.tolist()}")
    return ClipFunction.apply(input, lo, hi)
