"""Block quantization: cut a tensor into blocks along some axes, each block with its own amax/scale.

``block_sizes = {axis: size}`` (size None = the whole axis). Per-block amax has shape "number of blocks per axis"
(an unblocked axis keeps its full size, i.e. block size 1 there). A last partial block is zero-padded: padding
never changes a block's amax or the output of real elements.

Axis keys are ints; a string that spells an int (``"-1"``, as a JSON object gives) is read as that int. The other
string keys are the settings ``"type"``, ``"scale_bits"``, ``"scale_block_sizes"`` and ``"scale_rounding"``; any
other key is an error (never silently ignored: a dict without an axis would quantize per tensor).
"""

from __future__ import annotations

import math
import numbers
import re

import torch
import torch.nn.functional as F

from .abs_max import abs_max
from .checks import _compiling, check_axes

#: The string keys of a block_sizes dict that are settings, not axes.
SETTING_KEYS = ("type", "scale_bits", "scale_block_sizes", "scale_rounding")
_INT_KEY = re.compile(r"[+-]?\d+")


def _axis_key(k) -> int | None:
    """The axis a block_sizes key names, None for a setting key; ValueError/TypeError for anything else."""
    if type(k) is int:  # the common spelling, without the ABC isinstance checks below (every quantizer call)
        return k
    if isinstance(k, str):
        if k in SETTING_KEYS:
            return None
        if _INT_KEY.fullmatch(k.strip()):
            return int(k)
        raise ValueError(
            f"block_sizes: key {k!r} is neither an axis (an int, or a string spelling one such as '-1') nor one of "
            f"the settings {SETTING_KEYS}"
        )
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"block_sizes: keys must be axes (ints) or one of {SETTING_KEYS}, got {k!r}")
    return int(k)


def axis_sizes(block_sizes) -> dict[int, int | None]:
    """The ``{axis: size}`` entries of a block_sizes dict, keys as ints (``"-1"`` -> ``-1``), settings left out.

    Raises ValueError for a key that is neither an axis nor a setting, an axis given twice (``-1`` and ``"-1"``),
    a size that is not a positive int or None, or a dict without any axis."""
    if not isinstance(block_sizes, dict):
        raise TypeError(f"block_sizes must be a dict {{axis: size, ...}}, got {type(block_sizes).__name__}")
    out: dict[int, int | None] = {}
    for k, v in block_sizes.items():
        axis = _axis_key(k)
        if axis is None:
            continue
        if axis in out:
            raise ValueError(f"block_sizes: axis {axis} is given twice (keys {list(block_sizes)})")
        if (
            v is not None
            and not (type(v) is int and v > 0)
            and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0)
        ):
            raise ValueError(
                f"block_sizes: block size for axis {k!r} must be positive (an int, or None for the whole axis), got {v!r}"
            )
        out[axis] = None if v is None else int(v)
    if not out:
        raise ValueError(f"block_sizes needs at least one {{axis: size}} entry, got {block_sizes!r}")
    return out


def normalize(block_sizes: dict, shape) -> dict[int, int]:
    """``{non-negative axis: size}`` for a tensor of ``shape`` (settings left out, None -> the full axis)."""
    sizes = axis_sizes(block_sizes)
    axes = check_axes(tuple(sizes), len(shape), "block_sizes axis")
    return {a: max(1, shape[a] if v is None else v) for a, v in zip(axes, sizes.values())}


def last_axis_block(block_sizes: dict, shape) -> int | None:
    """The block size when ``block_sizes`` blocks the last axis of ``shape`` and no other (the fused kernels' case),
    else None (errors of :func:`normalize` as there)."""
    sizes = normalize(block_sizes, shape)
    return sizes[len(shape) - 1] if list(sizes) == [len(shape) - 1] else None


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


def inner_dims(ndim: int, sizes: dict[int, int]) -> list[int]:
    """The dims of :func:`to_blocks`'s output that run within one block (reduce over them for one value per block)."""
    out, i = [], 0
    for d in range(ndim):
        if d in sizes:
            out.append(i + 1)
            i += 2
        else:
            i += 1
    return out


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


def block_amax(x: torch.Tensor, block_sizes: dict, what: str = "the input") -> torch.Tensor:
    """max |x| of every block, shaped as the blocks per axis (float32).

    Computed as ``max(max(x), -min(x))`` in x's own dtype (exact: no rounding happens), so a float16/bfloat16
    input needs no float32 copy; the zero padding of a partial block never changes its amax. A block holding NaN
    or Inf raises ValueError naming ``what`` and the block (a dynamic amax must be finite, as the calibrators and
    the per-tensor/per-channel dynamic path require)."""
    sizes = normalize(block_sizes, x.shape)
    if x.numel() == 0:
        return torch.zeros(blocks_shape(x.shape, sizes), dtype=torch.float32, device=x.device)
    xd = x.detach()
    if not xd.is_floating_point():
        xd = xd.to(torch.float64)  # integer data: exact, and -min cannot overflow
    xb, _ = to_blocks(xd, sizes)
    red = inner_dims(x.dim(), sizes)
    a = abs_max(xb, red).float()
    if not _compiling():
        bad = ~torch.isfinite(a)
        if bool(bad.any()):
            idx = tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"{what} contains NaN or Inf, so its block amax is not finite (block {idx} of "
                f"{tuple(a.shape)} blocks has amax {a[idx].item()!r}); clean the input"
            )
    return a
