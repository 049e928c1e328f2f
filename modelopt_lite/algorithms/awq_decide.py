"""AWQ's decisions, block by block: the scale search of each layer group and the clip search of each layer, run as
soon as the statistics they read have been gathered (:mod:`.awq_plan`), applied to the model only at the end.

Nothing changes in the model while statistics are gathered, so every pass sees the float model. Each search still
sees the weights the one-pass implementation gave it: a group's scale search reads its layers' weights with the
decisions of the *earlier* groups (in the fold tracer's order) that touch them applied to a copy (a later group's
``1 / s`` folded into the rows of a producing Linear), and a layer's clip search waits until every group that
touches its weight is decided and reads the final weight. :meth:`Decider.apply` then changes the model in group
order, exactly as the searches assumed. Statistics are dropped as soon as no search needs them.
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ..nn import SequentialQuantizer, TensorQuantizer
from . import awq_fold, awq_search
from .awq_stats import LayerStats, StatsHolder


@dataclass
class LiteRecord:
    """The scale search of one layer: ``best_alpha``, ``scale`` (the ``s`` applied), ``loss`` per alpha (key None:
    the unscaled weight), where ``1 / s`` went (``"pre_quant_scale"`` or the producing module's path). ``best_alpha``
    None: no alpha beat the unscaled weight, nothing was changed (``scale`` None, ``folded_into`` "")."""

    best_alpha: float | None
    scale: torch.Tensor | None
    loss: dict
    folded_into: str = "pre_quant_scale"

    @property
    def best_scale(self) -> torch.Tensor | None:
        """ModelOpt's name for ``scale`` (its ``module.awq_lite.best_scale``)."""
        return self.scale


@dataclass
class ClipRecord:
    """The clip search of one layer: ``ratio`` per block (out, n_blocks), ``amax`` loaded, ``loss`` per ratio."""

    ratio: torch.Tensor
    amax: torch.Tensor
    loss: dict

    @property
    def best_clip_val(self) -> torch.Tensor:
        """ModelOpt's ``module.awq_clip.best_clip_val``: ``amax`` in its flat layout, one row per block."""
        return self.amax.reshape(-1, 1)


@dataclass
class _Decision:
    names: list[str]
    producer: tuple | None
    alpha: float | None = None
    scale: torch.Tensor | None = None
    losses: dict | None = None
    skipped: bool = False


def search_quantizer(m: nn.Module) -> TensorQuantizer:
    """The weight quantizer the searches use (the first member of a SequentialQuantizer)."""
    wq = m.weight_quantizer
    return cast(TensorQuantizer, wq[0] if isinstance(wq, SequentialQuantizer) else wq)


class Decider:
    """The searches of one AWQ run over ``groups`` (``[(names, producer (path, module, fold) or None)]``, the
    tracer's order); feed it each unit's statistics with :meth:`add`, then :meth:`apply`."""

    def __init__(self, mods: dict[str, nn.Module], groups: list, p: dict, lite: bool, clip: bool, holder: StatsHolder):
        self.mods, self.groups, self.p, self.lite, self.clip, self.holder = mods, groups, p, lite, clip, holder
        self.alphas = awq_search.alpha_grid(p["alpha_step"])
        self.ratios = awq_search.clip_ratios(p["min_clip_ratio"], p["shrink_step"])
        self.desc = "awq_full" if lite and clip else ("awq_lite" if lite else "awq_clip")
        layer_of = {id(m): n for n, m in mods.items()}
        self.group_of = {n: gi for gi, (names, _) in enumerate(groups) for n in names}
        self.acting: dict[str, list[int]] = {n: [] for n in mods}  # groups whose decision changes n's weight
        for gi, (names, producer) in enumerate(groups):
            for n in names:
                self.acting[n].append(gi)
            if producer is not None and id(producer[1]) in layer_of:
                self.acting[layer_of[id(producer[1])]].append(gi)
        for acts in self.acting.values():
            acts.sort()
        self.decided: dict[int, _Decision] = {}
        self.present: set[str] = set()
        self.clips: dict[str, ClipRecord | None] = {}

    # --- feeding -----------------------------------------------------------------------------------------------
    def add(self, stats: dict[str, LayerStats]) -> None:
        """One unit's statistics have been gathered: run every search that can run now."""
        self.present.update(stats)
        progress = True
        while progress:
            progress = False
            for gi, (names, _) in enumerate(self.groups):
                if gi in self.decided or not all(n in self.present for n in names):
                    continue
                if all(h in self.decided for n in names for h in self.acting[n] if h < gi):
                    self._decide(gi)
                    progress = True
            if self.clip:
                for n in self.mods:
                    if n in self.present and n not in self.clips and all(h in self.decided for h in self.acting[n]):
                        self._clip(n)

    def _stats(self, n: str) -> LayerStats:
        return self.holder.stats[n]

    def _decide(self, gi: int) -> None:
        names, producer = self.groups[gi]
        d = _Decision(list(names), producer)
        if any(self._stats(n).count == 0 for n in names):
            warnings.warn(
                f"{self.desc}: {', '.join(names)} saw no calibration data: max calibration only", stacklevel=4
            )
            d.skipped = True
        elif self.lite:
            st = self._stats(names[0])
            wqs = [search_quantizer(self.mods[n]) for n in names]
            d.alpha, d.scale, d.losses = awq_search.search_scale_group(
                [self.weight(n, gi) for n in names],
                st.act_mean,
                st.gram,
                st.count,
                wqs,
                self.alphas,
                [awq_search.block_size(q, n) for q, n in zip(wqs, names)],
            )
        self.decided[gi] = d
        for n in names:
            if self.clip and not d.skipped:
                self.holder.keep_clip_only(n)
            else:
                self.holder.drop(n)
                self.present.discard(n)
                self.clips[n] = None

    def weight(self, n: str, before: int | None = None) -> torch.Tensor:
        """Layer ``n``'s weight after the decisions of the groups before ``before`` (None: all) that change it."""
        w = cast(torch.Tensor, self.mods[n].weight)
        acts = [self.decided[g] for g in self.acting[n] if (before is None or g < before) and g in self.decided]
        acts = [d for d in acts if d.scale is not None]
        if not acts:
            return w
        w = w.detach().clone()
        with torch.no_grad():
            for d in acts:
                scale = cast(torch.Tensor, d.scale)  # acts keeps the decisions with a scale
                if n in d.names:  # this layer's own scale: its columns times s
                    w.mul_(scale.to(w.device, w.dtype))
                else:  # a later layer's 1 / s folded into this layer's rows, as the fold does to the module
                    assert d.producer is not None  # another group acts on this layer only through its fold
                    d.producer[2](types.SimpleNamespace(weight=w, bias=None), 1.0 / scale)
        return w

    def _clip(self, n: str) -> None:
        m = self.mods[n]
        wq = search_quantizer(m)
        bs = awq_search.block_size(wq, n)
        rec = None
        if bs is not None and not wq.dynamic:
            st = self._stats(n)
            gram, count = (st.clip_gram, st.clip_count) if st.clip_gram is not None else (st.gram, st.count)
            own = self.decided[self.group_of[n]] if self.lite else None
            scale = own.scale if own is not None and n in own.names else None
            if scale is not None:  # the layer now reads x / s
                inv = (1.0 / scale).double().to(gram.device)
                gram = gram * inv[:, None] * inv[None, :]
            amax, ratio, losses = awq_search.search_clip(
                self.weight(n), gram, count, wq, self.ratios, bs, self.p["max_co_batch_size"]
            )
            rec = ClipRecord(ratio, amax, losses)
        self.clips[n] = rec
        self.holder.drop(n)
        self.present.discard(n)

    # --- the end -----------------------------------------------------------------------------------------------
    def apply(self) -> dict[str, dict]:
        """Change the model by every decision, in group order; returns the records (as :func:`~.awq.awq`)."""
        missing = [", ".join(self.groups[gi][0]) for gi in range(len(self.groups)) if gi not in self.decided]
        if missing:  # every unit is gathered before this: a bug, not bad input
            raise RuntimeError(f"awq: no statistics were gathered for {missing}")
        records: dict[str, dict] = {}
        for gi in range(len(self.groups)):
            d = self.decided[gi]
            if self.lite and not d.skipped:
                self._apply_scale(d, records)
        for n in self.mods:
            rec = self.clips.get(n)
            if rec is not None:
                records.setdefault(n, {})["awq_clip"] = rec
        return records

    def _apply_scale(self, d: _Decision, records: dict) -> None:
        names, producer, scale = d.names, d.producer, d.scale
        if scale is None:  # no alpha beats the unscaled weights
            for n in names:
                records.setdefault(n, {})["awq_lite"] = LiteRecord(None, None, d.losses or {}, "")
            return
        with torch.no_grad():
            for n in names:
                w = cast(torch.Tensor, self.mods[n].weight)
                w.mul_(scale.to(w.device, w.dtype))
            where = awq_fold.fold(producer, scale) if producer is not None else None
        pq = getattr(producer[1], "weight_quantizer", None) if producer is not None else None
        if pq is not None:  # a producing Linear's rows changed: its weight is calibrated again
            pq.reset_amax()
        for n in names:
            if where is None:
                iq = cast(TensorQuantizer, self.mods[n].input_quantizer)
                old = iq.pre_quant_scale
                inv = (1.0 / scale).to(cast(torch.Tensor, self.mods[n].weight).device)
                iq.pre_quant_scale = inv if old is None else old.to(inv.device) * inv
            records.setdefault(n, {})["awq_lite"] = LiteRecord(
                d.alpha, scale.clone(), d.losses or {}, where or "pre_quant_scale"
            )
