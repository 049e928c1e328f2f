"""``modelopt_lite.utils`` (pytorch-quantization's ``pytorch_quantization.utils``): tensor helpers.

:func:`reduce_amax` is the max of ``|x|`` over some dimensions, the amax a max calibrator or a dynamic quantizer
finds for those dimensions (the ones not reduced are the quantization axes).
"""

from __future__ import annotations

import torch

from .functional.checks import check_axes

__all__ = ["reduce_amax"]


def reduce_amax(input: torch.Tensor, axis=None, keepdims: bool = True) -> torch.Tensor:
    """``max(|input|)`` over ``axis`` (an int or a tuple of ints, negatives allowed; None: every dimension).

    Returns a new tensor in the input's dtype (the input is not modified). ``axis=None`` gives a 0-d tensor (as the
    peers do, whatever ``keepdims``); otherwise with ``keepdims`` the reduced dimensions stay with size 1, so the
    result broadcasts against ``input`` as a per-channel amax does. A NaN in a slice gives
    NaN there (as ``torch.amax``). Raises ValueError for more axes than the tensor has, an out-of-range or a
    repeated axis, and TypeError for a non-tensor input.
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"reduce_amax: input must be a torch.Tensor, got {type(input).__name__}")
    if not isinstance(keepdims, bool):
        raise TypeError(f"reduce_amax: keepdims must be a bool, got {keepdims!r}")
    x = input.detach()
    if axis is None:
        return torch.maximum(x.amax(), -x.amin()) if x.numel() else x.new_zeros(())
    items = (axis,) if isinstance(axis, int) else tuple(axis)
    if len(items) > x.dim():
        raise ValueError(
            f"reduce_amax: Cannot reduce more axes than there are axes: axis={axis!r} for a tensor of rank {x.dim()}"
        )
    dims = check_axes(items, x.dim(), "reduce_amax axis")
    if not dims:
        return x.abs()
    return torch.maximum(torch.amax(x, dim=dims, keepdim=keepdims), -torch.amin(x, dim=dims, keepdim=keepdims))
