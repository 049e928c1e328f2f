"""Block quantization along the last axis as ONE op: on CUDA a fused kernel (block max or the given block amax,
scale, quantize in one pass, ``csrc/block_kernels.cu``), elsewhere the reference composition it is tested against
bit for bit.

Ops (namespace ``modelopt_lite``):

- ``fake_block_dynamic(x, block, bound, qmin, qmax, e4m3, scale_kind, scale_bound, scale_qmax) -> y``
- ``block_dynamic_backward(grad, x, <the same>) -> grad_x``
- ``fake_block_static(x, amax, block, bound, qmin, qmax, e4m3) -> y`` and ``block_static_backward(grad, x, amax,
  <the same>) -> grad_x``: the same with a static float32 block amax of shape ``x.shape[:-1] + (blocks,)``, checked
  as :func:`.checks.check_amax_values` does (NaN, Inf or < 0: the unfused path's ValueError, "block amax must be
  finite and >= 0"), x's own NaN/Inf passing through the element ops as in the unfused path. The kernel reads the
  amax where the unfused path launched a scale kernel, wrote the scale tensor and read it back.

Definition (:func:`fake_block_dynamic_reference`): ``amax = blocks.block_amax(x, {-1: block})`` (a partial last
block is zero-padded; a NaN/Inf block raises ValueError), ``s = scales.scale_from_amax(amax, bound)``, then per block
the integer op ``clamp(rint(x / s), qmin, qmax) * s`` or (``e4m3``) ``e4m3(clamp(x / s, -448, 448)) * s`` of
:mod:`.reference`; the gradient is their straight-through mask (:func:`block_dynamic_backward_reference`). Double
quantization (``scale_kind`` 1: unsigned integer scale codes ``0..scale_qmax``, 2: E4M3 scale codes; 0: none) first
fake-quantizes the block scales with ``scale_from_amax(max(scales), scale_bound)``, as
:func:`modelopt_lite.tensor_quant.quantize_block_scales` does (the CUDA kernel then reads x twice: the scales' scale
depends on every block). This is
what :func:`modelopt_lite.tensor_quant.fake_block_quant` computes for a dynamic amax (``amax=None``) with
last-axis blocks; it routes CUDA tensors here (:func:`fused_dynamic_args`) so that no amax or scale tensor is
written and read back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import int_range, scaled_float_format
from . import blocks, deferred_errors, eager, reference
from .backend import is_native_cuda, kernels_for
from .checks import check_amax_values, deferred_amax_messages
from .devices import device_type
from .scales import scale_from_amax

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: the name of a static block amax in its errors (the unfused path's, tensor_quant.block_scales)
STATIC_WHAT = "block amax"
#: Device types routed to the fused kernel (the host-emulated tests add "cpu" with the emulated extension).
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


# --- the reference ---------------------------------------------------------------------------------------------------
def _blocked(
    x: Tensor, block: int, bound: float, scale_kind: int, scale_bound: float, scale_qmax: int
) -> tuple[Tensor, list[int], Tensor]:
    sizes = {x.dim() - 1: block}
    scale = scale_from_amax(blocks.block_amax(x, {-1: block}), bound)
    if scale_kind:
        s_amax = scale.reshape(-1).amax(0) if scale.numel() else scale.new_zeros(())
        ss = scale_from_amax(s_amax, scale_bound)
        if scale_kind == 2:
            scale = reference.fake_e4m3(scale, ss)
        else:
            scale = reference.fake_quant_int(scale, ss, 0, scale_qmax)
    xb, pad = blocks.to_blocks(x, sizes)
    return xb, pad, blocks.expand_amax(scale, sizes)


def _fake(x: Tensor, xb: Tensor, pad: list[int], sb: Tensor, qmin: int, qmax: int, e4m3: bool) -> Tensor:
    """The integer or E4M3 fake quant of the blocks ``xb`` of x with their scales ``sb``, back in x's shape."""
    yb = reference.fake_e4m3(xb, sb) if e4m3 else reference.fake_quant_int(xb, sb, qmin, qmax)
    return blocks.from_blocks(yb, x.shape, pad)


def _ste(
    grad: Tensor, x: Tensor, block: int, xb: Tensor, pad: list[int], sb: Tensor, qmin: int, qmax: int, e4m3: bool
) -> Tensor:
    """The straight-through gradient of :func:`_fake` for ``grad`` (no gradient for the scales)."""
    gb, _ = blocks.to_blocks(grad, {x.dim() - 1: block})
    if e4m3:
        g, _ = reference.e4m3_backward(gb, xb, sb, False)
    else:
        g, _ = reference.int_backward(gb, xb, sb, qmin, qmax, False)
    return blocks.from_blocks(g, x.shape, pad)


