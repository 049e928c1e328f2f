"""The ``torch.library`` custom ops: one opaque op per kernel, with fake (meta) impls and autograd.

``torch.compile`` and ``torch.export`` see each op as a single node; the data-dependent work (choosing a backend,
the kernels themselves) stays inside it. Ops work on float32 *scales* (see :mod:`.reference`); the public
functions in :mod:`modelopt_lite.tensor_quant` turn amax into scales and validate arguments first.

Ops (namespace ``modelopt_lite``):

- ``fake_quant_int(x, scale, qmin, qmax) -> y``          ``quantize_int(x, scale, qmin, qmax) -> q (float32)``
- ``fake_e4m3(x, scale) -> y``
- ``fake_affine(x, scale, zero_point, qmin, qmax) -> y``  ``quantize_affine(...) -> q (float32)``
- ``fake_quant_uint`` / ``quantize_uint``: the same for unsigned grids, refusing a negative or NaN input (the
  native CPU kernels find min(x) in the quantizing pass itself, the CUDA kernels flag such an element in theirs,
  deferred as :mod:`.deferred_errors` says; the reference checks first, as :func:`.checks.check_unsigned_input`).
  Eager only: see :func:`fuses_unsigned_check`.
- ``int_backward``, ``e4m3_backward``, ``affine_backward``: the STE / learnable-scale gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cuda_args, deferred_errors, eager, onnx_qdq
from .backend import is_native_cuda, kernels_for
from .checks import check_unsigned_input, check_unsigned_min, defer_unsigned_flag
from .devices import device_type

_EMPTY = ()


def _k(x: Tensor, fn: str, scale: Tensor, zero_point=None, qrange=None, grad=None):
    """The kernel ``fn`` for x's device; the CUDA extension's arguments are checked here first (see .cuda_args)."""
    mod = kernels_for(device_type(x))
    if is_native_cuda(mod):
        cuda_args.check_quant(fn, x, scale, zero_point, qrange, grad)
    return getattr(mod, fn)


def _like(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- integer -------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_lite::fake_quant_int", mutates_args=())
def fake_quant_int(x: Tensor, scale: Tensor, qmin: int, qmax: int) -> Tensor:
    return _k(x, "fake_quant_int", scale, qrange=(qmin, qmax))(x, scale, qmin, qmax)


@fake_quant_int.register_fake
def _(x, scale, qmin, qmax):
    return _like(x)


@torch.library.custom_op("modelopt_lite::quantize_int", mutates_args=())
def quantize_int(x: Tensor, scale: Tensor, qmin: int, qmax: int) -> Tensor:
    return _k(x, "quantize_int", scale, qrange=(qmin, qmax))(x, scale, qmin, qmax)


@quantize_int.register_fake
def _(x, scale, qmin, qmax):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


# --- unsigned integer: the non-negative input check in the kernel's own pass ----------------------------------------
def fuses_unsigned_check(x: Tensor) -> bool:
    """Whether an unsigned quantization of ``x`` runs :func:`fake_quant_uint` / :func:`quantize_uint` (the input check
    fused into the kernel's pass): eager calls on a backend whose kernels return min(x) (the native CPU one) or
    flag a negative element (the CUDA one). Under torch.compile / torch.export / ONNX export tracing the plain ops
    run, with the separate check or none."""
    if torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    mod = kernels_for(device_type(x))
    return hasattr(mod, "fake_quant_int_min") or hasattr(mod, "fake_quant_uint_flagged")


def _uint_forward(x: Tensor, scale: Tensor, qmin: int, qmax: int, codes: bool) -> Tensor:
    fn = "quantize_int" if codes else "fake_quant_int"
    mod = kernels_for(device_type(x))
    fused = getattr(mod, fn + "_min", None)
    flagged = getattr(mod, ("quantize_uint" if codes else "fake_quant_uint") + "_flagged", None)
    if fused is None and flagged is not None:  # CUDA: the kernel flags a negative or NaN element in its own pass
        _k(x, fn, scale, qrange=(qmin, qmax))  # the CUDA arguments' checks
        y, flag = flagged(x, scale, qmin, qmax)
        if deferred_errors.deferring(x):
            defer_unsigned_flag(flag, x)
        elif bool(flag.item()):  # "sync" mode: the separate check raises with the minimum
            del y
            check_unsigned_input(x)
            raise ValueError("unsigned quantization of inputs: the input holds a negative value or NaN")
        return y
    if fused is None:  # the reference: the separate check first
        check_unsigned_input(x)
        return _k(x, fn, scale, qrange=(qmin, qmax))(x, scale, qmin, qmax)
    y, m = fused(x, scale, qmin, qmax)  # m: min(x), NaN if x holds a NaN, +inf if x is empty
    if not m >= 0:
        del y  # a refused call's output goes back to the pool now, not with the traceback
        check_unsigned_min(m)
    return y


@torch.library.custom_op("modelopt_lite::fake_quant_uint", mutates_args=())
def fake_quant_uint(x: Tensor, scale: Tensor, qmin: int, qmax: int) -> Tensor:
    return _uint_forward(x, scale, qmin, qmax, False)


@fake_quant_uint.register_fake
def _(x, scale, qmin, qmax):
    return _like(x)


@torch.library.custom_op("modelopt_lite::quantize_uint", mutates_args=())
def quantize_uint(x: Tensor, scale: Tensor, qmin: int, qmax: int) -> Tensor:
    return _uint_forward(x, scale, qmin, qmax, True)


@quantize_uint.register_fake
def _(x, scale, qmin, qmax):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


@torch.library.custom_op("modelopt_lite::int_backward", mutates_args=())
def int_backward(
    grad: Tensor, x: Tensor, scale: Tensor, qmin: int, qmax: int, need_scale_grad: bool
) -> tuple[Tensor, Tensor]:
    kernel = _k(x, "int_backward", scale, qrange=(qmin, qmax), grad=grad)
    gx, gs = kernel(grad, x, scale, qmin, qmax, need_scale_grad)
    return gx, (gs if gs is not None else x.new_empty(0, dtype=torch.float32))


@int_backward.register_fake
def _(grad, x, scale, qmin, qmax, need_scale_grad):
    gs = torch.empty(x.shape if need_scale_grad else (0,), dtype=torch.float32, device=x.device)
    return _like(grad), gs


# --- FP8 E4M3 -------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_lite::fake_e4m3", mutates_args=())
def fake_e4m3(x: Tensor, scale: Tensor) -> Tensor:
    return _k(x, "fake_e4m3", scale)(x, scale)


@fake_e4m3.register_fake
def _(x, scale):
    return _like(x)


@torch.library.custom_op("modelopt_lite::e4m3_backward", mutates_args=())
def e4m3_backward(grad: Tensor, x: Tensor, scale: Tensor, need_scale_grad: bool) -> tuple[Tensor, Tensor]:
    gx, gs = _k(x, "e4m3_backward", scale, grad=grad)(grad, x, scale, need_scale_grad)
    return gx, (gs if gs is not None else x.new_empty(0, dtype=torch.float32))


@e4m3_backward.register_fake
def _(grad, x, scale, need_scale_grad):
    gs = torch.empty(x.shape if need_scale_grad else (0,), dtype=torch.float32, device=x.device)
    return _like(grad), gs


# --- affine ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_lite::fake_affine", mutates_args=())
def fake_affine(x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int) -> Tensor:
    return _k(x, "fake_affine", scale, zero_point, (qmin, qmax))(x, scale, zero_point, qmin, qmax)


@fake_affine.register_fake
def _(x, scale, zero_point, qmin, qmax):
    return _like(x)


@torch.library.custom_op("modelopt_lite::quantize_affine", mutates_args=())
def quantize_affine(x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int) -> Tensor:
    return _k(x, "quantize_affine", scale, zero_point, (qmin, qmax))(x, scale, zero_point, qmin, qmax)


@quantize_affine.register_fake
def _(x, scale, zero_point, qmin, qmax):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


@torch.library.custom_op("modelopt_lite::affine_backward", mutates_args=())
def affine_backward(grad: Tensor, x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int) -> Tensor:
    kernel = _k(x, "affine_backward", scale, zero_point, (qmin, qmax), grad)
    return kernel(grad, x, scale, zero_point, qmin, qmax)


@affine_backward.register_fake
def _(grad, x, scale, zero_point, qmin, qmax):
    return _like(grad)


# --- autograd -------------------------------------------------------------------------------------------------------
def _reduce_to(g: Tensor, like: Tensor) -> Tensor:
    """Sum a per-element gradient down to the (broadcast) shape of ``like``."""
    return g.sum_to_size(like.shape).to(like.dtype)


def _setup_int(ctx, inputs, output):
    x, scale, qmin, qmax = inputs
    ctx.save_for_backward(x, scale)
    ctx.qrange = (qmin, qmax)


def _int_bwd(ctx, grad):
    x, scale = ctx.saved_tensors
    need_s = ctx.needs_input_grad[1]
    gx, gs = eager.call(int_backward, grad.contiguous(), x, scale, *ctx.qrange, need_s)
    return gx, (_reduce_to(gs, scale) if need_s else None), None, None


def _quantize_int_bwd(ctx, grad):  # real quant: STE on the codes, no scale gradient
    x, scale = ctx.saved_tensors
    gx, _ = eager.call(int_backward, grad.contiguous(), x, scale, *ctx.qrange, False)
    return gx.to(x.dtype), None, None, None


def _setup_e4m3(ctx, inputs, output):
    x, scale = inputs
    ctx.save_for_backward(x, scale)


def _e4m3_bwd(ctx, grad):
    x, scale = ctx.saved_tensors
    need_s = ctx.needs_input_grad[1]
    gx, gs = eager.call(e4m3_backward, grad.contiguous(), x, scale, need_s)
    return gx, (_reduce_to(gs, scale) if need_s else None)


def _setup_affine(ctx, inputs, output):
    x, scale, zp, qmin, qmax = inputs
    ctx.save_for_backward(x, scale, zp)
    ctx.qrange = (qmin, qmax)


def _affine_bwd(ctx, grad):
    x, scale, zp = ctx.saved_tensors
    return eager.call(affine_backward, grad.contiguous(), x, scale, zp, *ctx.qrange), None, None, None, None


# (eager.register_autograd: the same autograd for eager.call's direct path)
eager.register_autograd(fake_quant_int, _int_bwd, _setup_int)
eager.register_autograd(quantize_int, _quantize_int_bwd, _setup_int)
eager.register_autograd(fake_quant_uint, _int_bwd, _setup_int)
eager.register_autograd(quantize_uint, _quantize_int_bwd, _setup_int)
eager.register_autograd(fake_e4m3, _e4m3_bwd, _setup_e4m3)
eager.register_autograd(fake_affine, _affine_bwd, _setup_affine)
eager.register_autograd(quantize_affine, _affine_bwd, _setup_affine)


# --- plain torch.onnx.export: standard Q/DQ instead of the opaque ops (see .onnx_qdq) --------------------------------
fake_quant_int = onnx_qdq.export_aware(fake_quant_int, onnx_qdq.fake_quant_int)
fake_e4m3 = onnx_qdq.export_aware(fake_e4m3, onnx_qdq.fake_e4m3)
fake_affine = onnx_qdq.export_aware(fake_affine, onnx_qdq.fake_affine)
