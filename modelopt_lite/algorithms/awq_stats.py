"""The activation statistics AWQ searches on: per quantized Linear, the sums ``sum |x_j|`` and ``X^T X`` over every
calibration token, gathered from the float model for one block (or layer group) at a time (:mod:`.awq_plan`) and
held by a :class:`StatsHolder`, which counts the statistic numbers alive (``peak``: the most at once).

With the Gram matrix ``G = X^T X`` of a layer's inputs, the squared output error of any candidate weight ``W'`` is
``sum((X W'^T - X W^T)^2) = trace(D G D^T)`` with ``D = W' - W``: every candidate of the scale and clip searches is
scored on *all* calibration tokens without running the model again (ModelOpt runs the loop once per search stage).

Sums are accumulated in float64 (each batch's Gram is computed in float32, then added), and under
``torch.distributed`` they are all-reduced (SUM) across ranks, so ranks that split the calibration data end with the
statistics one process would have gathered on all of it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ..calib import distributed
from ..conversion.state import snapshot_quantizers
from ..conversion.utils import named_quantizers
from ..nn import TensorQuantizer


@dataclass
class LayerStats:
    """What one Linear saw: ``count`` tokens, ``abs_sum`` (in,) and ``gram`` (in, in), float64."""

    abs_sum: torch.Tensor
    gram: torch.Tensor
    count: int = 0
    clip_gram: torch.Tensor | None = None  #: the Gram of ``max_tokens_per_batch`` strided tokens per batch, if asked
    clip_count: int = 0
    pqs: torch.Tensor | None = field(default=None, repr=False)  #: the input's pre_quant_scale at collection time

    @property
    def act_mean(self) -> torch.Tensor:
        """The mean ``|x_j|`` per input channel (float32)."""
        return (self.abs_sum / max(self.count, 1)).float()


def _input_of(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as the layer's matmul sees it: times the input quantizer's existing ``pre_quant_scale``, if any."""
    pqs = getattr(module.input_quantizer, "pre_quant_scale", None)
    return x if pqs is None else x * (pqs.reshape(()) if pqs.numel() == 1 else pqs).to(x.dtype)


class StatsHolder:
    """The live :class:`LayerStats` of one AWQ run, by layer path, with a tally of the statistic elements alive
    (``abs_sum``, ``gram`` and ``clip_gram`` numbers): ``alive`` now, ``peak`` the most at once. AWQ opens the
    statistics of one block (or layer group) at a time and drops them once searched (:mod:`.awq_plan`)."""

    def __init__(self) -> None:
        self.stats: dict[str, LayerStats] = {}
        self.alive = 0
        self.peak = 0

    @staticmethod
    def _size(st: LayerStats) -> int:
        return st.abs_sum.numel() + st.gram.numel() + (0 if st.clip_gram is None else st.clip_gram.numel())

    def open(self, mods: dict[str, nn.Module], max_tokens_per_batch: int | None) -> dict[str, LayerStats]:
        """Zeroed statistics for each of ``mods`` (with a ``clip_gram`` when ``max_tokens_per_batch`` is set)."""
        out: dict[str, LayerStats] = {}
        for name, m in mods.items():
            w = cast(torch.Tensor, m.weight)
            n_in = w.shape[1]
            st = LayerStats(
                torch.zeros(n_in, dtype=torch.float64, device=w.device),
                torch.zeros(n_in, n_in, dtype=torch.float64, device=w.device),
            )
            if max_tokens_per_batch is not None:
                st.clip_gram = torch.zeros_like(st.gram)
            self.drop(name)
            self.stats[name] = out[name] = st
            self.alive += self._size(st)
        self.peak = max(self.peak, self.alive)
        return out

    def keep_clip_only(self, name: str) -> None:
        """Free all of ``name``'s statistics but the Gram its clip search reads."""
        st = self.stats.get(name)
        if st is None:
            return
        self.alive -= self._size(st)
        if st.clip_gram is not None:
            st.gram, st.clip_gram = st.clip_gram, None
            st.count = st.clip_count
        st.abs_sum = torch.zeros(0, dtype=torch.float64, device=st.abs_sum.device)
        self.alive += self._size(st)

    def drop(self, name: str) -> None:
        """Free ``name``'s statistics (nothing if it has none)."""
        st = self.stats.pop(name, None)
        if st is not None:
            self.alive -= self._size(st)


