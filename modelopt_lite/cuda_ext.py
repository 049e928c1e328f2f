"""``modelopt_lite.cuda_ext``: pytorch-quantization's ``cuda_ext`` functions, on every device.

pytorch-quantization exposes its compiled kernels as ``cuda_ext.fake_tensor_quant``,
``fake_tensor_quant_with_axis`` and the in-place ``fake_tensor_quant_``. Here they are thin wrappers of
:func:`modelopt_lite.tensor_quant.fake_tensor_quant` (so the same exact numerics and backends: CPU, C++ or CUDA),
computed without autograd as the peer's raw kernels are. Prefer :mod:`modelopt_lite.tensor_quant` in new code.
"""

from __future__ import annotations

import torch

from .tensor_quant import fake_tensor_quant as _fake_tensor_quant

__all__ = ["fake_tensor_quant", "fake_tensor_quant_", "fake_tensor_quant_with_axis"]


def fake_tensor_quant(inputs, amax, num_bits=8, is_unsigned=False, narrow_range=True) -> torch.Tensor:
    """Fake-quantize ``inputs`` with ``amax`` (a number, a one-element tensor, or a tensor that broadcasts);
    a new tensor with no autograd history."""
    with torch.no_grad():
        return _fake_tensor_quant(inputs, amax, num_bits, is_unsigned, narrow_range)


def fake_tensor_quant_with_axis(inputs, amax, axis=1, num_bits=8, is_unsigned=False, narrow_range=True):
    """Fake-quantize with one amax per index of dimension ``axis``: ``amax`` holds ``inputs.shape[axis]`` values
    (any shape); ValueError otherwise."""
    if not isinstance(inputs, torch.Tensor) or not isinstance(amax, torch.Tensor):
        raise TypeError("fake_tensor_quant_with_axis: inputs and amax must be torch.Tensors")
    if isinstance(axis, bool) or not isinstance(axis, int) or not -inputs.dim() <= axis < inputs.dim():
        raise ValueError(f"fake_tensor_quant_with_axis: axis={axis!r} is out of range for rank {inputs.dim()}")
    axis %= inputs.dim()
    if amax.numel() != inputs.shape[axis]:
        raise ValueError(
            f"fake_tensor_quant_with_axis: amax has {amax.numel()} values for dimension {axis} of size "
            f"{inputs.shape[axis]} (inputs of shape {tuple(inputs.shape)})"
        )
    shape = [1] * inputs.dim()
    shape[axis] = inputs.shape[axis]
    return fake_tensor_quant(inputs, amax.reshape(shape), num_bits, is_unsigned, narrow_range)


def fake_tensor_quant_(inputs, amax, num_bits=8, is_unsigned=False, narrow_range=True) -> torch.Tensor:
    """In place, as the trailing underscore says: writes the fake-quantized values into ``inputs`` and returns it."""
    out = fake_tensor_quant(inputs, amax, num_bits, is_unsigned, narrow_range)
    with torch.no_grad():
        inputs.copy_(out)
    return inputs
