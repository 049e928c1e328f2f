"""AWQ's statistics memory: gathered one block at a time (awq_plan), never more than the largest block's at once,
with the same numbers as one float pass over the whole model (the previous implementation, kept below as the
reference), on chained transformer blocks, broken chains, and models without a ModuleList."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms import awq_fold, awq_search, awq_stats
from modelopt_lite.algorithms.awq import awq, candidates, check_params
from modelopt_lite.algorithms.awq_decide import search_quantizer

BS = 16


class Layer(nn.Module):
    """A pre-norm transformer block: ln1 feeds q/k/v (one folded scale), ln2 feeds up, mid feeds only down (a fold
    into a Linear's rows); the residual adds and the attention keep the other scales as pre_quant_scale."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.mid, self.down = nn.Linear(d, f), nn.Linear(f, f), nn.Linear(f, d)
        with torch.no_grad():
            for m in (self.ln1, self.ln2):
                m.weight.uniform_(0.3, 3.0)
                m.bias.uniform_(-0.5, 0.5)

    def forward(self, x, mask=None):
        h = self.ln1(x)
        s = self.q(h) @ self.k(h).transpose(-1, -2) / math.sqrt(h.shape[-1])
        if mask is not None:
            s = s + mask
        x = x + self.o(torch.softmax(s, -1) @ self.v(h))
        h = self.ln2(x)
        return x + self.down(self.mid(torch.nn.functional.gelu(self.up(h))))


class Toy(nn.Module):
    """A Linear, three blocks of different widths in a ModuleList, a head. ``skip``: a batch of this many rows skips
    block 1 (a later batch that breaks the chain); ``scale_between``: the loop between blocks changes the hidden
    state (never a chain)."""

    def __init__(self, ffn=(32, 64, 48), d=32, cin=16, skip=None, scale_between=False):
        super().__init__()
        self.inp = nn.Linear(cin, d)
        self.layers = nn.ModuleList(Layer(d, f) for f in ffn)
        self.head = nn.Linear(d, 16)
        self.skip, self.scale_between = skip, scale_between

    def forward(self, x, mask=None):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            if i == 1 and self.skip is not None and x.shape[0] == self.skip:
                continue
            h = layer(h, mask=mask)
            if self.scale_between:
                h = h * 0.5
        return self.head(h)


def _batches(n=4, cin=16, seed=0, rows=2):
    g = torch.Generator().manual_seed(seed)
    col = torch.rand(cin, generator=g) * 3 + 0.05
    col[3] *= 20  # an outlier channel
    return [torch.randn(rows if i < n - 1 else 1, 9, cin, generator=g) * col for i in range(n)]


def _loop(batches, calls=None):
    mask = torch.zeros(9, 9)
    mask[:, -2:] = -1e4

    def loop(m):
        if calls is not None:
            calls.append(1)
        for x in batches:
            assert torch.isfinite(m(x, mask=mask)).all()  # the loop may use the output: it is never None

    return loop


def _configured(model):
    cfg = {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: BS}, "axis": None}}
    return mtq.quantize(model, {"quant_cfg": cfg, "algorithm": None})


def _one_pass(model, loop, algorithm, **params):
    """The previous implementation: every layer's statistics from one float pass, then the scale searches in the
    tracer's order, each applied at once, then the clip searches on the final weights. Returns (scales, ratios)."""
    p = check_params({"progress": False, **params})
    lite, clip = algorithm in ("awq_lite", "awq_full"), algorithm in ("awq_clip", "awq_full")
    mods = candidates(model, clip=clip and not lite)
    trace = awq_fold.Tracer(model, mods) if lite else None
    stats = awq_stats.collect(model, mods, loop, p["max_tokens_per_batch"] if clip else None, trace)
    scales: dict = {}
    for names, producer in trace.groups() if lite else []:
        wqs = [search_quantizer(mods[n]) for n in names]
        st = stats[names[0]]
        bss = [awq_search.block_size(q, n) for q, n in zip(wqs, names)]
        alphas = awq_search.alpha_grid(p["alpha_step"])
        ws = [mods[n].weight for n in names]
        _, s, _ = awq_search.search_scale_group(ws, st.act_mean, st.gram, st.count, wqs, alphas, bss)
        if s is None:
            continue
        with torch.no_grad():
            for n in names:
                mods[n].weight.mul_(s)
            if producer is not None:
                awq_fold.fold(producer, s)
        for n in names:
            if producer is None:
                mods[n].input_quantizer.pre_quant_scale = 1.0 / s
            scales[n] = s
    ratios = {}
    for n in mods if clip else []:
        st, wq = stats[n], search_quantizer(mods[n])
        gram, count = (st.clip_gram, st.clip_count) if st.clip_gram is not None else (st.gram, st.count)
        if n in scales:
            inv = (1.0 / scales[n]).double()
            gram = gram * inv[:, None] * inv[None, :]
        ratios[n] = awq_search.search_clip(
            mods[n].weight, gram, count, wq, awq_search.clip_ratios(0.5, 0.05), BS, p["max_co_batch_size"]
        )[1]
    return scales, ratios


