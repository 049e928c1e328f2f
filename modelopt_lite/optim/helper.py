"""Parameter selection for quantization-aware training (pytorch-quantization's ``optim.helper``).

Parameters are picked by regular expressions searched in their ``named_parameters`` names (``re.search``: a pattern
matches anywhere in the name unless anchored). :func:`group_parameters` builds optimizer parameter groups,
:func:`freeze_parameters` stops gradients, and :func:`quant_weight_inplace` writes each quantized module's
fake-quantized weight into the weight itself (after QAT, to export or to check a float checkpoint).
"""

from __future__ import annotations

import re

import torch

from ..nn.sequential_quantizer import SequentialQuantizer
from ..nn.tensor_quantizer import TensorQuantizer

__all__ = ["freeze_parameters", "group_parameters", "match_parameters", "quant_weight_inplace"]


def _compiled(patterns, what: str) -> list[re.Pattern]:
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise TypeError(f"{what} must be a list of regular expression strings, got {patterns!r}")
    out = []
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"{what} must be a list of regular expression strings, got the entry {p!r}")
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"{what}: {p!r} is not a valid regular expression ({e})") from None
    return out


def match_parameters(model: torch.nn.Module, patterns):
    """Yield the parameters of ``model`` whose name matches any of ``patterns`` (each parameter once)."""
    compiled = _compiled(patterns, "patterns")
    for name, param in model.named_parameters():
        if any(p.search(name) for p in compiled):
            yield param


def group_parameters(model: torch.nn.Module, patterns_list, lrs=None, momentums=None, weight_decays=None):
    """Optimizer parameter groups, one per list of patterns: ``[{"params": [...], "lr": ..., ...}, ...]``.

    ``lrs``, ``momentums`` and ``weight_decays`` (optional) give one value per group; a group's dict only has the
    keys given, so the optimizer's defaults fill the rest. A parameter matched by several groups is in each (torch
    optimizers then refuse it, as they should). Raises TypeError for a ``patterns_list`` that is not a list of
    lists, or per-group values whose length does not match.
    """
    if not isinstance(patterns_list, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in patterns_list):
        raise TypeError(f"patterns_list must be list of list of patterns, got {patterns_list!r}")
    extras = {"lr": lrs, "momentum": momentums, "weight_decay": weight_decays}
    for key, values in extras.items():
        if values is not None and len(values) != len(patterns_list):
            raise TypeError(
                f"len({key}s) must match len(patterns_list): {len(values)} values for {len(patterns_list)} groups"
            )
    for i, patterns in enumerate(patterns_list):
        _compiled(patterns, f"patterns_list[{i}]")
    groups = []
    for i, patterns in enumerate(patterns_list):
        group: dict = {"params": list(match_parameters(model, list(patterns)))}
        group.update({key: values[i] for key, values in extras.items() if values is not None})
        groups.append(group)
    return groups


def freeze_parameters(model: torch.nn.Module, patterns) -> None:
    """Set ``requires_grad = False`` on every parameter of ``model`` whose name matches any of ``patterns``."""
    for param in match_parameters(model, patterns):
        param.requires_grad = False


def quant_weight_inplace(model: torch.nn.Module) -> None:
    """Replace each quantized module's ``weight`` by its weight quantizer's output, in place.

    Every module with a ``weight`` parameter and an enabled ``weight_quantizer`` (a ``TensorQuantizer`` or
    ``SequentialQuantizer``) is
    updated under ``torch.no_grad()``: afterwards the float weights lie on the quantization grid, and running the
    weight quantizer again changes nothing (for a calibrated or fixed amax). This deliberately modifies the model's
    parameters; disabled quantizers, and modules without a weight quantizer, are left as they are.
    """
    with torch.no_grad():
        for module in model.modules():
            quantizer = getattr(module, "weight_quantizer", None)
            weight = getattr(module, "weight", None)
            if not isinstance(quantizer, (TensorQuantizer, SequentialQuantizer)) or not quantizer.is_enabled:
                continue
            if not isinstance(weight, torch.Tensor):
                continue
            weight.copy_(quantizer(weight))
