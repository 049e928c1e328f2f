"""Replaying the blocks of a model (the elements of an ``nn.ModuleList``, e.g. transformer layers) on their recorded
inputs, so that a calibration algorithm can work through a model block by block without running the whole model
for every block. Shared by GPTQ (:mod:`.gptq`) and AWQ (:mod:`.awq_plan`).

- :func:`blocks_of`, :class:`BlockCache`, :func:`replay`: a block's calls recorded during one pass, replayed alone
  (:class:`Stop`, raised by a hook inside the replayed block, ends a replayed call early: replays run outside the
  user's loop, and a pass of the loop always runs the whole model, so the loop sees every real output);
- :class:`ChainWatch`, :func:`run_element`: consecutive elements of a ModuleList that feed each other (element
  ``k + 1`` reads element ``k``'s output, every other argument the same objects, each called once per forward), so
  element ``k``'s replayed outputs are element ``k + 1``'s inputs (the model runs once, then each block once).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from torch import nn


class Stop(Exception):
    """Raised inside a replayed block (:func:`replay`) to end that call once the inputs it was run for are seen."""


def blocks_of(model: nn.Module, mods: dict[nn.Module, str]) -> dict[nn.Module, nn.Module | None]:
    """For each layer, the innermost element of an ``nn.ModuleList`` that contains it (a transformer block), or
    None."""
    blocks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            blocks += [(f"{name}.{k}" if name else k, child) for k, child in m.named_children()]
    out: dict[nn.Module, nn.Module | None] = {}
    for m, name in mods.items():
        inside = [(len(bn), b) for bn, b in blocks if name.startswith(bn + ".")]
        out[m] = max(inside, key=lambda t: t[0])[1] if inside else None
    return out


@dataclass
class BlockCache:
    """The inputs of one block, recorded during the pass that reached it: later groups inside the same block replay
    the block alone on them (its inputs do not depend on its own weights) instead of the whole model."""

    block: nn.Module | None = None
    calls: list = field(default_factory=list)  #: per pass: [(args, kwargs), ...] of each call of the block
    modes: list = field(default_factory=list)  #: (module, training) of the block's modules during the pass


#: argument values kept by reference when recorded: immutable, or never changed by a call
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, nn.Module)


def _stateful(v) -> bool:
    """Whether ``v`` is an object a call may change in place (anything but a tensor, a container or a plain value),
    e.g. a Hugging Face ``Cache``, which each attention call extends with its keys and values."""
    return not isinstance(v, (torch.Tensor, tuple, list, dict, *_PLAIN)) and not callable(v)


def _snapshot(v):
    """A copy of ``v`` as it is now (``v`` itself when it cannot be copied)."""
    try:
        return copy.deepcopy(v)
    except Exception:  # an object that refuses copying is passed as it is, as before
        return v


def copied(v):
    """A recorded argument: tensors detached copies, containers rebuilt, stateful objects (a key/value cache) copied
    as they are at recording time (the block changes them in place, and so would every later call)."""
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, tuple):
        return tuple(copied(x) for x in v)
    if isinstance(v, list):
        return [copied(x) for x in v]
    if isinstance(v, dict):
        return {k: copied(x) for k, x in v.items()}
    return _snapshot(v) if _stateful(v) else v


def fresh(v):
    """The arguments of one replayed call: the recorded stateful objects copied again, so that every replay starts
    from the state recorded (a cache a previous replay extended would give the attention keys of two calls, or keys
    from stale weights); tensors and plain values passed as recorded."""
    if isinstance(v, tuple):
        return tuple(fresh(x) for x in v)
    if isinstance(v, list):
        return [fresh(x) for x in v]
    if isinstance(v, dict):
        return {k: fresh(x) for k, x in v.items()}
    return _snapshot(v) if _stateful(v) else v


def replay(cache: BlockCache) -> None:
    """Run the cached block calls, pass by pass, each pass until a :class:`Stop`."""
    assert cache.block is not None
    saved = [(m, m.training) for m in cache.block.modules()]
    try:
        for m, training in cache.modes:
            m.training = training
        for calls in cache.calls:
            for args, kwargs in calls:
                try:
                    cache.block(*fresh(args), **fresh(kwargs))
                except Stop:
                    break
    finally:
        for m, training in saved:
            m.training = training


# --- chains: consecutive elements of a ModuleList that feed each other ---------------------------------------------
@dataclass
class Element:
    """One element of an ``nn.ModuleList``: its path, the module, the list and its index in it."""

    name: str
    module: nn.Module
    owner: nn.ModuleList
    index: int


def elements(model: nn.Module) -> list[Element]:
    """Every element of every ``nn.ModuleList`` in ``model`` (nested lists included), in model order."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            for i, child in enumerate(m):
                out.append(Element(f"{name}.{i}" if name else str(i), child, m, i))
    return out


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