def fake_block_dynamic_reference(
    x: Tensor,
    block: int,
    bound: float,
    qmin: int,
    qmax: int,
    e4m3: bool,
    scale_kind: int = 0,
    scale_bound: float = 0.0,
    scale_qmax: int = 0,
) -> Tensor:
    """The definition (pure torch): block amax, scale (double-quantized if asked), integer or E4M3 fake quant on
    the zero-padded blocks."""
    return _fake(x, *_blocked(x, block, bound, scale_kind, scale_bound, scale_qmax), qmin, qmax, e4m3)


def block_dynamic_backward_reference(
    grad: Tensor,
    x: Tensor,
    block: int,
    bound: float,
    qmin: int,
    qmax: int,
    e4m3: bool,
    scale_kind: int = 0,
    scale_bound: float = 0.0,
    scale_qmax: int = 0,
) -> Tensor:
    """The straight-through gradient of :func:`fake_block_dynamic_reference` (the block scales get none: the amax
    is computed from ``x.detach()``)."""
    return _ste(grad, x, block, *_blocked(x, block, bound, scale_kind, scale_bound, scale_qmax), qmin, qmax, e4m3)


def _static_blocked(x: Tensor, amax: Tensor, block: int, bound: float) -> tuple[Tensor, list[int], Tensor]:
    check_amax_values(amax, STATIC_WHAT)
    sizes = {x.dim() - 1: block}
    xb, pad = blocks.to_blocks(x, sizes)
    return xb, pad, blocks.expand_amax(scale_from_amax(amax, bound), sizes)


def fake_block_static_reference(
    x: Tensor, amax: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool
) -> Tensor:
    """The definition with a static block amax (pure torch): the amax check, ``scale_from_amax``, the integer or
    E4M3 fake quant on the zero-padded blocks."""
    return _fake(x, *_static_blocked(x, amax, block, bound), qmin, qmax, e4m3)


def block_static_backward_reference(
    grad: Tensor, x: Tensor, amax: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool
) -> Tensor:
    """The straight-through gradient of :func:`fake_block_static_reference` (none for the amax)."""
    return _ste(grad, x, block, *_static_blocked(x, amax, block, bound), qmin, qmax, e4m3)


# --- routing ---------------------------------------------------------------------------------------------------------
def fused_device(x) -> bool:
    """Whether x is a tensor on a device the fused kernel serves (CUDA)."""
    return isinstance(x, Tensor) and device_type(x) in FUSED_DEVICE_TYPES


def _fused_kernels(x: Tensor, block: int):
    """The CUDA extension when it runs this (dtype, block) fused, else None."""
    if not fused_device(x) or x.dtype not in _DTYPE_NAMES or x.dim() == 0:
        return None
    dev = device_type(x)
    return kernels_for(dev) if _block_supported(dev, _DTYPE_NAMES[x.dtype], int(block)) else None


@torch.compiler.assume_constant_result
def _block_supported(dev: str, dtype: str, block: int) -> bool:
    """Whether the native CUDA extension of device type ``dev`` runs the fused kernel for (dtype, block): its
    ``block_dynamic_supported``. Under torch.compile a constant of the trace (dynamo cannot trace a pybind function:
    the call was a graph break in every compiled block quantizer)."""
    mod = kernels_for(dev)
    return bool(
        is_native_cuda(mod) and hasattr(mod, "fake_block_dynamic") and mod.block_dynamic_supported(dtype, block)
    )


def _exporting() -> bool:
    """torch.jit tracing or torch.export: the ONNX exporters, which translate the unfused ops into Q/DQ nodes (the
    fused ops have no translation). torch.compile keeps the fused ops."""
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


