"""Block fake quantization along the last axis in one pass: the ``modelopt_lite::fake_block_last`` op.

``fake_block_last(x, amax, block, kind, bound, qmin, qmax) -> (y, scale)``: per block of ``block`` elements along
the last axis (a partial last block is quantized on its own elements, as the zero padding of :mod:`.blocks` leaves
its amax and outputs unchanged), the block's amax (``amax[..., j]``, a float32 tensor of shape
``x.shape[:-1] + (blocks,)``: static; None: ``max |x|`` of the block, dynamic), ``scale = scale_from_amax(amax,
bound)``, and ``y`` the integer (``kind`` 0: codes in ``[qmin, qmax]``) or E4M3 (``kind`` 1) fake quantization of the
block, in x's dtype; ``scale`` (float32) has amax's shape. Exactly what ``tensor_quant.fake_block_quant(x, {-1:
block}, amax)`` computes through :func:`.blocks.block_amax`, :func:`.scales.scale_from_amax` and the per-block op, bit
for bit, but a backend with a ``fake_block_last`` kernel (the native CPU one) reads x once, never writes a dynamic
amax and runs no per-block tensor ops. A NaN or Inf in x (dynamic) raises the ValueError of
:func:`.blocks.block_amax`, a NaN, Inf or negative static amax the one of :func:`.checks.check_amax_values`.
Gradient: straight-through for x inside each block's grid; none for amax (a static amax that needs a gradient takes
the unfused path) nor the other arguments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import blocks, eager, library
from . import reference as ref
from .backend import kernels_for
from .checks import FLOAT_DTYPES, _compiling, check_amax_values
from .devices import device_type
from .scales import scale_from_amax

KINDS = {"int": 0, "e4m3": 1}


def _blocked(t: Tensor, block: int):
    return blocks.to_blocks(t, {t.dim() - 1: block})


def _amax(x: Tensor, amax: Tensor | None, block: int) -> Tensor:
    """The block amax, validated: the errors of the unfused path."""
    if amax is None:
        return blocks.block_amax(x, {x.dim() - 1: block})
    check_amax_values(amax, "block amax")
    return amax


def _reference(
    x: Tensor, amax: Tensor | None, block: int, kind: int, bound: float, qmin: int, qmax: int
) -> tuple[Tensor, Tensor]:
    scale = scale_from_amax(_amax(x, amax, block), bound)
    xb, pad = _blocked(x, block)
    sb = scale.unsqueeze(-1)
    yb = ref.fake_quant_int(xb, sb, qmin, qmax) if kind == 0 else ref.fake_e4m3(xb, sb)
    return blocks.from_blocks(yb, x.shape, pad).contiguous(), scale


@torch.library.custom_op("modelopt_lite::fake_block_last", mutates_args=())
def fake_block_last(
    x: Tensor, amax: Tensor | None, block: int, kind: int, bound: float, qmin: int, qmax: int
) -> tuple[Tensor, Tensor]:
    fn = getattr(kernels_for(device_type(x)), "fake_block_last", None)
    if fn is None:
        return _reference(x, amax, block, kind, bound, qmin, qmax)
    y, scale, bad = fn(x, amax, block, kind, bound, qmin, qmax)
    if bad:
        _amax(x, amax, block)  # raises the unfused path's ValueError
    return y, scale


@fake_block_last.register_fake
def _(x, amax, block, kind, bound, qmin, qmax):
    nb = -(-x.shape[-1] // block)
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        (*x.shape[:-1], nb), dtype=torch.float32
    )


def _setup(ctx, inputs, output):
    x, _, block, kind, _, qmin, qmax = inputs
    ctx.save_for_backward(x, output[1])
    ctx.args = (block, kind, qmin, qmax)


def _backward(ctx, grad, _grad_scale):
    x, scale = ctx.saved_tensors
    block, kind, qmin, qmax = ctx.args
    xb, pad = _blocked(x, block)
    gb, _ = _blocked(grad, block)
    sb = scale.unsqueeze(-1)
    if kind == 0:
        gx, _ = eager.call(library.int_backward, gb.contiguous(), xb, sb, qmin, qmax, False)
    else:
        gx, _ = eager.call(library.e4m3_backward, gb.contiguous(), xb, sb, False)
    return blocks.from_blocks(gx, x.shape, pad), None, None, None, None, None, None


eager.register_autograd(fake_block_last, _backward, _setup)


def fused_block(x, block_sizes: dict, amax, fmt_name: str | None, unsigned: bool) -> tuple[int, Tensor | None] | None:
    """``(block, amax as float32 or None)`` when ``fake_block_quant(x, block_sizes, amax, ...)`` can run as one
    :func:`fake_block_last` call on a backend with that kernel: one blocked axis (the last), a dynamic amax (None) or
    a static one of the blocks' shape that needs no gradient, no double quantization of the scales, signed integer
    or E4M3 elements, a non-empty float tensor, eager mode (no compile, export or trace). None otherwise (the unfused path, and its errors)."""
    if unsigned or fmt_name not in (None, "e4m3") or _compiling() or torch.jit.is_tracing():
        return None  # (tracing: a plain ONNX export writes the unfused path's standard Q/DQ)
    if not isinstance(x, Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() == 0 or x.numel() == 0:
        return None
    if not isinstance(block_sizes, dict):
        return None  # the unfused path's TypeError
    if any(block_sizes.get(k) is not None for k in ("scale_bits", "scale_block_sizes")):
        return None
    block = blocks.last_axis_block(block_sizes, x.shape)
    if block is None:
        return None
    if amax is not None:
        shape = (*x.shape[:-1], -(-x.shape[-1] // block))
        if not isinstance(amax, Tensor) or not amax.is_floating_point() or tuple(amax.shape) != shape:
            return None
        if amax.numel() == 1 or amax.device != x.device or (amax.requires_grad and torch.is_grad_enabled()):
            return None
        amax = amax.detach().float()
    if getattr(kernels_for(device_type(x)), "fake_block_last", None) is None:
        return None
    return block, amax