@dataclass
class _ListState:
    next: int = 0
    args: tuple | None = None
    kwargs: dict | None = None
    out: object = None


class ChainWatch:
    """Checks, during every forward of ``model`` run inside :meth:`watching`, whether the elements of each of
    ``lists`` form a chain: called once each, in index order, element ``k + 1``'s first positional argument is
    element ``k``'s output (or the output's first item), every other argument and keyword argument the very same
    object as element ``k`` got, and no autocast active. Only identities are compared (no tensor op runs, so a
    :class:`torch.overrides.TorchFunctionMode` tracing the same forward sees nothing). ``modes`` keeps the training
    flags of each element's modules at its first call (a replay restores them)."""

    def __init__(self, model: nn.Module, lists: list[nn.ModuleList]):
        self.model = model
        self.lists = list(dict.fromkeys(lists))
        self.broken: set[int] = set()
        self.forwards = 0
        self.modes: dict[int, list] = {}
        self._state: dict[int, _ListState] = {}

    def chained(self, lst: nn.ModuleList) -> bool:
        """Whether ``lst`` was a chain in every forward seen (False when no forward was seen)."""
        return self.forwards > 0 and id(lst) not in self.broken

    def _new_forward(self) -> None:
        for key, st in self._state.items():
            if st.next not in (0, len(self._lists[key])):  # the previous forward stopped halfway: not a chain
                self.broken.add(key)
        self._state = {id(lst): _ListState() for lst in self.lists}
        self.forwards += 1

    def _end_forward(self) -> None:
        for key, st in self._state.items():
            if st.next != len(self._lists[key]):
                self.broken.add(key)
            st.args = st.kwargs = st.out = None

    def _enter(self, lst: nn.ModuleList, k: int, args: tuple, kwargs: dict) -> None:
        key = id(lst)
        st = self._state.get(key)
        if key in self.broken or st is None:
            return
        ok = st.next == k and len(args) > 0 and not _autocast_on()
        if ok and k > 0:
            prev = st.out
            first = prev[0] if isinstance(prev, (tuple, list)) and len(prev) > 0 else None
            ok = (
                (args[0] is prev or (first is not None and args[0] is first))
                and st.args is not None
                and len(args) == len(st.args)
                and all(a is b for a, b in zip(args[1:], st.args[1:]))
                and st.kwargs is not None
                and kwargs.keys() == st.kwargs.keys()
                and all(kwargs[n] is st.kwargs[n] for n in kwargs)
            )
        if not ok:
            self.broken.add(key)
            return
        st.args, st.kwargs, st.out = args, kwargs, None
        elem = lst[k]
        if id(elem) not in self.modes:
            self.modes[id(elem)] = [(m, m.training) for m in elem.modules()]

    def _leave(self, lst: nn.ModuleList, k: int, out) -> None:
        st = self._state.get(id(lst))
        if st is not None and id(lst) not in self.broken:
            st.out, st.next = out, k + 1

    @contextlib.contextmanager
    def watching(self):
        """Watch the forwards of the model run inside this block."""
        self._lists = {id(lst): lst for lst in self.lists}
        handles = [
            self.model.register_forward_pre_hook(lambda _m, _a: self._new_forward()),
            self.model.register_forward_hook(lambda _m, _a, _o: self._end_forward()),
        ]
        for lst in self.lists:
            for k, elem in enumerate(lst):

                def pre(_m, args, kwargs, lst=lst, k=k):
                    self._enter(lst, k, args, kwargs)

                def post(_m, _args, out, lst=lst, k=k):
                    self._leave(lst, k, out)

                handles.append(elem.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(elem.register_forward_hook(post))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            for st in self._state.values():
                st.args = st.kwargs = st.out = None


def run_element(block: nn.Module, calls: list, modes: list, *, outputs: bool = True) -> list:
    """Run ``block`` on each recorded call (``[[(args, kwargs)], ...]``, one list per forward) with the training
    flags ``modes``; with ``outputs``, return the calls of the next element of a chain: the same arguments with the
    first one replaced by this block's output (its first item for a tuple or list)."""
    saved = [(m, m.training) for m in block.modules()]
    nxt: list = []
    try:
        for m, training in modes:
            m.training = training
        for per_forward in calls:
            row = []
            for args, kwargs in per_forward:
                out = block(*fresh(args), **fresh(kwargs))
                if outputs:
                    first = out[0] if isinstance(out, (tuple, list)) else out
                    row.append(((first, *args[1:]), kwargs))
            nxt.append(row)
    finally:
        for m, training in saved:
            m.training = training
    return nxt
