"""Static NVFP4 with learnable block amaxes (LSQ, ModelOpt's ``StaticBlockScaleQuantizer.enable_lsq`` form).

``y = e2m1(x / ds_pre) * ds_post``, the block scales from separate quantize (``pre``) and dequantize (``post``) block
amaxes under the fixed global scale ``gs = global_amax / 2688``:

- quantized scale (``quantize=True``, NVFP4's): ``ds = e4m3(min(a / (6 * gs), 448)) * gs``, exactly the static
  NVFP4 block scale of :mod:`.microscaling` (with ``a_pre == a_post`` the output is bit-identical to
  ``fake_nvfp4(x, gs, block, block_amax=a)``);
- unquantized (``quantize=False``, ModelOpt's ``quantize_pre_scale=False`` for the pre scale): ``ds = a / 6``.

Gradients (straight-through, differentiable torch ops): the E4M3 rounding of the scale passes its gradient, the
``448`` clamp stops it; the E2M1 rounding passes the gradient of ``v = x / ds_pre`` where ``|v| <= 6``, else 0.
So ``dy/da_post = q / 6`` (``q = e2m1(v)``) and ``dy/da_pre = -ds_post * x / ds_pre**2 / 6`` where ``|v| <= 6``,
each summed over its block. Dead blocks (``ds_pre == 0``) output 0. Everything is float32; ``y`` has x's dtype.
"""

from __future__ import annotations

import torch

from ..formats import E2M1_MAX, E4M3_MAX, e2m1_round
from .division import true_div
from .microscaling import _blocks, _unblock


def lsq_block_scale(a: torch.Tensor, gs: torch.Tensor, quantize: bool) -> torch.Tensor:
    """The per-block scale ``ds`` (differentiable in ``a``; see the module docstring)."""
    a = a.float()
    if not quantize:
        return true_div(a, E2M1_MAX)
    d = gs * E2M1_MAX
    safe = torch.where(d == 0, torch.ones_like(d), d)
    r = (a / safe).clamp(max=E4M3_MAX)
    s = r.detach().to(torch.float8_e4m3fn).float() + (r - r.detach())  # E4M3 rounding, straight-through (+0 exactly)
    return torch.where(d == 0, torch.zeros_like(s), s) * gs


def fake_nvfp4_lsq(
    x: torch.Tensor,
    amax_pre: torch.Tensor,
    amax_post: torch.Tensor,
    gs: torch.Tensor,
    block: int,
    quantize_pre: bool = True,
    quantize_post: bool = True,
) -> torch.Tensor:
    """``e2m1(x / ds_pre) * ds_post`` per block of ``block`` along the last axis; amaxes ``(*x.shape[:-1], nblocks)``."""
    ds_pre = lsq_block_scale(amax_pre, gs, quantize_pre).unsqueeze(-1)
    ds_post = lsq_block_scale(amax_post, gs, quantize_post).unsqueeze(-1)
    xb = _blocks(x, block)
    dead = ds_pre == 0
    v = xb / torch.where(dead, torch.ones_like(ds_pre), ds_pre)
    inside = v.detach().abs() <= E2M1_MAX
    v_pass = torch.where(inside, v, v.detach())  # the gradient passes where the element is inside the range
    q = e2m1_round(v.detach()) + (v_pass - v_pass.detach())  # the value is e2m1(v) exactly
    y = (q * ds_post).masked_fill(dead, 0.0)
    return _unblock(y, x.shape[-1]).to(x.dtype)
