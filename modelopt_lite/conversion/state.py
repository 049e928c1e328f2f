"""Exact snapshots of module state, so a failed calibration (or any block) can put every quantizer back as it was.

A snapshot keeps the *objects* (parameters, buffers, calibrators) and copies of their *contents*; restoring puts
the same objects back and copies the saved contents into them, so optimizers and other references stay valid.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..descriptor import ScaledQuantDescriptor

_IMMUTABLE = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    frozenset,
    type,
    range,
    torch.dtype,
    torch.device,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
)
_TENSOR_DICTS = ("_parameters", "_buffers")
_MACHINERY = ("_forward", "_backward", "_state_dict", "_load_state_dict")  # hook tables: restored shallowly


def _is_immutable(v) -> bool:
    if isinstance(v, _IMMUTABLE):
        return True
    if isinstance(v, tuple):
        return all(_is_immutable(x) for x in v)
    return isinstance(v, ScaledQuantDescriptor)


@dataclass
class _Saved:
    kind: str  # "ref" | "tensor" | "container" | "object" | "deep"
    obj: Any  # what was saved; its type depends on ``kind`` (a tensor, a list/dict/set, any object)
    copy: Any = None  # the saved contents; their type depends on ``kind`` too


def _save_value(v, memo: dict | None = None) -> _Saved:
    """Save ``v`` so that :func:`_restore_value` puts the same objects back with their saved contents."""
    memo = {} if memo is None else memo
    if id(v) in memo:
        return memo[id(v)]
    if isinstance(v, torch.Tensor):
        saved = _Saved("tensor", v, v.detach().clone())
    elif isinstance(v, nn.Module) or _is_immutable(v):
        saved = _Saved("ref", v)
    elif type(v) in (list, dict, set):
        saved = _Saved("container", v)
        memo[id(v)] = saved
        items = list(v.items()) if isinstance(v, dict) else list(v)
        saved.copy = (
            [(k, _save_value(x, memo)) for k, x in items]
            if isinstance(v, dict)
            else [_save_value(x, memo) for x in items]
        )
    elif hasattr(v, "__dict__") and not hasattr(type(v), "__slots__") and type(v).__module__ != "builtins":
        saved = _Saved("object", v)
        memo[id(v)] = saved
        saved.copy = {k: _save_value(x, memo) for k, x in vars(v).items()}
    else:
        saved = _Saved("deep", v, copy.deepcopy(v))
    memo[id(v)] = saved
    return saved


def _restore_tensor(t: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        if t.shape == saved.shape and t.dtype == saved.dtype and t.device == saved.device:
            t.copy_(saved)
        else:
            t.data = saved.clone()


def _restore_value(s: _Saved, done: set | None = None):
    done = set() if done is None else done
    if id(s) in done:
        return s.obj
    done.add(id(s))
    if s.kind == "tensor":
        _restore_tensor(s.obj, s.copy)
    elif s.kind == "container":
        obj = s.obj
        if isinstance(obj, dict):
            items = [(k, _restore_value(x, done)) for k, x in s.copy]
            obj.clear()
            obj.update(items)
        else:
            items = [_restore_value(x, done) for x in s.copy]
            obj.clear()
            (obj.update if isinstance(obj, set) else obj.extend)(items)
    elif s.kind == "object":
        values = {k: _restore_value(x, done) for k, x in s.copy.items()}
        s.obj.__dict__.clear()
        s.obj.__dict__.update(values)
    elif s.kind == "deep":
        return copy.deepcopy(s.copy)  # the snapshot stays reusable
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
        state: dict[str, tuple] = {}
        for k, v in m.__dict__.items():
            if k in _TENSOR_DICTS:
                state[k] = ("tensors", dict(v), {n: t.detach().clone() for n, t in v.items() if t is not None})
            elif isinstance(v, dict) and (k == "_modules" or k.endswith("hooks") or k.startswith(_MACHINERY)):
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
    mods: list[nn.Module] = []
    for q in quantizers:
        mods.extend(q.modules())
    return ModuleSnapshot(mods)
