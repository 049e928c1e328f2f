"""Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2 and its family) as a :class:`QuantLinear`.

That ``Conv1D`` is a linear layer whose weight is stored transposed, shaped ``(in_features, out_features)``, and
computed as ``addmm(bias, x, W)``. Quantized (as in ModelOpt), it becomes a ``QuantLinear``: the weight is transposed
once into ``nn.Linear``'s ``(out_features, in_features)`` layout, so the per-channel weight quantizer (axis 0) sees
one row per output feature, and everything written for quantized Linears (calibration, AWQ/GPTQ, export, real
modules) applies. Its ``state_dict`` is a Linear's (the weight transposed). The class is registered on first sight
by a registry finder (key ``"Conv1D"``), so ``transformers`` is never imported here.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ._registry import QuantModuleRegistry
from .quant_linear import QuantLinear


def is_hf_conv1d_class(cls: type) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (exactly; recognised by module and name)."""
    return getattr(cls, "__module__", None) == "transformers.pytorch_utils" and cls.__name__ == "Conv1D"


class QuantHFConv1D(QuantLinear):
    """A Hugging Face ``Conv1D`` converted to a quantized Linear (weight transposed to ``(out, in)``)."""

    @classmethod
    def from_float(cls, module: nn.Module, quant_desc_input=None, quant_desc_weight=None):
        """A quantized copy of a Hugging Face ``Conv1D``: same values, its weight transposed to Linear's layout,
        the same dtype, device, requires_grad and training mode; ``module`` itself is not changed."""
        if not is_hf_conv1d_class(type(module)):
            raise TypeError(f"QuantHFConv1D.from_float expects a transformers Conv1D, got {type(module).__qualname__}")
        w = module.weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"QuantHFConv1D.from_float: the Conv1D weight must be 2-D (in, out), got {w!r}")
        new: Any = copy.deepcopy(module)
        new.__class__ = cls
        with torch.no_grad():
            new.weight = nn.Parameter(w.detach().t().contiguous().clone(), requires_grad=w.requires_grad)
        new.in_features, new.out_features = int(w.shape[0]), int(w.shape[1])
        new._init_quantizers(quant_desc_input, quant_desc_weight)
        return new

    @classmethod
    def converted_param_shapes(cls, module: nn.Module) -> dict[str, list[int]]:
        """The shapes of ``module``'s own parameters once converted (the weight transposed), as
        :func:`modelopt_lite.restore` compares a float model with a saved quantized one."""
        out = {n: list(p.shape) for n, p in module.named_parameters(recurse=False)}
        if len(out.get("weight", ())) == 2:
            out["weight"] = out["weight"][::-1]
        return out


def find_hf_conv1d(cls: type) -> type | None:
    """The registry finder: :class:`QuantHFConv1D` for Hugging Face's ``Conv1D``, else None."""
    return QuantHFConv1D if is_hf_conv1d_class(cls) else None


QuantModuleRegistry.add_finder(find_hf_conv1d)
