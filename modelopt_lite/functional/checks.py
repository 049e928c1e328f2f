"""Argument validation shared by the functional layer: clear errors before any kernel runs."""

from __future__ import annotations

import numbers

import torch

from . import deferred_errors
from .division import scalar_tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _compiling() -> bool:
    # torch.export (non-strict, as used by torch.onnx.export(dynamo=True)) traces with fake tensors too
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def first_bad(t: torch.Tensor, bad: torch.Tensor) -> float | int | bool:
    """The first element of ``t`` (in memory order of the flattened tensor) where ``bad`` holds: what an error
    message quotes as the offending value. ``bad`` must select at least one element."""
    return t.detach()[bad].flatten()[0].item()


#: why a meta tensor is refused (its data does not exist; compile and export trace with fake tensors instead)
META_INPUT = (
    "is on the meta device, which holds no values to quantize or calibrate (torch.compile and torch.export trace "
    "with fake tensors, which work)"
)


def check_input(x, what: str = "inputs") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.is_meta:
        raise TypeError(f"{what} {META_INPUT}")


def as_amax(amax, x: torch.Tensor, what: str = "amax", check_values: bool = True) -> torch.Tensor:
    """amax as a float32 tensor on x's device, validated (finite, >= 0; with ``check_values=False`` the caller
    checks the values, as :func:`.amax_scale.checked_scale` does) and broadcastable to x."""
    if isinstance(amax, bool) or amax is None:
        raise TypeError(f"{what} must be a number or a tensor, got {amax!r}")
    if isinstance(amax, numbers.Real):
        amax = scalar_tensor(float(amax), torch.float32, x.device)
    elif not isinstance(amax, torch.Tensor):
        raise TypeError(f"{what} must be a number or a tensor, got {type(amax).__name__}")
    if not amax.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got {amax.dtype}")
    if amax.numel() == 0:
        raise ValueError(f"{what} is empty")
    if amax.numel() != 1:
        if amax.dim() != x.dim():
            raise ValueError(
                f"{what} of shape {tuple(amax.shape)} must keep the input's rank {x.dim()} "
                f"(size 1 on reduced dims) to broadcast against inputs of shape {tuple(x.shape)}"
            )
        for d, (a, n) in enumerate(zip(amax.shape, x.shape)):
            if a not in (1, n):
                raise ValueError(
                    f"{what} of shape {tuple(amax.shape)} does not broadcast to {tuple(x.shape)} (dim {d})"
                )
    amax = amax.to(device=x.device, dtype=torch.float32)
    if amax.numel() == 1 and amax.dim() > x.dim():
        amax = amax.reshape(())
    if check_values and not _compiling():
        check_amax_values(amax, what)
    return amax


def check_broadcast(t: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """``t`` (one element, or any rank up to x's, aligned to x's trailing dims) broadcasts to ``x``: ValueError
    ``"{what} of shape [..] does not broadcast to x of shape [..]"`` otherwise (shapes printed as lists)."""
    if t.numel() == 1:
        return
    if t.numel() == 0:
        raise ValueError(f"{what} is empty")
    if t.dim() > x.dim():
        raise ValueError(f"{what} of shape {list(t.shape)} does not broadcast to x of shape {list(x.shape)}")
    lead = x.dim() - t.dim()
    for d, n in enumerate(t.shape):
        if n not in (1, x.shape[lead + d]):
            raise ValueError(
                f"{what} of shape {list(t.shape)} does not broadcast to x of shape {list(x.shape)} (dim {d})"
            )


def deferred_amax_messages(what: str = "amax") -> dict[int, str]:
    """The deferred amax check's message per flag bit (here and in :func:`.amax_scale.checked_scale`)."""
    return {1: f"{what} must be finite and >= 0 (NaN, Inf or < 0)"}


def check_amax_values(amax: torch.Tensor, what: str = "amax") -> None:
    if _compiling():  # data-dependent: cannot run on the fake tensors of torch.compile / torch.export
        return
    # amax is valid where clamping it into [0, its dtype's max] leaves it unchanged (NaN != NaN, Inf and < 0 move; -0.0
    # == +0.0): two ops, where ~isfinite | < 0 took five on the CPU
    bad = amax.clamp(0.0, torch.finfo(amax.dtype).max) != amax
    if deferred_errors.deferring(amax):  # CUDA: the flag computed on the device, read asynchronously
        deferred_errors.defer(bad.any(), f"{what} check", deferred_amax_messages(what), amax)
        return
    if bool(bad.any()):
        raise ValueError(amax_error(what, first_bad(amax, bad)))


def amax_error(what: str, value: float) -> str:
    """The message of a rejected amax (NaN, Inf or negative ``value``, the first one in memory order)."""
    return f"{what} must be finite and >= 0, got {value!r}"


class NegativeUnsignedInputError(ValueError, TypeError):
    """A negative input to an unsigned quantizer: a ValueError (bad input), and also the TypeError that
    pytorch-quantization and ModelOpt raise there ("Negative values encountered"), so code catching either works."""


def check_unsigned_input(x: torch.Tensor, what: str = "inputs") -> None:
    if _compiling() or x.numel() == 0:
        return
    m = torch.amin(x.detach())
    if deferred_errors.deferring(x):  # CUDA: flag 1 for a NaN or negative minimum, read asynchronously
        defer_unsigned_flag(m.ge(0).logical_not(), x, what)
        return
    check_unsigned_min(m.item(), what)


def defer_unsigned_flag(flag: torch.Tensor, x: torch.Tensor, what: str = "inputs") -> None:
    """Queue the unsigned-input check of ``x`` whose ``flag`` (one element on x's device) is 1 when x holds a
    negative value or NaN (:mod:`.deferred_errors`): a separate amin's, or the CUDA kernel's own pass's."""
    msg = (
        f"unsigned quantization of {what}: the input holds a negative value or NaN (Negative values "
        "encountered); use signed, or clean the input"
    )
    deferred_errors.defer(flag, "unsigned input check", {1: msg}, x)


def check_unsigned_min(m: float, what: str = "inputs") -> None:
    """Refuse unsigned quantization of an input whose minimum is ``m`` (negative, or NaN: the input holds a NaN).
    :func:`check_unsigned_input` computes ``m`` with a separate pass; the native CPU kernels in the same pass."""
    if not m >= 0:  # written so that a NaN minimum fails too: `nan < 0` is False
        if m != m:
            raise ValueError(
                f"unsigned quantization of {what}: the input contains NaN (minimum {m!r}), which cannot be checked "
                "for negative values; clean the input"
            )
        raise NegativeUnsignedInputError(
            f"Negative values encountered: unsigned quantization of {what} with negative values (minimum {m!r}); "
            "use signed"
        )


def check_axes(axis, ndim: int, what: str = "axis") -> tuple[int, ...]:
    """Normalize an int or tuple of axes against a rank (negatives allowed); raise ValueError when out of range."""
    items = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(f"{what}={axis!r} is out of range for a tensor of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{what}={axis!r} names the same dimension twice for rank {ndim}")
    return tuple(out)
