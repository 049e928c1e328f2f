"""``torch.library`` ops of static NVFP4: the stored block amaxes and global amax of a calibrated weight quantizer.

Ops (namespace ``modelopt_lite``), numerics in :mod:`.microscaling` (the one NVFP4 reference; ModelOpt's
``StaticBlockScaleQuantizer`` format):

- ``fake_nvfp4_static(x, global_scale, block_amax, block) -> y``
- ``nvfp4_static_backward(grad, x, global_scale, block_amax, block) -> grad_x``

The output is exactly dynamic NVFP4's (``fake_nvfp4``) with each block's ``max |x|`` replaced by its stored amax:
after max calibration on ``x`` the two are bit-identical. The pure-torch reference is the backend on every device
(the native NVFP4 kernels compute their block amaxes from the input). Gradient: STE with clipping, ``dy/dx = 1``
where ``|x| <= 6 * s * gs`` (the block's range), else 0; the amaxes get none here (LSQ: see
:mod:`modelopt_lite.algorithms.lsq`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import eager
from . import microscaling as ref
from .checks import check_input


@torch.library.custom_op("modelopt_lite::fake_nvfp4_static", mutates_args=())
def fake_nvfp4_static(x: Tensor, global_scale: Tensor, block_amax: Tensor, block: int) -> Tensor:
    return ref.fake_nvfp4(x.contiguous(), global_scale, block, block_amax)


@fake_nvfp4_static.register_fake
def _(x, global_scale, block_amax, block):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("modelopt_lite::nvfp4_static_backward", mutates_args=())
def nvfp4_static_backward(grad: Tensor, x: Tensor, global_scale: Tensor, block_amax: Tensor, block: int) -> Tensor:
    return ref.nvfp4_backward(grad.contiguous(), x.contiguous(), global_scale, block, block_amax)


@nvfp4_static_backward.register_fake
def _(grad, x, global_scale, block_amax, block):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, gs, a, block = inputs
    ctx.save_for_backward(x, gs, a)
    ctx.block = block


def _bwd(ctx, grad):
    x, gs, a = ctx.saved_tensors
    return eager.call(nvfp4_static_backward, grad.contiguous(), x, gs, a, ctx.block), None, None, None


eager.register_autograd(fake_nvfp4_static, _bwd, _setup)


def nvfp4_static_fake_quant(x: Tensor, block_amax, global_amax, block: int = 16, what: str = "inputs") -> Tensor:
    """Static NVFP4 quantize-dequantize of ``x`` with its stored ``block_amax`` (shape ``(*x.shape[:-1], nblocks)``)
    and per-tensor ``global_amax``. ValueError for a bad input, block size, amax shape or amax value."""
    check_input(x, what)
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension (NVFP4 blocks run along the last axis)")
    ref._check_block(block, ref.NVFP4_BLOCK_SIZES, "NVFP4")
    g = torch.as_tensor(global_amax, dtype=torch.float32).detach()
    if g.numel() != 1:
        raise ValueError(f"NVFP4 global amax must be per tensor (one value), got shape {tuple(g.shape)}")
    gs = ref.nvfp4_global_scale(g.reshape(()).to(x.device))
    a = ref.check_nvfp4_block_amax(torch.as_tensor(block_amax).detach(), x, block)
    return eager.call(fake_nvfp4_static, x, gs, a, block)