def fused_dynamic_args(x: Tensor, block_sizes: dict, amax, num_bits, unsigned: bool, narrow_range: bool):
    """The op's arguments after x (``block, bound, qmin, qmax, e4m3, scale_kind, scale_bound, scale_qmax``) when
    ``fake_block_quant(x, block_sizes, amax, ...)`` can run as :func:`fake_block_dynamic` on the fused CUDA kernel
    (a dynamic amax, signed elements, blocks along the last axis only, an integer or E4M3 element, scales
    double-quantized per tensor with unsigned integer or E4M3 codes or not at all, a supported dtype and block
    size, not under an ONNX export: :func:`_exporting`), else None."""
    if amax is not None or unsigned or not fused_device(x) or x.dim() == 0 or _exporting():
        return None
    scale_q = (0, 0.0, 0)
    scale_bits = block_sizes.get("scale_bits")
    if scale_bits is not None:
        if block_sizes.get("scale_block_sizes"):
            return None
        sfmt = scaled_float_format(scale_bits)
        if sfmt is not None and sfmt.name != "e4m3":
            return None
        if sfmt is not None:
            scale_q = (2, float(sfmt.bound), 0)
        else:
            sb, _, sq = int_range(scale_bits, True, False)
            scale_q = (1, float(sb), int(sq))
    block = blocks.last_axis_block(block_sizes, x.shape)
    if block is None:
        return None
    args = _element_args(num_bits, unsigned, narrow_range, block)
    return args + scale_q if args is not None and _fused_kernels(x, block) is not None else None


def _element_args(num_bits, unsigned: bool, narrow_range: bool, block: int):
    """``(block, bound, qmin, qmax, e4m3)`` of the fused kernels, or None for an element they do not run."""
    fmt = scaled_float_format(num_bits)
    if fmt is not None:
        return None if fmt.name != "e4m3" else (block, float(fmt.bound), -448, 448, True)
    bound, qmin, qmax = int_range(num_bits, unsigned, narrow_range)
    return (block, float(bound), int(qmin), int(qmax), False)