def _hook(name: str, st: LayerStats, max_tokens_per_batch: int | None):
    def pre(m, inp):
        x = inp[0] if inp else None
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.numel() == 0:
            return
        x = _input_of(m, x.detach()).reshape(-1, x.shape[-1]).float()
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"awq: the input of {name} contains NaN or Inf")
        st.abs_sum += x.abs().sum(0).to(st.abs_sum.device, torch.float64)
        st.gram += (x.T @ x).to(st.gram.device, torch.float64)
        st.count += x.shape[0]
        if max_tokens_per_batch is not None:
            xs = x[:: max(1, x.shape[0] // max_tokens_per_batch)]
            clip_gram = cast(torch.Tensor, st.clip_gram)  # open() made one: max_tokens_per_batch is set
            clip_gram += (xs.T @ xs).to(st.gram.device, torch.float64)
            st.clip_count += xs.shape[0]

    return pre


@contextlib.contextmanager
def gathering(model: nn.Module, mods: dict[str, nn.Module], stats: dict[str, LayerStats], max_tokens_per_batch):
    """Inside this block the model is the float model (every quantizer off; a ``pre_quant_scale`` still applies and
    :func:`_input_of` accounts for it) and each of ``mods`` adds its inputs to ``stats``; quantizer states are
    restored afterwards and each layer's ``pre_quant_scale`` is noted in its statistics."""
    snaps = snapshot_quantizers(q for _, q in named_quantizers(model))
    handles = [mods[n].register_forward_pre_hook(_hook(n, st, max_tokens_per_batch)) for n, st in stats.items()]
    try:
        for _, q in named_quantizers(model):
            assert isinstance(q, TensorQuantizer)
            q.disable()
        with torch.no_grad():
            yield stats
    finally:
        for h in handles:
            h.remove()
        snaps.restore()
    for name, st in stats.items():
        pqs = getattr(mods[name].input_quantizer, "pre_quant_scale", None)
        st.pqs = None if pqs is None else pqs.detach().clone()


def collect(
    model: nn.Module,
    mods: dict[str, nn.Module],
    forward_loop,
    max_tokens_per_batch: int | None = None,
    trace=None,
    holder: StatsHolder | None = None,
) -> dict[str, LayerStats]:
    """Run ``forward_loop(model)`` once with every quantizer off (the float model) and gather each module's input
    statistics; all-reduced across ranks when ``torch.distributed`` is active. Quantizer states are restored.

    ``max_tokens_per_batch``: also a Gram of every ``n // max_tokens_per_batch``-th token of each batch (ModelOpt's
    clip-search subsample). ``trace``: an :class:`~.awq_fold.Tracer` that watches the first forward. ``holder``:
    the :class:`StatsHolder` that tallies them (a new one by default)."""
    stats = (holder or StatsHolder()).open(mods, max_tokens_per_batch)
    with gathering(model, mods, stats, max_tokens_per_batch):
        with trace.active() if trace is not None else contextlib.nullcontext():
            forward_loop(model)
    if distributed.is_active():
        all_reduce(stats)
    return stats


def all_reduce(stats: dict[str, LayerStats]) -> None:
    """Sum every layer's statistics over the ranks (same layers, same order on every rank: checked first)."""
    layout = [(n, tuple(s.gram.shape), s.clip_gram is not None) for n, s in stats.items()]
    metas: list = [None] * dist.get_world_size()
    dist.all_gather_object(metas, layout)
    if any(m != layout for m in metas):
        raise ValueError("awq: the ranks quantize different layers; every rank must run the same model")
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    for s in stats.values():
        n = s.abs_sum.numel()
        clip = s.clip_gram if s.clip_gram is not None else torch.zeros(0, dtype=torch.float64, device=s.gram.device)
        counts = torch.tensor([float(s.count), float(s.clip_count)], dtype=torch.float64, device=s.gram.device)
        buf = torch.cat([s.abs_sum, s.gram.reshape(-1), clip.reshape(-1), counts]).to(dev)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        buf = buf.to(s.gram.device)
        s.abs_sum = buf[:n].clone()
        s.gram = buf[n : n + n * n].reshape(n, n).clone()
        if s.clip_gram is not None:
            s.clip_gram = buf[n + n * n : n + 2 * n * n].reshape(n, n).clone()
        s.count, s.clip_count = int(round(float(buf[-2]))), int(round(float(buf[-1])))
