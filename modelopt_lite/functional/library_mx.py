"""``torch.library`` ops of the NVFP4 and OCP MX formats, with fake (meta) impls and straight-through gradients.

Ops (namespace ``modelopt_lite``), numerics in :mod:`.microscaling`:

- ``fake_nvfp4(x, global_scale, block) -> y``         ``nvfp4_backward(grad, x, global_scale, block) -> grad_x``
- ``fake_mx(x, elem, block, rounding) -> y``          ``mx_backward(grad, x, elem, block, rounding) -> grad_x``
- ``fake_nvfp4_amax(x, amax, block) -> y``            ``nvfp4_backward_amax(grad, x, amax, block) -> grad_x``: NVFP4
  of the per-tensor amax, ``global_scale = nvfp4_global_scale(amax)``; on CUDA the kernel computes it (no scale
  launches) and flags a bad amax. :func:`nvfp4_fake_quant` takes them on CUDA with deferred checks.

A backend whose kernel module (see :mod:`.backend`) defines a function of the same name runs it (the native
kernels are tested bit for bit against the reference); otherwise the pure-torch reference runs.

Gradient (STE with clipping, as the integer and E4M3 ops): ``dy/dx = 1`` where ``|x|`` lies within the block's
range, ``6 * s * gs`` (NVFP4) or ``elem_max * 2**k`` (MX), else 0; dead blocks pass only ``x == 0``. The scales
get no gradient (the global amax is calibrated, the MX scales are dynamic).

:func:`nvfp4_fake_quant` and :func:`mx_fake_quant` are the validated entry points the quantizers call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cuda_args, deferred_errors, eager
from . import microscaling as ref
from .backend import is_native_cuda, kernels_for
from .checks import check_input
from .devices import device_type


def _impl(x: Tensor, name: str):
    return getattr(kernels_for(device_type(x)), name, None) or getattr(ref, name)


def _cuda_fn(x: Tensor, name: str):
    """The CUDA extension's function ``name`` for x, or None (another backend, or an extension built without it)."""
    mod = kernels_for(device_type(x))
    return getattr(mod, name, None) if is_native_cuda(mod) else None


