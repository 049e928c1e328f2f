"""The order in which AWQ gathers its statistics: one block (or layer group) at a time, so that at most one block's
``X^T X`` matrices exist at once (GPTQ's memory profile) instead of one per Linear input of the whole model.

1. :func:`probe` runs the loop once, on the float model, to its end (every call of the model returns its real
   output to the loop): the first forward shows the order in which the candidate Linears are called and lets the
   fold :class:`~.awq_fold.Tracer` watch it; every forward is checked for which ModuleLists are chains
   (:class:`~.block_replay.ChainWatch`: element ``k + 1`` reads element ``k``'s output, as a transformer's layers
   do), and the inputs of each chain's first element are recorded (dropped for a list as soon as it is no chain).
2. :func:`make_plan` groups the layers into units: a layer inside an element of a chain belongs to the innermost
   such element (a transformer block), a layer inside an element of another ModuleList to the innermost element,
   any other layer group (those sharing one scale) is a unit of its own. Units are visited in call order.
3. :func:`gather` yields the statistics of one unit at a time. A chain costs no further pass of the loop: each of
   its blocks is replayed alone (:func:`~.block_replay.run_element`), the first on the inputs the probe recorded,
   each later one on the previous block's outputs. Any other unit costs one pass of the loop (a model without
   ModuleLists: one pass per layer group). A chain some rank did not see (under ``torch.distributed``) falls back to
   one pass per unit. The recorded inputs of a chain (all batches) are held until its blocks are gathered: one set
   per chained ModuleList (an encoder-decoder holds two at once).

AWQ changes no weight before every unit is gathered (its decisions are applied at the end, :mod:`.awq_decide`), so
every pass and replay sees the float model the one-pass implementation saw: the statistics are the same numbers.
A replay runs outside the user's loop, under ``torch.no_grad`` with the training flags the blocks had during the
pass: a loop running the model under autocast is never treated as a chain (passes instead); other global state the
loop sets up around the model (a custom context) is not seen by the replays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from ..calib import distributed
from .awq_stats import LayerStats, StatsHolder, all_reduce, gathering
from .block_replay import ChainWatch, copied, elements, run_element


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
    """What the probe showed: the candidate layers in call order (first forward), the paths of the ModuleLists that
    were chains in every forward, whether a forward ran at all; for each chain, the calls of its first element (one
    ``[(args, kwargs)]`` per forward) and the training flags of every element's modules (by ``id`` of the element)."""

    order: list[str]
    chained: set[str]
    seen: bool
    calls: dict[str, list] = field(default_factory=dict)
    modes: dict[int, list] = field(default_factory=dict)


def probe(model: nn.Module, mods: dict[str, nn.Module], forward_loop, trace=None) -> Probe:
    """Run ``forward_loop`` once on the float model (see the module docstring)."""
    elems = elements(model)
    list_name = {id(m): n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    lists = list({id(e.owner): e.owner for e in elems if any(_inside(n, e.name) for n in mods)}.values())
    watch = ChainWatch(model, lists)
    order: list[str] = []
    seen: set[str] = set()
    state = {"n": 0}
    rec: dict[int, list] = {id(lst): [] for lst in lists if len(lst) > 0}

    def drop_broken():
        for key in [k for k in rec if k in watch.broken]:
            del rec[key]

    def root_pre(_m, _a):
        state["n"] += 1
        drop_broken()
        for calls in rec.values():
            calls.append([])

    def layer_pre(name):
        def pre(_m, _inp):
            if state["n"] == 1 and name not in seen:
                seen.add(name)
                order.append(name)

        return pre

    def head_pre(key):
        def pre(_m, args, kwargs):  # runs after the ChainWatch's own hook of this element
            if key in rec and key not in watch.broken and rec[key]:
                rec[key][-1].append((copied(args), copied(kwargs)))

        return pre

    handles = [model.register_forward_pre_hook(root_pre, prepend=True)]
    handles += [m.register_forward_pre_hook(layer_pre(n)) for n, m in mods.items()]
    try:
        with (
            gathering(model, {}, {}, None),
            trace.active() if trace is not None else contextlib.nullcontext(),
            watch.watching(),
        ):
            handles += [
                lst[0].register_forward_pre_hook(head_pre(id(lst)), with_kwargs=True) for lst in lists if len(lst)
            ]
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    drop_broken()
    chained = {list_name[id(lst)] for lst in lists if watch.chained(lst)}
    calls = {
        list_name[id(lst)]: rec[id(lst)]
        for lst in lists
        if list_name[id(lst)] in chained and id(lst) in rec and all(len(c) == 1 for c in rec[id(lst)])
    }
    return Probe(order, chained, state["n"] > 0, calls, dict(watch.modes))


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


def gather(
    model: nn.Module,
    mods: dict[str, nn.Module],
    forward_loop,
    plan: Plan,
    holder: StatsHolder,
    max_tokens_per_batch: int | None = None,
    probed: Probe | None = None,
) -> Iterator[tuple[tuple[str, ...], dict[str, LayerStats]]]:
    """Yield ``(unit names, their statistics)`` one unit at a time, in plan order (summed over the ranks under
    ``torch.distributed``). The caller drops a unit's statistics from ``holder`` once it is done with them.
    ``probed``: the :func:`probe` of this model (its recorded chain inputs are consumed, and dropped at the end)."""
    mt = max_tokens_per_batch
    recorded = probed.calls if probed is not None else {}
    modes = probed.modes if probed is not None else {}
    for name in set(recorded) - {it.list_name for it in plan.items if it.kind == "chain" and len(it.units) > 1}:
        del recorded[name]  # no chain item replays this list

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

    try:
        for item in plan.items:
            if item.kind == "pass" or len(item.units) == 1:
                yield item.units[0], one_pass(item.units[0])
                continue
            calls = recorded.pop(item.list_name, None)
            if not distributed.all_true(calls is not None):
                calls = None
                for names in item.units:
                    yield names, one_pass(names)
                continue
            lst = model.get_submodule(item.list_name)
            assert isinstance(lst, nn.ModuleList) and calls is not None
            last = item.indices[-1]
            by_index = dict(zip(item.indices, item.units))
            for k in range(last + 1):
                names = by_index.get(k, ())
                unit = {n: mods[n] for n in names}
                stats = holder.open(unit, mt)
                with gathering(model, unit, stats, mt):
                    calls = run_element(lst[k], calls, modes[id(lst[k])], outputs=k < last)
                if names:
                    yield names, done(stats)
            calls = None
    finally:
        recorded.clear()
