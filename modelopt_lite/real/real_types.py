"""The real module types: spec ``type`` name -> class, and the float class each one replaces.

Used by :func:`~.convert.fake2real` (building modules) and the checkpoint loader (rebuilding them from a spec), so
neither needs the other. A spec's ``type`` is only ever looked up here; an unknown name is a ValueError.
"""

from __future__ import annotations

from typing import TypeAlias

from torch import nn

from .modules import QuantizedConv2d, QuantizedLinear
from .pooling import QuantizedMaxPool1d, QuantizedMaxPool2d, QuantizedMaxPool3d

#: spec "type" -> real module class
REAL_CLASSES: dict[str, type[nn.Module]] = {
    "QuantizedLinear": QuantizedLinear,
    "QuantizedConv2d": QuantizedConv2d,
    "QuantizedMaxPool1d": QuantizedMaxPool1d,
    "QuantizedMaxPool2d": QuantizedMaxPool2d,
    "QuantizedMaxPool3d": QuantizedMaxPool3d,
}

#: an instance of one of the real module types (what :func:`build_real_module` builds)
RealModule: TypeAlias = QuantizedLinear | QuantizedConv2d | QuantizedMaxPool1d | QuantizedMaxPool2d | QuantizedMaxPool3d

#: spec "type" -> the float class a checkpoint's module replaces (``load_real`` works on a fresh float model)
FLOAT_CLASSES: dict[str, type[nn.Module]] = {
    "QuantizedLinear": nn.Linear,
    "QuantizedConv2d": nn.Conv2d,
    "QuantizedMaxPool1d": nn.MaxPool1d,
    "QuantizedMaxPool2d": nn.MaxPool2d,
    "QuantizedMaxPool3d": nn.MaxPool3d,
}

#: the real classes that hold integer weights (the others have only an input scale)
WEIGHTED_TYPES = ("QuantizedLinear", "QuantizedConv2d")

#: spec "type" -> spatial dims of the real pooling types (the real classes without weights)
POOL_DIMS: dict[str, int] = {
    "QuantizedMaxPool1d": QuantizedMaxPool1d.dims,
    "QuantizedMaxPool2d": QuantizedMaxPool2d.dims,
    "QuantizedMaxPool3d": QuantizedMaxPool3d.dims,
}


def real_class(kind) -> type[nn.Module]:
    """The real module class of a spec ``type`` (ValueError for anything else)."""
    if not isinstance(kind, str) or kind not in REAL_CLASSES:
        raise ValueError(f"unknown real module type {kind!r}; expected one of {sorted(REAL_CLASSES)}")
    return REAL_CLASSES[kind]


def build_real_module(spec: dict, tensors: dict | None = None, backend: str = "auto", device=None) -> nn.Module:
    """A real module from its spec (and tensors, copied in); used by ``fake2real`` and the checkpoint loader."""
    mod = real_class(spec.get("type"))(spec, backend)
    if device is not None:
        mod = mod.to(device)
    if tensors is not None:
        for k, t in tensors.items():
            getattr(mod, k).copy_(t)
    return mod


def real_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every real quantized module with integer weights (Linear, Conv2d) in ``model``."""
    kinds = tuple(REAL_CLASSES[k] for k in WEIGHTED_TYPES)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


def all_real_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every real module in ``model`` (the weighted ones and real pooling)."""
    kinds = tuple(REAL_CLASSES.values())
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]
