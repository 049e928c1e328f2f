"""Exact snapshots of module state, so a failed calibration (or any block) can put every quantizer back as it was.

A snapshot keeps the *objects* (parameters, buffers, calibrators) and copies of their *contents*; restoring puts
the same objects back and copies the saved contents into them, so optimizers and other references stay valid.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, frozenset, type, range, torch.dtype, torch.device,
              types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)
_TENSOR_DICTS = ("_parameters", "_buffers")


def _is_immutable(v) -> bool:
    if isinstance(v, _IMMUTABLE):
        return True
    if isinstance(v, tuple):
        return all(_is_immutable(x) for x in v)
    from ..descriptor import ScaledQuantDescriptor

    return isinstance(v, ScaledQuantDescriptor)


@dataclass
class _Saved:
    kind: str  # "ref" | "tensor" | "deep" | "container"
    obj: object
    copy: object = None


def _save_value(v) -> _Saved:
    if isinstance(v, torch.Tensor):
        return _Saved("tensor", v, v.detach().clone())
    if isinstance(v, nn.Module) or _is_immutable(v):
        return _Saved("ref", v)
    if isinstance(v, (dict, set, list)) and all(not isinstance(x, torch.Tensor) and _is_immutable(x)
                                                for x in (v.values() if isinstance(v, dict) else v)):
        return _Saved("container", v, copy.copy(v))
    return _Saved("deep", v, copy.deepcopy(v))


def _restore_tensor(t: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        if t.shape == saved.shape and t.dtype == saved.dtype and t.device == saved.device:
            t.copy_(saved)
        else:
            t.data = saved.clone()


def _restore_value(s: _Saved):
    if s.kind == "tensor":
        _restore_tensor(s.obj, s.copy)
        return s.obj
    if s.kind == "container":
        s.obj.clear()
        (s.obj.update if isinstance(s.obj, (dict, set)) else s.obj.extend)(s.copy)
        return s.obj
    if s.kind == "deep":
        fresh = copy.deepcopy(s.copy)  # the snapshot stays reusable
        if hasattr(s.obj, "__dict__") and type(s.obj) is type(fresh) and not isinstance(s.obj, (dict, list, set)):
            s.obj.__dict__.clear()
            s.obj.__dict__.update(fresh.__dict__)
            return s.obj
        return fresh
    return s.obj


class ModuleSnapshot:
    """The complete Python-level state of some modules (each module's own attributes, not its children's)."""

    def __init__(self, modules: Iterable[nn.Module]):
        self._items: list[tuple[nn.Module, dict]] = []
        seen: set[int] = set()
        for m in modules:
            if id(m) in seen:
                continue
            seen.add(id(m))
            self._items.append((m, self._save(m)))

    @staticmethod
    def _save(m: nn.Module) -> dict:
        state = {}
        for k, v in m.__dict__.items():
            if k in _TENSOR_DICTS:
                state[k] = ("tensors", dict(v), {n: t.detach().clone() for n, t in v.items() if t is not None})
            elif isinstance(v, dict) and (k == "_modules" or k.endswith("hooks") or k.startswith("_forward")
                                          or k.startswith("_backward") or k.startswith("_state_dict")
                                          or k.startswith("_load_state_dict")):
                state[k] = ("shallow", v, type(v)(v))
            else:
                state[k] = ("value", _save_value(v))
        return state

    def restore(self) -> None:
        """Put every saved module back exactly as it was when the snapshot was taken."""
        for m, state in self._items:
            for k in [k for k in m.__dict__ if k not in state]:
                del m.__dict__[k]
            for k, entry in state.items():
                if entry[0] == "tensors":
                    _, refs, values = entry
                    d = m.__dict__.get(k)
                    if d is None:
                        d = m.__dict__[k] = type(refs)()
                    d.clear()
                    d.update(refs)
                    for n, t in refs.items():
                        if t is not None:
                            _restore_tensor(t, values[n])
                elif entry[0] == "shallow":
                    _, obj, saved = entry
                    obj.clear()
                    obj.update(saved)
                    m.__dict__[k] = obj
                else:
                    m.__dict__[k] = _restore_value(entry[1])


def snapshot_quantizers(quantizers: Iterable[nn.Module]) -> ModuleSnapshot:
    """A snapshot of every quantizer and all its submodules (learned-amax parameters, per-step calibrators...)."""
    mods = []
    for q in quantizers:
        mods.extend(q.modules())
    return ModuleSnapshot(mods)
