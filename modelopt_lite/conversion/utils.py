"""Iterators over the quantizers of a model (shared by conversion, calibration, summary and save/restore)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from torch import nn

if TYPE_CHECKING:
    from ..nn.tensor_quantizer import TensorQuantizer


def tensor_quantizer_class() -> type[TensorQuantizer]:
    """``modelopt_lite.nn.TensorQuantizer`` (imported on first use)."""
    from ..nn.tensor_quantizer import TensorQuantizer

    return TensorQuantizer


def is_quantizer(module) -> bool:
    """True for a ``TensorQuantizer`` (or a subclass)."""
    return isinstance(module, tensor_quantizer_class())


def named_quantizers(model: nn.Module) -> Iterator[tuple[str, TensorQuantizer]]:
    """``(module path, TensorQuantizer)`` for every quantizer in ``model``, in module order (shared ones once)."""
    cls = tensor_quantizer_class()
    for name, m in model.named_modules():
        if isinstance(m, cls):
            yield name, m


class QuantizerSite(NamedTuple):
    """A quantizer with where it lives: full path, attribute name inside its owner, and the owning module."""

    name: str
    local: str
    owner: nn.Module | None
    quantizer: TensorQuantizer


def quantizer_sites(model: nn.Module) -> list[QuantizerSite]:
    """Every quantizer with its owner (the module holding it as a direct child; None for the root itself)."""
    modules = dict(model.named_modules())
    out = []
    for name, q in named_quantizers(model):
        parent, _, local = name.rpartition(".")
        owner = modules.get(parent) if name else None
        out.append(QuantizerSite(name, local or name, owner, q))
    return out


def get_module(model: nn.Module, name: str) -> nn.Module:
    """The submodule at dotted path ``name`` ("" is the model itself)."""
    return model.get_submodule(name) if name else model
