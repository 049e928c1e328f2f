"""True division by a constant: one IEEE division, whatever the device.

PyTorch evaluates ``cuda_tensor / python_number`` (and ``div``/``div_``/``true_divide`` with a Python number, or
with a 0-dim CPU tensor, as divisor) as a multiplication by the reciprocal of the number, which is one ulp off the
true quotient for many inputs (measured on an H100: ``amax / 2688`` differed on 22% of random amaxes). The numerics
contract promises true division (``float32(amax) / float32(bound)``, as ONNX Runtime computes it), so every such
division divides by a tensor on the dividend's device instead: these helpers.

The divisor tensor has the dtype the plain expression computes in (``torch.result_type(t, number)``: float32 for a
float32 ``t``, float16 for a float16 ``t``, the default float dtype for an integer ``t`` divided by a float), so the
result dtype is the one ``t / number`` gives and, where ``number`` is exact in that dtype (all the bounds used here:
448, 2688, 57344, 6, 2**b - 1, powers of two), the value is the correctly rounded quotient on every device.
"""

from __future__ import annotations

import torch


def _divisor_dtype(t: torch.Tensor, number: float) -> torch.dtype:
    """``torch.result_type(t, number)``, spelled so that torch.compile traces it (a Python number never promotes a
    floating tensor; an integer or bool tensor divided by a float computes in the default float dtype)."""
    if t.is_floating_point():
        return t.dtype
    return torch.get_default_dtype() if isinstance(number, float) else torch.int64


#: Device types whose scalars are filled on the device (the host-emulated CUDA tests add "cpu").
FILL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def scalar_tensor(number: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``number`` as a 0-dim tensor of ``dtype`` on ``device`` (the same value either way). On a CUDA device it is
    filled there (``torch.full``, one kernel): ``torch.tensor(number, device="cuda")`` copies it from pageable host
    memory, which synchronizes the stream (a host sync on every quantizer call). Traced code keeps ``torch.tensor``
    (a constant in an exported graph)."""
    if device.type in FILL_DEVICE_TYPES and not torch.jit.is_tracing():
        return torch.full((), number, dtype=dtype, device=device)
    return torch.tensor(number, dtype=dtype, device=device)


def divisor_like(t: torch.Tensor, number: float) -> torch.Tensor:
    """``number`` as a 0-dim tensor on ``t``'s device, in the dtype ``t / number`` computes in."""
    return scalar_tensor(number, _divisor_dtype(t, number), t.device)


def true_div(t: torch.Tensor, number: float) -> torch.Tensor:
    """``t / number`` as a true (IEEE, correctly rounded) division on every device; same result dtype."""
    return torch.div(t, divisor_like(t, number))


def true_div_(t: torch.Tensor, number: float) -> torch.Tensor:
    """In-place :func:`true_div` (``t /= number``); ``t`` must be floating (as for ``t.div_(number)``)."""
    return t.div_(divisor_like(t, number))