def _elements(model, names, clip_gram: bool) -> int:
    """Statistic numbers of ``names``: sum |x| (in) and X^T X (in^2), twice the Gram with a clip subsample."""
    mods = dict(model.named_modules())
    return sum(mods[n].weight.shape[1] * (1 + mods[n].weight.shape[1] * (2 if clip_gram else 1)) for n in names)


def _assert_same(seq, ref, scales, ratios, algorithm):
    for (k, a), (k2, b) in zip(seq.named_parameters(), ref.named_parameters()):
        assert k == k2 and torch.equal(a, b), k
    for n, m in seq.named_modules():
        if hasattr(m, "weight_quantizer"):
            lite = getattr(m, "awq_lite", None)
            got = None if lite is None else lite.scale
            assert (got is None) == (n not in scales), n
            assert got is None or torch.equal(got, scales[n]), n
            pqs, pqs_ref = (
                m.input_quantizer.pre_quant_scale,
                dict(ref.named_modules())[n].input_quantizer.pre_quant_scale,
            )
            assert (pqs is None) == (pqs_ref is None) and (pqs is None or torch.equal(pqs, pqs_ref)), n
            if algorithm != "awq_lite":
                assert torch.equal(m.awq_clip.ratio, ratios[n]), n


@pytest.mark.parametrize(
    ("algorithm", "params"),
    [("awq_lite", {}), ("awq_full", {"max_tokens_per_batch": 4}), ("awq_clip", {})],
)
def test_peak_is_the_largest_block_and_results_equal_one_pass(algorithm, params):
    torch.manual_seed(0)
    model = _configured(Toy())
    ref = copy.deepcopy(model)
    batches, calls = _batches(), []
    holder = awq_stats.StatsHolder()
    awq(model, _loop(batches, calls), algorithm, holder=holder, debug=True, progress=False, **params)
    scales, ratios = _one_pass(ref, _loop(batches), algorithm, **params)
    _assert_same(model, ref, scales, ratios, algorithm)
    if algorithm != "awq_clip":
        assert scales and any(n.endswith(".mid") and n in scales for n in scales)  # the searches did scale
        assert model.layers[0].down.awq_lite.folded_into in ("layers.0.mid", "")
    clip_gram = "max_tokens_per_batch" in params
    blocks = [[f"layers.{i}.{n}" for n in ("q", "k", "v", "o", "up", "mid", "down")] for i in range(3)]
    per_block = [_elements(model, b, clip_gram) for b in blocks]
    total = sum(per_block) + _elements(model, ["inp", "head"], clip_gram)
    assert per_block[1] == max(per_block) and per_block[1] > _elements(model, ["inp"], clip_gram)
    assert holder.peak == per_block[1] < total  # the widest block's statistics, never two blocks at once
    assert holder.alive == 0 and holder.stats == {}
    assert len(calls) == 3  # the probe (recording block 0's inputs: the chain needs no pass), "inp", "head"


@pytest.mark.parametrize("variant", ["later_batch_breaks_the_chain", "no_chain", "sequential"])
def test_without_a_chain_each_unit_is_one_pass_with_equal_results(variant):
    torch.manual_seed(1)
    if variant == "sequential":  # no ModuleList at all: one pass per layer group
        model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 32), nn.Linear(32, 8))
        batches = [b.reshape(-1, 16) for b in _batches(seed=2)]

        def loop(m):
            for x in batches:
                m(x)
    else:
        model = Toy(skip=1) if variant == "later_batch_breaks_the_chain" else Toy(scale_between=True)
        batches, loop = _batches(seed=2), _loop(_batches(seed=2))
    model = _configured(model)
    ref = copy.deepcopy(model)
    holder = awq_stats.StatsHolder()
    awq(model, loop, "awq_full", holder=holder, debug=True, progress=False)
    scales, ratios = _one_pass(ref, loop, "awq_full")
    _assert_same(model, ref, scales, ratios, "awq_full")
    assert scales
    if variant == "sequential":  # units [1] (its scale folds into the norm), [3], [4] (its scale folds into 3's
        # rows): layer 3's clip search needs its final weight, so its Gram (48 x 48) waits for unit [4]'s decision
        assert model[4].awq_lite.folded_into in ("3", "")
        assert holder.peak == 48 * 48 + _elements(model, ["4"], False)
    else:
        blocks = [[f"layers.{i}.{n}" for n in ("q", "k", "v", "o", "up", "mid", "down")] for i in range(3)]
        assert holder.peak == max(_elements(model, b, False) for b in blocks)


def test_a_stuck_layer_group_waits_but_results_hold():
    """A consumer whose group comes before its producer's in the tracer's (definition) order: the producer's scale
    search must see the consumer's fold, as the one-pass implementation did."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Linear(32, 16)  # defined first, called second: reads only a's output (fold into a's rows)
            self.a = nn.Linear(16, 32)

        def forward(self, x):
            return self.b(self.a(x))

    torch.manual_seed(3)
    model = _configured(Odd())
    ref = copy.deepcopy(model)
    batches = [b.reshape(-1, 16) for b in _batches(seed=4)]

    def loop(m):
        for x in batches:
            m(x)

    awq(model, loop, "awq_full", debug=True, progress=False)
    scales, ratios = _one_pass(ref, loop, "awq_full")
    assert model.b.awq_lite.folded_into == "a"
    _assert_same(model, ref, scales, ratios, "awq_full")
