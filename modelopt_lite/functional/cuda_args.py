"""The CUDA extension's argument checks, run in Python before any call into it (a second line of defence).

The bindings (``csrc/quant_cuda_binding.cpp``, ``csrc/mx_cuda_binding.cpp``) validate their arguments and raise
ValueError / TypeError themselves. The first GPU run found that, on some builds, such an exception crossing from the
extension could kill the process instead; the bindings now raise their Python exceptions themselves
(``csrc/binding_errors.h``), and the ops of :mod:`.library`, :mod:`.library_mx` and :mod:`.library_minifloat` also
call these checks first when the CUDA extension is about to run, so that bad arguments never reach it. Same
conditions, same exception types and the same texts (dtypes are spelled the torch way, ``torch.int32``).

Only metadata is read (dtypes, shapes, ints): no device synchronization. Values (NaN/Inf inputs, the NVFP4 global
scale's value) are left to the kernels, which flag them and raise ValueError on the host.
"""

from __future__ import annotations

import torch

from . import microscaling as ms
from .checks import check_broadcast, check_input

MAX_RANK = 64  # MLQ_MAX_RANK of csrc/quant_kernels_api.h
_MAX_EXACT_INT = 2**24


def where(fn: str) -> str:
    """The prefix of the quantization binding's messages."""
    return f"modelopt_lite CUDA kernels, {fn}: "


def _check_qrange(qmin: int, qmax: int, at: str) -> None:
    if qmin > qmax:
        raise ValueError(f"{at}qmin must be <= qmax, got qmin={qmin}, qmax={qmax}")
    if not (-_MAX_EXACT_INT <= qmin and qmax <= _MAX_EXACT_INT):
        raise ValueError(f"{at}qmin/qmax must be in [-2**24, 2**24], got {qmin}, {qmax}")


def _check_param(t: torch.Tensor, x: torch.Tensor, at: str, what: str) -> None:
    check_broadcast(t, x, at + what)
    if not t.is_floating_point():
        raise TypeError(f"{at}{what} must be a floating-point tensor, got {t.dtype}")


def check_quant(
    fn: str,
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    qrange: tuple[int, int] | None = None,
    grad: torch.Tensor | None = None,
) -> None:
    """The checks of quant_cuda_binding.cpp's ``fn`` (fake_quant_int, int_backward, fake_affine, ...), in its order.

    ``qrange`` is ``(qmin, qmax)`` (E4M3 ops: None, the binding uses -448/448); ``grad`` for the backward ops.
    """
    at = where(fn)
    check_input(x, at + "x")
    if grad is not None:
        check_input(grad, at + "grad")
    if qrange is not None:
        _check_qrange(int(qrange[0]), int(qrange[1]), at)
    if grad is not None:
        if grad.shape != x.shape:
            raise ValueError(f"{at}grad of shape {list(grad.shape)} does not match x of shape {list(x.shape)}")
        if grad.device != x.device:
            raise ValueError(f"{at}grad is on {grad.device} but x is on {x.device}")
    if x.dim() > MAX_RANK:
        raise ValueError(f"{at}x has {x.dim()} dims, at most {MAX_RANK} are supported")
    _check_param(scale, x, at, "scale")
    if zero_point is not None:
        _check_param(zero_point, x, at, "zero_point")


def check_minifloat(fn: str, x: torch.Tensor, scale: torch.Tensor) -> None:
    """The checks of mx_cuda_binding.cpp's fake_e5m2 / fake_e2m1."""
    at = where(fn)
    check_input(x, at + "x")
    lead = x.dim() - scale.dim()  # this binding aligns trailing dims too, but checks ranks before sizes
    if lead < 0 or any(n not in (1, x.shape[lead + d]) for d, n in enumerate(scale.shape)):
        raise ValueError(f"{at}scale of shape {list(scale.shape)} does not broadcast to x of shape {list(x.shape)}")


def check_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, block) -> None:
    """The checks of mx_cuda_binding.cpp's fake_nvfp4 (the reference's messages) but the global scale's value."""
    ms._check_blocked_input(x, "NVFP4 input")
    ms._check_block(block, ms.NVFP4_BLOCK_SIZES, "NVFP4")
    if global_scale.numel() != 1:
        raise ValueError(
            f"NVFP4 global_scale must be a single (per-tensor) value, got shape {tuple(global_scale.shape)}"
        )


def check_mx(x: torch.Tensor, elem: str, block, rounding: str) -> None:
    """The checks of mx_cuda_binding.cpp's fake_mx (the reference's messages)."""
    ms._element(elem)
    ms._check_rounding(rounding)
    ms._check_blocked_input(x, f"MX ({elem}) input")
    ms._check_block(block, ms.MX_BLOCK_SIZES, "MX")


def check_grad(grad: torch.Tensor, x: torch.Tensor) -> None:
    """The NVFP4 / MX backward bindings' grad check (shape and device; a grad of another dtype is the caller's to
    route to the reference)."""
    if grad.shape != x.shape or grad.device != x.device:
        raise ValueError(
            f"modelopt_lite CUDA kernels: grad ({grad.dtype} {list(grad.shape)} on {grad.device}) must match x "
            f"({x.dtype} {list(x.shape)} on {x.device}) in dtype, shape and device"
        )
