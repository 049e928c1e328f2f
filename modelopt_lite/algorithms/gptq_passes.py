"""How GPTQ reaches the input of a layer group: a full pass of the user's loop, a replay of the group's block, or the
next block of a chain computed from the previous one (:class:`Feed`).

Every pass of the user's loop runs the whole model, so every call of the model returns its real output to the loop
(a loop may pool, score or log what the model returns). The statistics of a pass come from the first call of the
group's first layer in each forward of the model, and the block around the group (an element of an
``nn.ModuleList``, see :func:`~.block_replay.blocks_of`) is recorded up to that call, as a pass stopped there would
record it. Later groups of the same block replay the block alone on those inputs (stopped inside the replay, out of
the loop's sight). When the recorded block is an element of a chain (:class:`~.block_replay.ChainWatch`: each
element called once per forward, element ``k + 1`` reading element ``k``'s output and the same other arguments) and
no layer outside it has changed since the recording, the next block's inputs are element ``k``'s outputs on its
recorded inputs, with its current (GPTQ) weights (:func:`~.block_replay.run_element`): the numbers a pass of the
loop would give, without one. So a chain of blocks costs one pass of the loop, plus one run of each block. Under
``torch.distributed`` the ranks agree on whether a block is a chain (every rank runs the same passes of its loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..calib.distributed import all_true
from .block_replay import BlockCache, ChainWatch, Stop, copied, elements, replay, run_element


@dataclass
class Feed(BlockCache):
    """A :class:`BlockCache` that knows, when the recorded block is an element of a chain, the list (``owner``), the
    block's index in it and the training flags of every element (``modes_of``), so the cache can move on to the
    next element (:meth:`advance`). ``stale``: a layer outside ``block`` changed since the inputs were recorded (the
    recorded inputs no longer are what the model would feed the block: no advancing)."""

    owner: nn.ModuleList | None = None
    index: int = -1
    modes_of: dict = field(default_factory=dict)
    stale: bool = False

    def note_changed(self, layers) -> None:
        """Record that the weights of ``layers`` changed."""
        inside = set() if self.block is None else {id(m) for m in self.block.modules()}
        if any(id(m) not in inside for m in layers):
            self.stale = True

    def advance(self, block: nn.Module | None) -> None:
        """If ``block`` is a later element of the chain the cache lies in, and nothing outside the cached block
        changed, run the elements in between on the cached inputs: the cache then holds ``block``'s inputs."""
        if block is None or self.block is block or self.owner is None or self.stale:
            return
        target = next((i for i, e in enumerate(self.owner) if e is block), None)
        if target is None or target <= self.index:
            return
        calls = self.calls
        for j in range(self.index, target):
            calls = run_element(self.owner[j], calls, self.modes_of[id(self.owner[j])])
        self.block, self.calls, self.index, self.modes = block, calls, target, self.modes_of[id(block)]

    def clear(self) -> None:
        self.calls, self.modes, self.modes_of = [], [], {}


def _owner_of(model: nn.Module, block: nn.Module | None):
    """``(list, index)`` of the ModuleList element ``block``, or ``(None, -1)``."""
    if block is None:
        return None, -1
    for e in elements(model):
        if e.module is block:
            return e.owner, e.index
    return None, -1


def _loop_pass(model: nn.Module, first: nn.Module, hook, forward_loop, block, feed: Feed | None) -> None:
    """One full pass of the loop: ``hook`` sees the first call of ``first`` in each forward; the block's calls up to
    that one are recorded into ``feed`` (with what advancing along a chain needs)."""
    rec = Feed(block)
    state = {"seen": True}
    owner, index = _owner_of(model, block) if feed is not None else (None, -1)

    def on_start(_m, _a):  # each forward of the model, before anything inside it runs
        state["seen"] = False
        rec.calls.append([])

    def first_pre(m, inp):
        if not state["seen"]:
            state["seen"] = True
            hook(m, inp)

    def block_pre(_m, args, kwargs):
        if state["seen"]:
            return
        if not rec.modes:
            rec.modes = [(m, m.training) for m in block.modules()]
        rec.calls[-1].append((copied(args), copied(kwargs)))

    handles = [model.register_forward_pre_hook(on_start, prepend=True)]
    if feed is not None and block is not None:
        handles.append(block.register_forward_pre_hook(block_pre, with_kwargs=True))
    handles.append(first.register_forward_pre_hook(first_pre))
    watch = ChainWatch(model, [owner] if owner is not None else [])
    try:
        with watch.watching():
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    if feed is None:
        return
    chained = owner is not None and watch.chained(owner) and all(len(c) == 1 for c in rec.calls)
    if owner is not None:  # every rank must run the same passes of the loop (it may hold collectives)
        chained = all_true(chained)
    feed.block, feed.calls, feed.modes, feed.stale = rec.block, rec.calls, rec.modes, False
    feed.owner, feed.index = (owner, index) if chained else (None, -1)
    feed.modes_of = dict(watch.modes) if chained else {}


def passes(model: nn.Module, first: nn.Module, hook, forward_loop, block, feed: Feed | None) -> None:
    """Show ``hook`` (a forward pre-hook of ``first``) the input of ``first`` once per forward of the loop: from the
    block's recorded inputs when ``feed`` holds (or can move on to) them, else from a full pass of the loop."""
    with torch.no_grad():
        if feed is not None:
            feed.advance(block)
        if feed is not None and block is not None and feed.block is block:

            def stop_after(m, inp):
                hook(m, inp)
                raise Stop  # ends this replayed call of the block (never inside the user's loop)

            handle = first.register_forward_pre_hook(stop_after)
            try:
                replay(feed)
            finally:
                handle.remove()
        else:
            _loop_pass(model, first, hook, forward_loop, block, feed)
