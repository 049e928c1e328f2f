"""Block quantization: cut a tensor into blocks along some axes, each block with its own amax/scale.

``block_sizes = {axis: size}`` (size None = the whole axis). Per-block amax has shape "number of blocks per axis"
(an unblocked axis keeps its full size, i.e. block size 1 there). A last partial block is zero-padded: padding
never changes a block's amax or the output of real elements.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .checks import check_axes


def normalize(block_sizes: dict, shape) -> dict[int, int]:
    """``{positive axis: size}`` for a tensor of ``shape`` (string keys dropped, None -> full axis)."""
    sizes = {k: v for k, v in block_sizes.items() if not isinstance(k, str)}
    axes = check_axes(tuple(sizes), len(shape), "block_sizes axis")
    out = {}
    for a, (k, v) in zip(axes, sizes.items()):
        size = shape[a] if v is None else v
        if size <= 0:
            raise ValueError(f"block size for axis {k} must be positive, got {v}")
        out[a] = max(1, size)
    return out


def blocks_shape(shape, sizes: dict[int, int]) -> tuple[int, ...]:
    """Shape of the per-block amax: blocks per axis (an unblocked axis keeps its size)."""
    return tuple(math.ceil(n / sizes[d]) if d in sizes else n for d, n in enumerate(shape))


def to_blocks(x: torch.Tensor, sizes: dict[int, int]):
    """A padded view of x with each blocked axis d split into (n_blocks, size). Returns (view, pad)."""
    pad = [(-x.shape[d]) % sizes[d] if d in sizes else 0 for d in range(x.dim())]
    if any(pad):
        spec = []
        for p in reversed(pad):
            spec += [0, p]
        x = F.pad(x, spec)
    view_shape = []
    for d, n in enumerate(x.shape):
        view_shape += [n // sizes[d], sizes[d]] if d in sizes else [n]
    return x.reshape(view_shape), pad


def from_blocks(y: torch.Tensor, orig_shape, pad) -> torch.Tensor:
    padded = [n + p for n, p in zip(orig_shape, pad)]
    y = y.reshape(padded)
    if any(pad):
        y = y[tuple(slice(0, n) for n in orig_shape)]
    return y


def expand_amax(a: torch.Tensor, sizes: dict[int, int]) -> torch.Tensor:
    """Per-block tensor (blocks_shape) -> broadcastable against the :func:`to_blocks` view."""
    shape = []
    for d, n in enumerate(a.shape):
        shape += [n, 1] if d in sizes else [n]
    return a.reshape(shape)


def block_amax(x: torch.Tensor, block_sizes: dict) -> torch.Tensor:
    """max |x| of every block, shaped as the blocks per axis (float32)."""
    sizes = normalize(block_sizes, x.shape)
    xb, _ = to_blocks(x.detach().float().abs(), sizes)
    red = []
    i = 0
    for d in range(x.dim()):
        if d in sizes:
            red.append(i + 1)
            i += 2
        else:
            i += 1
    if xb.numel() == 0:
        return torch.zeros(blocks_shape(x.shape, sizes), dtype=torch.float32, device=x.device)
    return torch.amax(xb, dim=red)