def fused_static_args(x: Tensor, block_sizes: dict, amax, num_bits, unsigned: bool, narrow_range: bool):
    """``(amax as float32, block, bound, qmin, qmax, e4m3)``, the arguments of :func:`fake_block_static`, when
    ``fake_block_quant(x, block_sizes, amax, ...)`` with a static amax can run on the fused CUDA kernel: blocks along
    the last axis only, an amax tensor of exactly the blocks' shape on x's device that needs no gradient (a learnable
    amax keeps the differentiable path), no double quantization of the scales, signed integer or E4M3 elements, a
    supported dtype and block size, not under torch.jit tracing or torch.export (an ONNX export writes the unfused
    path's standard Q/DQ; torch.compile keeps the op); else None (the unfused path, with its conversions and
    errors)."""
    if amax is None or unsigned or not fused_device(x) or x.dim() == 0 or _exporting():
        return None
    if not isinstance(amax, Tensor) or not amax.is_floating_point() or amax.device != x.device:
        return None
    if amax.requires_grad and torch.is_grad_enabled():
        return None
    if block_sizes.get("scale_bits") is not None or block_sizes.get("scale_block_sizes"):
        return None
    block = blocks.last_axis_block(block_sizes, x.shape)
    if block is None or tuple(amax.shape) != (*x.shape[:-1], -(-x.shape[-1] // block)):
        return None
    args = _element_args(num_bits, unsigned, narrow_range, block)
    amax = amax.to(torch.float32)  # no gradient to cut: one that needs it took the unfused path
    return None if args is None or _static_kernels(x, amax, block) is None else (amax, *args)


def fake_block_quant_fused(x: Tensor, block_sizes: dict, amax, num_bits, narrow_range: bool) -> Tensor | None:
    """``tensor_quant.fake_block_quant(x, block_sizes, amax, num_bits, False, narrow_range)`` as one fused op on the
    CUDA kernel (:func:`fake_block_dynamic` for a dynamic amax, :func:`fake_block_static` for a static one) where
    :func:`fused_dynamic_args` / :func:`fused_static_args` allow it, else None (the caller's unfused path)."""
    if amax is None:
        args = fused_dynamic_args(x, block_sizes, None, num_bits, False, narrow_range)
        return None if args is None else eager.call(fake_block_dynamic, x, *args)
    static = fused_static_args(x, block_sizes, amax, num_bits, False, narrow_range)
    return None if static is None else eager.call(fake_block_static, x, *static)


#: the deferred error of the kernel's flag (the reference's text without the block and its value)
_MESSAGES = {1: "the input contains NaN or Inf, so its block amax is not finite; clean the input"}


def _checked(x: Tensor, block: int, out, op: str) -> Tensor:
    """The output; the kernel's NaN/Inf flag read asynchronously (:mod:`.deferred_errors`, no host sync) or, in
    "sync" mode, at once: then a set flag raises the reference's ValueError."""
    y, flag = out
    deferred_errors.check_flag(flag, lambda: blocks.block_amax(x, {-1: block}), op, _MESSAGES, x)
    return y


# --- the ops ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_lite::fake_block_dynamic", mutates_args=())
def fake_block_dynamic(
    x: Tensor,
    block: int,
    bound: float,
    qmin: int,
    qmax: int,
    e4m3: bool,
    scale_kind: int = 0,
    scale_bound: float = 0.0,
    scale_qmax: int = 0,
) -> Tensor:
    args = (block, bound, qmin, qmax, e4m3, scale_kind, scale_bound, scale_qmax)
    mod = _fused_kernels(x, block)
    if mod is None:
        return fake_block_dynamic_reference(x, *args)
    return _checked(x, block, mod.fake_block_dynamic(x, *args), "fake_block_dynamic")


@fake_block_dynamic.register_fake
def _(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("modelopt_lite::block_dynamic_backward", mutates_args=())
def block_dynamic_backward(
    grad: Tensor,
    x: Tensor,
    block: int,
    bound: float,
    qmin: int,
    qmax: int,
    e4m3: bool,
    scale_kind: int = 0,
    scale_bound: float = 0.0,
    scale_qmax: int = 0,
) -> Tensor:
    args = (block, bound, qmin, qmax, e4m3, scale_kind, scale_bound, scale_qmax)
    mod = _fused_kernels(x, block)
    if mod is None or grad.dtype != x.dtype or grad.shape != x.shape or grad.device != x.device:
        return block_dynamic_backward_reference(grad, x, *args)
    return _checked(x, block, mod.block_dynamic_backward(grad, x, *args), "block_dynamic_backward")


@block_dynamic_backward.register_fake
def _(grad, x, *args):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, *args = inputs
    ctx.save_for_backward(x)
    ctx.args = tuple(args)


def _bwd(ctx, grad):
    (x,) = ctx.saved_tensors
    return (eager.call(block_dynamic_backward, grad.contiguous(), x, *ctx.args),) + (None,) * len(ctx.args)


eager.register_autograd(fake_block_dynamic, _bwd, _setup)


# --- static block amax -----------------------------------------------------------------------------------------------
def _static_checked(amax: Tensor, out) -> Tensor:
    """The output; the kernel's bad-amax flag deferred as the unfused path's amax check is (same op name and
    message), or in "sync" mode read at once: then :func:`.checks.check_amax_values` raises its ValueError."""
    y, flag = out
    deferred_errors.check_flag(
        flag,
        lambda: check_amax_values(amax, STATIC_WHAT),
        f"{STATIC_WHAT} check",
        deferred_amax_messages(STATIC_WHAT),
        amax,
    )
    return y


def _static_kernels(x: Tensor, amax: Tensor, block: int):
    mod = _fused_kernels(x, block)
    if mod is None or not hasattr(mod, "fake_block_static") or amax.dtype != torch.float32 or amax.device != x.device:
        return None
    return mod


@torch.library.custom_op("modelopt_lite::fake_block_static", mutates_args=())
def fake_block_static(x: Tensor, amax: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool) -> Tensor:
    mod = _static_kernels(x, amax, block)
    if mod is None:
        return fake_block_static_reference(x, amax, block, bound, qmin, qmax, e4m3)
    return _static_checked(amax, mod.fake_block_static(x, amax, block, bound, qmin, qmax, e4m3))


@fake_block_static.register_fake
def _(x, amax, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("modelopt_lite::block_static_backward", mutates_args=())
def block_static_backward(
    grad: Tensor, x: Tensor, amax: Tensor, block: int, bound: float, qmin: int, qmax: int, e4m3: bool
) -> Tensor:
    args = (block, bound, qmin, qmax, e4m3)
    mod = _static_kernels(x, amax, block)
    if mod is None or grad.dtype != x.dtype or grad.shape != x.shape or grad.device != x.device:
        return block_static_backward_reference(grad, x, amax, *args)
    return _static_checked(amax, mod.block_static_backward(grad, x, amax, *args))


@block_static_backward.register_fake
def _(grad, x, amax, *args):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _static_setup(ctx, inputs, output):
    x, amax, *args = inputs
    ctx.save_for_backward(x, amax)
    ctx.args = tuple(args)


def _static_bwd(ctx, grad):
    x, amax = ctx.saved_tensors
    gx = eager.call(block_static_backward, grad.contiguous(), x, amax, *ctx.args)
    return (gx, None) + (None,) * len(ctx.args)


eager.register_autograd(fake_block_static, _static_bwd, _static_setup)
