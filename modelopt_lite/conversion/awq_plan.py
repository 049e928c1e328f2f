"""The order in which AWQ gathers its statistics: one block (or layer group) at a time, so that at most one block's
``X^T X`` matrices exist at once (GPTQ's memory profile) instead of one per Linear input of the whole model.

1. :func:`probe` runs the first forward of the loop (the loop is then ended by an exception caught here): it
   records the order in which the candidate Linears are called, lets the fold :class:`~.awq_fold.Tracer` watch
   that forward, and checks which ModuleLists are chains (:class:`~.block_replay.ChainWatch`: element
   ``k + 1`` reads element ``k``'s output, as a transformer's layers do).
2. :func:`make_plan` groups the layers into units: a layer inside an element of a chain belongs to the innermost
   such element (a transformer block), a layer inside an element of another ModuleList to the innermost element,
   any other layer group (those sharing one scale) is a unit of its own. Units are visited in call order.
3. :func:`gather` yields the statistics of one unit at a time. A chain costs one pass of the loop, which gathers
   its first block's statistics while recording the second block's inputs (:func:`~.block_replay.recording`);
   every later block is then replayed alone (:func:`~.block_replay.run_element`), its outputs becoming the next
   block's inputs. Any other unit costs one pass of the loop (a model without ModuleLists: one pass per layer
   group). If a later batch breaks the chain (it is checked on every forward), the rest of it falls back to passes.

AWQ changes no weight before every unit is gathered (its decisions are applied at the end, :mod:`.awq_decide`), so
every pass and replay sees the float model the one-pass implementation saw: the statistics are the same numbers.
A replay runs outside the user's loop, under ``torch.no_grad`` with the training flags the blocks had during the
pass: a loop running the model under autocast is never treated as a chain (passes instead); other global state the
loop sets up around the model (a custom context) is not seen by the replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..calib import distributed
from .awq_stats import LayerStats, StatsHolder, all_reduce, gathering
from .block_replay import ChainWatch, elements, recording, run_element


class _Abort(Exception):
    """Ends the forward loop after its first forward (the probe)."""


@dataclass(frozen=True)
class Item:
    """A step of the plan: ``kind`` "pass" (one pass of the loop gathers ``units[0]``) or "chain" (``units[i]`` lie
    in element ``indices[i]`` of the ModuleList at ``list_name``)."""

    kind: str
    units: tuple[tuple[str, ...], ...]
    list_name: str = ""
    indices: tuple[int, ...] = ()


@dataclass
class Plan:
    """``groups``: ``[(linear names, producer path or None)]`` (the scale groups); ``items``: the gathering steps;
    ``seen``: the probe saw a forward."""

    groups: list[tuple[tuple[str, ...], str | None]]
    items: list[Item]
    seen: bool = True


@dataclass
class Probe:
    """What the first forward showed: the candidate layers in call order, the paths of the ModuleLists that were
    chains, whether a forward ran at all."""

    order: list[str]
    chained: set[str]
    seen: bool


def probe(model: nn.Module, mods: dict[str, nn.Module], forward_loop, trace=None) -> Probe:
    """Run the first forward of ``forward_loop`` on the float model (see the module docstring)."""
    elems = elements(model)
    list_name = {id(m): n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    lists = list({id(e.owner): e.owner for e in elems if any(_inside(n, e.name) for n in mods)}.values())
    watch = ChainWatch(model, lists)
    order: list[str] = []
    state = {"n": 0}

    def root_pre(_m, _a):
        state["n"] += 1
        if state["n"] > 1:
            raise _Abort

    def layer_pre(name):
        def pre(_m, _inp):
            if state["n"] == 1 and name not in seen:
                seen.add(name)
                order.append(name)

        return pre

    seen: set[str] = set()
    handles = [model.register_forward_pre_hook(root_pre, prepend=True)]
    handles += [m.register_forward_pre_hook(layer_pre(n)) for n, m in mods.items()]
    try:
        with (
            gathering(model, {}, {}, None),
            trace.active() if trace is not None else contextlib.nullcontext(),
            watch.watching(),
        ):
            forward_loop(model)
    except _Abort:
        pass
    finally:
        for h in handles:
            h.remove()
    chained = {list_name[id(lst)] for lst in lists if watch.chained(lst)}
    return Probe(order, chained, state["n"] > 0)


def _inside(layer: str, elem: str) -> bool:
    return layer == elem or layer.startswith(elem + ".")


def make_plan(model: nn.Module, mods: dict[str, nn.Module], groups, pr: Probe) -> Plan:
    """The units and their order (see the module docstring). ``groups``: ``[(names, producer path or None)]``."""
    elems = sorted(elements(model), key=lambda e: -len(e.name))  # innermost first
    list_name = {id(m): n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}

    def key(n: str):
        inside = [e for e in elems if _inside(n, e.name)]
        for e in inside:
            if list_name[id(e.owner)] in pr.chained:
                return ("chain", list_name[id(e.owner)], e.index)
        return ("elem", inside[0].name) if inside else None

    units: dict = {}
    for names, _ in groups:
        keys = {key(n) for n in names}
        k = keys.pop() if len(keys) == 1 else None
        units.setdefault(k if k is not None else ("loose", names[0]), []).extend(names)
    rank = {n: i for i, n in enumerate(pr.order)}
    first = {k: min(rank.get(n, len(rank) + list(mods).index(n)) for n in v) for k, v in units.items()}
    items: list[tuple[int, Item]] = []
    chains: dict[str, list] = {}
    for k, names in units.items():
        ordered = tuple(n for n in mods if n in names)
        if k[0] == "chain":
            chains.setdefault(k[1], []).append((k[2], ordered, first[k]))
        else:
            items.append((first[k], Item("pass", (ordered,))))
    for lname, parts in chains.items():
        parts.sort()
        item = Item("chain", tuple(p[1] for p in parts), lname, tuple(p[0] for p in parts))
        items.append((min(p[2] for p in parts), item))
    items.sort(key=lambda t: t[0])
    return Plan([(tuple(n), p) for n, p in groups], [it for _, it in items], pr.seen)


def agree(plan: Plan) -> Plan:
    """Under ``torch.distributed``: the plan of the first rank whose probe saw a forward (every rank must gather the
    same units in the same order). ValueError when two ranks that saw data planned differently."""
    if not distributed.is_active():
        return plan
    plans: list = [None] * dist.get_world_size()
    dist.all_gather_object(plans, (plan.groups, plan.items, plan.seen))
    seen = [p for p in plans if p[2]]
    if not seen:
        return plan
    if any(p[:2] != seen[0][:2] for p in seen):
        raise ValueError("awq: the ranks traced different models; every rank must run the same model")
    return Plan(list(seen[0][0]), list(seen[0][1]), True)


def _all_true(flag: bool) -> bool:
    if not distributed.is_active():
        return flag
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([0.0 if flag else 1.0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) == 0.0


def gather(
    model: nn.Module,
    mods: dict[str, nn.Module],
    forward_loop,
    plan: Plan,
    holder: StatsHolder,
    max_tokens_per_batch: int | None = None,
) -> Iterator[tuple[tuple[str, ...], dict[str, LayerStats]]]:
    """Yield ``(unit names, their statistics)`` one unit at a time, in plan order (summed over the ranks under
    ``torch.distributed``). The caller drops a unit's statistics from ``holder`` once it is done with them."""
    mt = max_tokens_per_batch

    def done(stats):
        if distributed.is_active():
            all_reduce(stats)
        return stats

    def one_pass(names):
        unit = {n: mods[n] for n in names}
        stats = holder.open(unit, mt)
        with gathering(model, unit, stats, mt):
            forward_loop(model)
        return done(stats)

    for item in plan.items:
        if item.kind == "pass" or len(item.units) == 1:
            yield item.units[0], one_pass(item.units[0])
            continue
        lst = model.get_submodule(item.list_name)
        assert isinstance(lst, nn.ModuleList)
        k0, last = item.indices[0], item.indices[-1]
        by_index = dict(zip(item.indices, item.units))
        unit = {n: mods[n] for n in item.units[0]}
        stats = holder.open(unit, mt)
        watch = ChainWatch(model, [lst])
        with gathering(model, unit, stats, mt), recording(model, lst[k0 + 1]) as cache, watch.watching():
            forward_loop(model)
        chained = _all_true(watch.chained(lst) and all(len(c) == 1 for c in cache.calls))
        yield item.units[0], done(stats)
        calls = cache.calls
        for k in range(k0 + 1, last + 1):
            names = by_index.get(k, ())
            if not chained:
                if names:
                    yield names, one_pass(names)
                continue
            unit = {n: mods[n] for n in names}
            stats = holder.open(unit, mt)
            with gathering(model, unit, stats, mt):
                calls = run_element(lst[k], calls, watch.modes[id(lst[k])], outputs=k < last)
            if names:
                yield names, done(stats)
        calls = []
