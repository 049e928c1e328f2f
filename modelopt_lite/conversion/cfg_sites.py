"""Where config rules land: quantizer sites (a ``TensorQuantizer`` or a whole ``SequentialQuantizer``), merging the
attributes of the rules that match one, and applying them (turning a quantizer into a sequence when they are a list).

A ``SequentialQuantizer`` is one site under its own path (``fc.weight_quantizer``), as in ModelOpt: patterns see it,
not its members (``fc.weight_quantizer.0``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.sequential_quantizer import SequentialQuantizer
from ..nn.tensor_quantizer import TensorQuantizer
from .utils import QuantizerSite

#: a configurable quantizer: full path, attribute name in its owner, the owner (None for the root), the module
CfgSite = QuantizerSite


def config_sites(model: nn.Module) -> list[CfgSite]:
    """Every ``TensorQuantizer`` and ``SequentialQuantizer`` of ``model`` (members of a sequence not on their own)."""
    modules = dict(model.named_modules())
    out: list[CfgSite] = []
    inside: list[str] = []
    for name, m in modules.items():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, SequentialQuantizer):
            inside.append(name)
        elif not isinstance(m, TensorQuantizer):
            continue
        parent, _, local = name.rpartition(".")
        out.append(CfgSite(name, local or name, modules.get(parent) if name else None, m))
    return out


def merge_attrs(attr_list: list) -> dict | list[dict]:
    """The attributes of several matching rules, in order: dicts update the current settings; a list (a sequence)
    replaces them; a dict after a list patches every member of the list."""
    merged: dict | list[dict] = {}
    for attrs in attr_list:
        if isinstance(attrs, list):
            merged = [dict(a) for a in attrs]
        elif isinstance(merged, list):
            merged = [{**a, **attrs} for a in merged]
        else:
            merged = {**merged, **attrs}
    return merged


def _device_of(owner: nn.Module) -> torch.device:
    for t in (*owner.parameters(recurse=False), *owner.buffers(recurse=False)):
        return t.device
    return torch.device("cpu")


def apply_attrs(site: CfgSite, merged: dict | list[dict], replaced: list) -> None:
    """Apply merged attributes to a site. A list on a plain quantizer (or on a sequence of another length) puts a new
    ``SequentialQuantizer`` of fresh default quantizers in the owner; ``(owner, attribute, old module)`` is appended
    to ``replaced`` so the caller can undo it."""
    q = site.quantizer
    if isinstance(merged, list) and not (isinstance(q, SequentialQuantizer) and len(q) == len(merged)):
        if site.owner is None:
            raise ValueError("the model itself is a quantizer: it cannot be replaced by a SequentialQuantizer")
        new = SequentialQuantizer(*(TensorQuantizer() for _ in merged)).to(_device_of(site.owner))
        new.set_from_attribute_config(merged)
        for i, member in enumerate(new):
            member.name = f"{site.name}.{i}"
        replaced.append((site.owner, site.local, q))
        setattr(site.owner, site.local, new)
        return
    q.set_from_attribute_config(merged)
