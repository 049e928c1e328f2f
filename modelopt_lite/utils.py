"""ModelOpt's ``modelopt.torch.quantization.utils`` helpers that apply here, under their names and signatures.

- ``reduce_amax(input, axis=None, keepdims=True, squeeze_scalar=True)``: ``max |input|`` over ``axis`` (None: all
  dimensions; a full reduction gives a 0-d tensor unless ``squeeze_scalar=False``);
- ``reduce_sum(input, axis=None, keepdims=True)``;
- ``reduce_block_amax(input_tensor, block_sizes)``: ``max |x|`` of every block (``{-1: 128, -2: 128}``), one value
  per block in the blocks' own layout (ModelOpt flattens it; ``.flatten()`` gives ModelOpt's values in order);
- ``convert_quantization_axis_to_reduce_axis(input, axis)``: the dimensions a per-``axis`` amax reduces over;
- ``enable_fake_quant(module)``: a context in which every ``weight_quantizer`` of ``module``'s submodules fake
  quantizes (``fake_quant=True``), restored on exit (ModelOpt's context; a bare quantizer is left as it is);
- ``is_quantized(module)``, ``is_quantized_linear(module)``: whether a module holds quantizers / is a quantized
  Linear-like module (an ``input_quantizer``, a ``weight_quantizer`` and a 2-D ``weight``).

These reduce what they are given exactly (no rounding happens in a max), in the input's own dtype, and never
modify it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .functional.abs_max import abs_max
from .functional.blocks import block_amax
from .nn import SequentialQuantizer, TensorQuantizer

__all__ = [
    "convert_quantization_axis_to_reduce_axis",
    "enable_fake_quant",
    "is_quantized",
    "is_quantized_linear",
    "reduce_amax",
    "reduce_block_amax",
    "reduce_sum",
]


def _dims(input: torch.Tensor, axis, what: str) -> list[int] | None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{what}: input must be a torch.Tensor, got {type(input).__name__}")
    if axis is None:
        return None
    axes = [axis] if isinstance(axis, int) else list(axis)
    if len(axes) > input.dim():  # (pytorch-quantization's message)
        raise ValueError(f"{what}: Cannot reduce more axes than there are axes: axis={axis!r}, rank {input.dim()}")
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, int) or not -input.dim() <= a < max(input.dim(), 1):
            raise ValueError(f"{what}: axis {a!r} is out of range for a {input.dim()}-D tensor")
        out.append(a % max(input.dim(), 1))
    return sorted(set(out))


def reduce_amax(input: torch.Tensor, axis=None, keepdims: bool = True, squeeze_scalar: bool = True) -> torch.Tensor:
    """``max |input|`` over ``axis`` (ModelOpt's signature); see the module docstring."""
    dims = _dims(input, axis, "reduce_amax")
    x = input.detach()
    if dims is None:  # every dimension: a 0-d tensor, as ModelOpt
        return abs_max(x).abs()
    out = abs_max(x, dims, keepdim=keepdims).abs()
    if squeeze_scalar and out.numel() == 1:
        out = out.squeeze()
    return out


def reduce_sum(input: torch.Tensor, axis=None, keepdims: bool = True) -> torch.Tensor:
    """The sum of ``input`` over ``axis`` (None: all dimensions, a 0-d result)."""
    dims = _dims(input, axis, "reduce_sum")
    if dims is None:
        return input.sum()
    return input.sum(dim=dims, keepdim=keepdims) if dims else input


def reduce_block_amax(input_tensor: torch.Tensor, block_sizes: dict) -> torch.Tensor:
    """``max |x|`` of every block, shaped as the blocks per axis, in ``input_tensor``'s dtype."""
    if not isinstance(input_tensor, torch.Tensor):
        raise TypeError(f"reduce_block_amax: input must be a torch.Tensor, got {type(input_tensor).__name__}")
    return block_amax(input_tensor, block_sizes, "reduce_block_amax's input").to(input_tensor.dtype)


def convert_quantization_axis_to_reduce_axis(input: torch.Tensor, axis) -> list[int] | None:
    """The dimensions a per-``axis`` amax reduces over (None: per tensor, every dimension)."""
    kept = _dims(input, axis, "convert_quantization_axis_to_reduce_axis")
    if kept is None:
        return None
    return [d for d in range(input.dim()) if d not in kept]


def is_quantized(module: nn.Module) -> bool:
    """True when ``module`` or any submodule is a quantizer."""
    return any(isinstance(m, (TensorQuantizer, SequentialQuantizer)) for m in module.modules())


def is_quantized_linear(module: nn.Module) -> bool:
    """True for a quantized Linear-like module: input and weight quantizers and a 2-D weight."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Embedding):  # a 2-D weight, but no GEMM on activations
        return False
    return (
        isinstance(getattr(module, "input_quantizer", None), (TensorQuantizer, SequentialQuantizer))
        and isinstance(getattr(module, "weight_quantizer", None), (TensorQuantizer, SequentialQuantizer))
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
    )


@contextmanager
def enable_fake_quant(module: nn.Module) -> Iterator[None]:
    """Within the context, every ``weight_quantizer`` of ``module``'s submodules fake quantizes; restored on exit."""
    saved: list[tuple[TensorQuantizer, bool]] = []
    for m in module.modules():
        wq = getattr(m, "weight_quantizer", None)
        members = list(wq) if isinstance(wq, SequentialQuantizer) else [wq]
        saved.extend((q, q.fake_quant) for q in members if isinstance(q, TensorQuantizer))
    try:
        for q, _ in saved:
            q._fake_quant = True
        yield
    finally:
        for q, was in saved:
            q._fake_quant = was
