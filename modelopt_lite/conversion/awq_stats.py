"""The activation statistics AWQ searches on: per quantized Linear, the sums ``sum |x_j|`` and ``X^T X`` over every
calibration token, gathered in one float pass of the user's forward loop.

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

import torch
import torch.distributed as dist
from torch import nn

from ..calib import distributed
from .state import snapshot_quantizers
from .utils import named_quantizers


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


def collect(
    model: nn.Module, mods: dict[str, nn.Module], forward_loop, max_tokens_per_batch: int | None = None, trace=None
) -> dict[str, LayerStats]:
    """Run ``forward_loop(model)`` once with every quantizer off (the float model) and gather each module's input
    statistics; all-reduced across ranks when ``torch.distributed`` is active. Quantizer states are restored.

    ``max_tokens_per_batch``: also a Gram of every ``n // max_tokens_per_batch``-th token of each batch (ModelOpt's
    clip-search subsample). ``trace``: an :class:`~.awq_fold.Tracer` that watches the first forward."""
    stats = {
        name: LayerStats(
            torch.zeros(m.weight.shape[1], dtype=torch.float64, device=m.weight.device),
            torch.zeros(m.weight.shape[1], m.weight.shape[1], dtype=torch.float64, device=m.weight.device),
        )
        for name, m in mods.items()
    }
    if max_tokens_per_batch is not None:
        for st in stats.values():
            st.clip_gram = torch.zeros_like(st.gram)

    def hook(name: str):
        st = stats[name]

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
                st.clip_gram += (xs.T @ xs).to(st.gram.device, torch.float64)
                st.clip_count += xs.shape[0]

        return pre

    snaps = snapshot_quantizers(q for _, q in named_quantizers(model))
    handles = [m.register_forward_pre_hook(hook(name)) for name, m in mods.items()]
    try:
        for _, q in named_quantizers(model):
            q.disable()  # the float model (a pre_quant_scale still applies: _input_of accounts for it)
        with torch.no_grad(), trace.active() if trace is not None else contextlib.nullcontext():
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
        snaps.restore()
    for name, m in mods.items():
        pqs = getattr(m.input_quantizer, "pre_quant_scale", None)
        stats[name].pqs = None if pqs is None else pqs.detach().clone()
    if distributed.is_active():
        _all_reduce(stats)
    return stats


def _all_reduce(stats: dict[str, LayerStats]) -> None:
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
