"""Dynamic block quantization along the last axis as ONE op: on CUDA a fused kernel (block max, scale, quantize in
one pass, ``csrc/block_kernels.cu``), elsewhere the reference composition it is tested against bit for bit.

Ops (namespace ``modelopt_lite``):

- ``fake_block_dynamic(x, block, bound, qmin, qmax, e4m3) -> y``
- ``block_dynamic_backward(grad, x, block, bound, qmin, qmax, e4m3) -> grad_x``

Definition (:func:`fake_block_dynamic_reference`): ``amax = blocks.block_amax(x, {-1: block})`` (a partial last
block is zero-padded; a NaN/Inf block raises ValueError), ``s = scales.scale_from_amax(amax, bound)``, then per block
the integer op ``clamp(rint(x / s), qmin, qmax) * s`` or (``e4m3``) ``e4m3(clamp(x / s, -448, 448)) * s`` of
:mod:`.reference`; the gradient is their straight-through mask (:func:`block_dynamic_backward_reference`). This is
what :func:`modelopt_lite.tensor_quant.fake_block_quant` computes for a dynamic amax (``amax=None``) with
last-axis blocks; it routes CUDA tensors here (:func:`fused_dynamic_args`) so that no amax or scale tensor is
written and read back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import int_range, scaled_float_format
from . import blocks, reference
from .backend import is_native_cuda, kernels_for
from .scales import scale_from_amax

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: Device types routed to the fused kernel (the host-emulated tests add "cpu" with the emulated extension).
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


# --- the reference ---------------------------------------------------------------------------------------------------
def _blocked(x: Tensor, block: int, bound: float, what: str = "the input"):
    sizes = {x.dim() - 1: block}
    scale = scale_from_amax(blocks.block_amax(x, {-1: block}, what), bound)
    xb, pad = blocks.to_blocks(x, sizes)
    return xb, pad, blocks.expand_amax(scale, sizes)


def fake_block_dynamic_reference(x: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool) -> Tensor:
    """The definition (pure torch): block amax, scale, integer or E4M3 fake quant on the zero-padded blocks."""
    xb, pad, sb = _blocked(x, block, bound)
    yb = reference.fake_e4m3(xb, sb) if e4m3 else reference.fake_quant_int(xb, sb, qmin, qmax)
    return blocks.from_blocks(yb, x.shape, pad)


def block_dynamic_backward_reference(
    grad: Tensor, x: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool
) -> Tensor:
    """The straight-through gradient of :func:`fake_block_dynamic_reference` (the block scales get none: the amax
    is computed from ``x.detach()``)."""
    xb, pad, sb = _blocked(x, block, bound)
    gb, _ = blocks.to_blocks(grad, {x.dim() - 1: block})
    if e4m3:
        g, _ = reference.e4m3_backward(gb, xb, sb, False)
    else:
        g, _ = reference.int_backward(gb, xb, sb, qmin, qmax, False)
    return blocks.from_blocks(g, x.shape, pad)


# --- routing ---------------------------------------------------------------------------------------------------------
def fused_device(x) -> bool:
    """Whether x is a tensor on a device the fused kernel serves (CUDA)."""
    return isinstance(x, Tensor) and x.device.type in FUSED_DEVICE_TYPES


def _fused_kernels(x: Tensor, block: int):
    """The CUDA extension when it runs this (dtype, block) fused, else None."""
    if not fused_device(x) or x.dtype not in _DTYPE_NAMES or x.dim() == 0:
        return None
    mod = kernels_for(x.device.type)
    if not is_native_cuda(mod) or not hasattr(mod, "fake_block_dynamic"):
        return None
    return mod if mod.block_dynamic_supported(_DTYPE_NAMES[x.dtype], int(block)) else None


def fused_dynamic_args(x: Tensor, block_sizes: dict, amax, num_bits, unsigned: bool, narrow_range: bool):
    """``(block, bound, qmin, qmax, e4m3)`` when ``fake_block_quant(x, block_sizes, amax, ...)`` can run as
    :func:`fake_block_dynamic` on the fused CUDA kernel (dynamic amax, blocks along the last axis only, no double
    quantization, an integer or E4M3 element, a supported dtype and block size), else None."""
    if amax is not None or unsigned or not fused_device(x) or x.dim() == 0:
        return None
    if block_sizes.get("scale_bits") is not None:
        return None
    sizes = blocks.normalize(block_sizes, x.shape)
    if list(sizes) != [x.dim() - 1]:
        return None
    block = sizes[x.dim() - 1]
    fmt = scaled_float_format(num_bits)
    if fmt is not None:
        if fmt.name != "e4m3":
            return None
        args = (block, float(fmt.bound), -448, 448, True)
    else:
        bound, qmin, qmax = int_range(num_bits, unsigned, narrow_range)
        args = (block, float(bound), int(qmin), int(qmax), False)
    return args if _fused_kernels(x, block) is not None else None


def _checked(x: Tensor, block: int, out) -> Tensor:
    y, flag = out
    if bool(flag.item()):  # the one synchronization: a NaN/Inf block raises the reference's ValueError
        blocks.block_amax(x, {-1: block})
    return y


# --- the ops ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_lite::fake_block_dynamic", mutates_args=())
def fake_block_dynamic(x: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool) -> Tensor:
    mod = _fused_kernels(x, block)
    if mod is None:
        return fake_block_dynamic_reference(x, block, bound, qmin, qmax, e4m3)
    return _checked(x, block, mod.fake_block_dynamic(x, block, bound, qmin, qmax, e4m3))


@fake_block_dynamic.register_fake
def _(x, block, bound, qmin, qmax, e4m3):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("modelopt_lite::block_dynamic_backward", mutates_args=())
def block_dynamic_backward(
    grad: Tensor, x: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool
) -> Tensor:
    mod = _fused_kernels(x, block)
    if mod is None or grad.dtype != x.dtype or grad.shape != x.shape or grad.device != x.device:
        return block_dynamic_backward_reference(grad, x, block, bound, qmin, qmax, e4m3)
    return _checked(x, block, mod.block_dynamic_backward(grad, x, block, bound, qmin, qmax, e4m3))


@block_dynamic_backward.register_fake
def _(grad, x, block, bound, qmin, qmax, e4m3):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, *args = inputs
    ctx.save_for_backward(x)
    ctx.args = tuple(args)


def _bwd(ctx, grad):
    (x,) = ctx.saved_tensors
    return (block_dynamic_backward(grad.contiguous(), x, *ctx.args),) + (None,) * 5


fake_block_dynamic.register_autograd(_bwd, setup_context=_setup)