def _like(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_NONFINITE = "contains NaN or Inf; NVFP4/MX formats cannot represent it: clean the input"
#: the deferred errors of the kernels' flag bits (the sync mode's texts without the bad value)
NVFP4_MESSAGES = {
    1: f"NVFP4 input {_NONFINITE}",
    2: "NVFP4 global amax must be finite and >= 0 (its global scale is not)",
}
MX_MESSAGES = {e: {1: f"MX ({e}) input {_NONFINITE}"} for e in ref.MX_ELEMENTS}
NVFP4_AMAX_MESSAGES = {1: NVFP4_MESSAGES[1], 2: "NVFP4 global amax must be finite and >= 0"}


def _cuda_route(x: Tensor, name: str):
    """``(mod, flagged)``: ``mod`` the CUDA extension when it runs ``name`` for x (whose arguments the caller then
    checks first), else None; ``flagged`` its ``name + "_flagged"`` (returns the kernel's flag unread) when x's value
    checks are deferred (:mod:`.deferred_errors`), else None (the plain function reads the flag and raises at once).
    One backend lookup: this runs on every call."""
    mod = kernels_for(device_type(x))
    if not is_native_cuda(mod) or not hasattr(mod, name):
        return None, None
    return mod, (getattr(mod, name + "_flagged", None) if deferred_errors.deferring(x) else None)


def _run_flagged(fn, args: tuple, x: Tensor, op: str, messages) -> Tensor:
    y, flag = fn(*args)
    deferred_errors.defer(flag, op, messages, x)
    return y


@torch.library.custom_op("modelopt_lite::fake_nvfp4", mutates_args=())
def fake_nvfp4(x: Tensor, global_scale: Tensor, block: int) -> Tensor:
    mod, flagged = _cuda_route(x, "fake_nvfp4")
    if mod is not None:
        cuda_args.check_nvfp4(x, global_scale, block)
        if flagged is not None:
            return _run_flagged(flagged, (x.contiguous(), global_scale, block), x, "fake_nvfp4", NVFP4_MESSAGES)
    return _impl(x, "fake_nvfp4")(x.contiguous(), global_scale, block)


@fake_nvfp4.register_fake
def _(x, global_scale, block):
    return _like(x)


def _bwd_impl(grad: Tensor, x: Tensor, name: str):
    """The backward kernel: the CUDA extension's when grad matches x (dtype, shape, device), else the reference."""
    if _cuda_fn(x, name) is not None and not (
        grad.dtype == x.dtype and grad.shape == x.shape and grad.device == x.device
    ):
        return getattr(ref, name)
    return _impl(x, name)


@torch.library.custom_op("modelopt_lite::nvfp4_backward", mutates_args=())
def nvfp4_backward(grad: Tensor, x: Tensor, global_scale: Tensor, block: int) -> Tensor:
    mod, flagged = _cuda_route(x, "nvfp4_backward")
    if mod is not None:
        cuda_args.check_nvfp4(x, global_scale, block)
        cuda_args.check_grad(grad, x)
        if flagged is not None and grad.dtype == x.dtype:
            args = (grad, x.contiguous(), global_scale, block)
            return _run_flagged(flagged, args, x, "nvfp4_backward", NVFP4_MESSAGES)
    return _bwd_impl(grad, x, "nvfp4_backward")(grad, x.contiguous(), global_scale, block)


@nvfp4_backward.register_fake
def _(grad, x, global_scale, block):
    return _like(grad)


@torch.library.custom_op("modelopt_lite::fake_mx", mutates_args=())
def fake_mx(x: Tensor, elem: str, block: int, rounding: str) -> Tensor:
    mod, flagged = _cuda_route(x, "fake_mx")
    if mod is not None:
        cuda_args.check_mx(x, elem, block, rounding)
        if flagged is not None:
            return _run_flagged(flagged, (x.contiguous(), elem, block, rounding), x, "fake_mx", MX_MESSAGES[elem])
    return _impl(x, "fake_mx")(x.contiguous(), elem, block, rounding)


@fake_mx.register_fake
def _(x, elem, block, rounding):
    return _like(x)


@torch.library.custom_op("modelopt_lite::mx_backward", mutates_args=())
def mx_backward(grad: Tensor, x: Tensor, elem: str, block: int, rounding: str) -> Tensor:
    mod, flagged = _cuda_route(x, "mx_backward")
    if mod is not None:
        cuda_args.check_mx(x, elem, block, rounding)
        cuda_args.check_grad(grad, x)
        if flagged is not None and grad.dtype == x.dtype:
            args = (grad, x.contiguous(), elem, block, rounding)
            return _run_flagged(flagged, args, x, "mx_backward", MX_MESSAGES[elem])
    return _bwd_impl(grad, x, "mx_backward")(grad, x.contiguous(), elem, block, rounding)


@mx_backward.register_fake
def _(grad, x, elem, block, rounding):
    return _like(grad)


# --- NVFP4 of the per-tensor amax: the global scale computed in the kernel -------------------------------------------
def _raise_nvfp4_amax(x: Tensor, amax: Tensor, block: int) -> None:
    """The sync mode's ValueError for a set flag of the *_amax kernels: the reference's checks and messages."""
    ref.fake_nvfp4(x, ref.nvfp4_global_scale(amax.to(x.device)), block)
    raise ValueError(f"NVFP4 kernel flagged a bad input or amax that the reference accepts (amax {amax!r})")


def _global_scale(amax: Tensor, x: Tensor) -> Tensor:
    """The reference's checked global scale of a per-tensor amax on x's device (where no *_amax kernel runs)."""
    return ref.nvfp4_global_scale(amax.detach().float().reshape(()).to(x.device))


@torch.library.custom_op("modelopt_lite::fake_nvfp4_amax", mutates_args=())
def fake_nvfp4_amax(x: Tensor, amax: Tensor, block: int) -> Tensor:
    fn = _cuda_fn(x, "fake_nvfp4_amax_flagged")
    if fn is None:
        return _impl(x, "fake_nvfp4")(x.contiguous(), _global_scale(amax, x), block)
    cuda_args.check_nvfp4(x, amax, block)
    y, flag = fn(x.contiguous(), amax, block)
    deferred_errors.check_flag(flag, lambda: _raise_nvfp4_amax(x, amax, block), "fake_nvfp4", NVFP4_AMAX_MESSAGES, x)
    return y


@fake_nvfp4_amax.register_fake
def _(x, amax, block):
    return _like(x)


@torch.library.custom_op("modelopt_lite::nvfp4_backward_amax", mutates_args=())
def nvfp4_backward_amax(grad: Tensor, x: Tensor, amax: Tensor, block: int) -> Tensor:
    fn = _cuda_fn(x, "nvfp4_backward_amax_flagged")
    if fn is None or not (grad.dtype == x.dtype and grad.shape == x.shape and grad.device == x.device):
        return _bwd_impl(grad, x, "nvfp4_backward")(grad, x.contiguous(), _global_scale(amax, x), block)
    cuda_args.check_nvfp4(x, amax, block)
    gx, flag = fn(grad, x.contiguous(), amax, block)
    deferred_errors.check_flag(
        flag, lambda: _raise_nvfp4_amax(x, amax, block), "nvfp4_backward", NVFP4_AMAX_MESSAGES, x
    )
    return gx


@nvfp4_backward_amax.register_fake
def _(grad, x, amax, block):
    return _like(grad)


def _nvfp4_amax_bwd(ctx, grad):
    x, amax = ctx.saved_tensors
    return eager.call(nvfp4_backward_amax, grad.contiguous(), x, amax, ctx.block), None, None


def _setup_nvfp4(ctx, inputs, output):
    x, gs, block = inputs
    ctx.save_for_backward(x, gs)
    ctx.block = block


def _nvfp4_bwd(ctx, grad):
    x, gs = ctx.saved_tensors
    return eager.call(nvfp4_backward, grad.contiguous(), x, gs, ctx.block), None, None


def _setup_mx(ctx, inputs, output):
    x, elem, block, rounding = inputs
    ctx.save_for_backward(x)
    ctx.args = (elem, block, rounding)


def _mx_bwd(ctx, grad):
    (x,) = ctx.saved_tensors
    return eager.call(mx_backward, grad.contiguous(), x, *ctx.args), None, None, None


eager.register_autograd(fake_nvfp4, _nvfp4_bwd, _setup_nvfp4)
eager.register_autograd(fake_mx, _mx_bwd, _setup_mx)
eager.register_autograd(fake_nvfp4_amax, _nvfp4_amax_bwd, _setup_nvfp4)


# --- validated entry points ----------------------------------------------------------------------------------------
def _check(x: Tensor, what: str, block: int, allowed: tuple[int, ...], fmt: str) -> None:
    check_input(x, what)
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension ({fmt} blocks run along the last axis)")
    ref._check_block(block, allowed, fmt)
    # NaN/Inf: the native kernels (in their block-max pass) and the reference raise the ValueError themselves, so
    # no separate pass over x here (it cost 2x the kernel's time)


def nvfp4_fake_quant(x: Tensor, amax, block: int = 16, what: str = "inputs") -> Tensor:
    """NVFP4 quantize-dequantize of ``x`` with the per-tensor (global) ``amax`` (a number or a one-element tensor)."""
    _check(x, what, block, ref.NVFP4_BLOCK_SIZES, "NVFP4")
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device) if not isinstance(amax, Tensor) else amax
    if a.numel() != 1:
        raise ValueError(f"NVFP4 amax must be per tensor (one value), got shape {tuple(a.shape)}")
    # (deferring first: False under torch.compile, which must not trace the extension's loading)
    if x.numel() and deferred_errors.deferring(x) and _cuda_fn(x, "fake_nvfp4_amax_flagged") is not None:
        # CUDA, checks deferred: the kernel computes the global scale and flags a bad amax itself (no scale
        # launches, no host read of amax)
        return eager.call(fake_nvfp4_amax, x, a.detach(), block)
    return eager.call(fake_nvfp4, x, _global_scale(a, x), block)


def mx_fake_quant(x: Tensor, elem: str, block: int = 32, rounding: str = "floor", what: str = "inputs") -> Tensor:
    """OCP MX quantize-dequantize of ``x`` (``elem`` in "e4m3", "e5m2", "e2m1", "int8")."""
    ref._element(elem)
    ref._check_rounding(rounding)
    _check(x, what, block, ref.MX_BLOCK_SIZES, "MX")
    return eager.call(fake_mx, x, elem, block, rounding)


def scheme_fake_quant(x: Tensor, scheme, block_sizes, amax, fake_quant: bool = True) -> Tensor:
    """Quantize ``x`` with a :class:`~modelopt_lite.formats.BlockScheme` (NVFP4: ``amax`` is the per-tensor global
    amax; MX: dynamic, ``amax`` unused; E8M0 scales rounded by the scheme's rule, ``scheme.rounding``)."""
    if not fake_quant:
        raise ValueError(
            f"{scheme.name.upper()} real quantization returns packed codes and block scales: use "
            "modelopt_lite.functional.microscaling.quantize_nvfp4/quantize_mx (fake_quant=True here)"
        )
    block = int(block_sizes[-1])
    if scheme.kind == "nvfp4":
        return nvfp4_fake_quant(x, amax, block)
    return mx_fake_quant(x, scheme.elem, block, scheme.rounding)
