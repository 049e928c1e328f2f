"""auto_quantize: the exact search, the effective-bits budget, the scores and the returned model."""

from __future__ import annotations

import copy
import importlib
import itertools
import random

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms.auto_quantize import auto_quantize, format_table, layer_bits
from modelopt_lite.algorithms.auto_quantize_search import solve

#: the module (the package attribute of the same name is the function)
aq_mod = importlib.import_module("modelopt_lite.algorithms.auto_quantize")

INT4 = mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG
INT8 = mtq.INT8_DEFAULT_CFG


# --- the solver ----------------------------------------------------------------------------------------------------
def _brute(scores, costs, budget):
    best = None
    for choice in itertools.product(*(range(len(s)) for s in scores)):
        c = sum(costs[g][k] for g, k in enumerate(choice))
        if c <= budget:
            s = sum(scores[g][k] for g, k in enumerate(choice))
            best = s if best is None else min(best, s)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_solver_equals_brute_force(seed):
    rng = random.Random(seed)
    groups = rng.randint(1, 6)
    frac = seed % 2 == 1
    scores = [[rng.choice([0.0, rng.random() * 10]) for _ in range(rng.randint(1, 4))] for _ in range(groups)]
    costs = [[(rng.random() * 20 if frac else rng.randint(0, 20)) for _ in s] for s in scores]
    lo, hi = sum(min(c) for c in costs), sum(max(c) for c in costs)
    budget = lo + (hi - lo) * rng.random()
    sol = solve(scores, costs, budget)
    assert sol.exact
    assert sol.cost <= budget
    assert sol.cost == pytest.approx(sum(costs[g][k] for g, k in enumerate(sol.choice)))
    assert sol.score == pytest.approx(sum(scores[g][k] for g, k in enumerate(sol.choice)))
    assert sol.score == pytest.approx(_brute(scores, costs, budget), abs=1e-9)


def test_solver_rounded_costs_stay_in_budget():
    rng = random.Random(7)
    scores = [[rng.random(), rng.random(), 0.0] for _ in range(8)]
    costs = [[rng.random() * 4, rng.random() * 8 + 4, 16.0] for _ in range(8)]
    budget = 60.0
    sol = solve(scores, costs, budget, max_states=4)
    assert not sol.exact
    assert sol.cost <= budget
    assert sol.score >= _brute(scores, costs, budget) - 1e-12


def test_solver_errors():
    with pytest.raises(ValueError, match="cheapest assignment costs 3"):
        solve([[1.0, 0.0]], [[3.0, 5.0]], 2.0)
    with pytest.raises(ValueError, match="non-finite"):
        solve([[float("nan")]], [[1.0]], 2.0)
    with pytest.raises(ValueError, match="group 0 has 2 scores and 1 costs"):
        solve([[1.0, 0.0]], [[1.0]], 2.0)


# --- models --------------------------------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16)).eval()


def _problem(model, n=3):
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, model[0].in_features, generator=g) for _ in range(n)]
    with torch.no_grad():  # targets: the float output plus noise (a sampled Fisher: the gradient is not 0)
        ref = {id(x): model(x) + torch.randn(model(x).shape, generator=g) for x in data}
    return data, (lambda m, b: m(b)), (lambda out, b: ((out - ref[id(b)]) ** 2).sum())


def _model_effective_bits(model, names):
    mods = dict(model.named_modules())
    num = sum(mods[n].weight.numel() * layer_bits(mods[n]) for n in names)
    return num / sum(mods[n].weight.numel() for n in names)


@pytest.mark.parametrize("bits", [4.0, 5.0, 6.0, 7.5, 16.0])
def test_budget_respected(bits):
    m = _mlp()
    data, fs, lf = _problem(m)
    q, st = auto_quantize(m, {"effective_bits": bits}, [INT4, INT8], data, fs, lf, num_calib_steps=3, num_score_steps=3)
    assert q is m
    names = ["0", "2", "4"]
    eb = _model_effective_bits(q, names)
    assert eb <= bits
    assert st["best"]["constraints"]["effective_bits"] == pytest.approx(eb)
    assert st["best"]["is_satisfied"] and st["best"]["exact"]
    assert set(st["best"]["layer_recipe"]) == set(names)
    for s in st["candidate_stats"].values():
        assert s["formats"] == ["INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT8_DEFAULT_CFG", "NONE"]
        assert s["bits"] == [4, 8, 16]
        assert s["scores"] == sorted(s["scores"], reverse=True)  # non-increasing with bits
    if bits == 4.0:
        assert set(st["best"]["recipe"].values()) == {"INT4_BLOCKWISE_WEIGHT_ONLY_CFG"}
    text = format_table(st)
    assert "score[INT8_DEFAULT_CFG]" in text and "effective bits" in text


def test_uniform_choice_equals_quantize():
    """Every layer INT4 (budget 4): the returned model is exactly quantize() with that preset's calibration."""
    m = _mlp()
    data, fs, lf = _problem(m)
    expect = mtq.quantize(copy.deepcopy(m), INT4, lambda mm: [mm(x) for x in data])
    q, st = auto_quantize(m, {"effective_bits": 4}, [INT4, INT8], data, fs, lf, num_calib_steps=3, num_score_steps=1)
    with torch.no_grad():
        assert torch.equal(q(data[0]), expect(data[0]))
    assert st["best"]["score"] == pytest.approx(sum(r["scores"]["INT4_BLOCKWISE_WEIGHT_ONLY_CFG"] for r in st["table"]))


class _TwoBranch(nn.Module):
    """Two equal Linear branches; the loss sees branch ``a`` scaled by 30, so ``a`` is far more sensitive."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(128, 64)
        self.b = nn.Linear(128, 64)

    def forward(self, x):
        return torch.cat([30 * self.a(x), self.b(x)], -1)


@pytest.mark.parametrize("method", ["gradient", "sensitivity"])
def test_most_sensitive_layer_keeps_higher_precision(method):
    m = _TwoBranch().eval()
    data = [torch.randn(16, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    noise = torch.randn(16, 128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # targets off the float output, so the loss gradient at the float model is not 0
        ref = {id(x): m(x) + noise for x in data}
    _, st = auto_quantize(
        m,
        {"effective_bits": 6},  # one layer at 8 bits and one at 4
        [INT4, INT8],
        data,
        lambda mm, b: mm(b),
        lambda out, b: ((out - ref[id(b)]) ** 2).sum(),
        method=method,
        num_calib_steps=2,
        num_score_steps=2,
    )
    assert st["best"]["recipe"] == {"a": "INT8_DEFAULT_CFG", "b": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"}


def test_gradient_warns_when_the_loss_gradient_vanishes():
    m = _mlp()
    data, fs, _ = _problem(m)
    with torch.no_grad():  # loss = distance to the float model's own output: gradient 0 at the float model
        ref = {id(x): m(x) for x in data}
    lf = lambda out, b: ((out - ref[id(b)]) ** 2).sum()  # noqa: E731
    with pytest.warns(UserWarning, match="every gradient score is 0"):
        auto_quantize(m, {"effective_bits": 6}, [INT4, INT8], data, fs, lf, num_score_steps=1)


def test_layer_error_method_needs_no_loss_and_ranks_output_error():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.a, self.b = nn.Linear(128, 64), nn.Linear(128, 64)
            with torch.no_grad():
                self.a.weight.mul_(30)  # 30x the weights: 30x the output error of the same format

        def forward(self, x):
            return self.a(x) + self.b(x)

    m = Net().eval()
    data = [torch.randn(16, 128, generator=torch.Generator().manual_seed(0))]
    _, st = auto_quantize(m, {"effective_bits": 6}, [INT4, INT8], data, lambda mm, b: mm(b), method="layer_error")
    assert st["best"]["recipe"] == {"a": "INT8_DEFAULT_CFG", "b": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"}


def _int4_blocks_by_hand(w: torch.Tensor) -> torch.Tensor:
    blocks = w.reshape(w.shape[0], -1, 128)
    scale = blocks.abs().amax(-1, keepdim=True).float() / 7.0
    return (torch.clamp(torch.round(blocks / scale), -8, 7) * scale).reshape(w.shape)


def test_scores_match_hand_computation_on_one_layer():
    torch.manual_seed(5)
    lin = nn.Linear(256, 3)
    w, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    data = [torch.randn(4, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    target = torch.randn(4, 3, generator=torch.Generator().manual_seed(9))

    def model():
        return nn.Sequential(copy.deepcopy(lin))

    fs = lambda m, b: m(b)  # noqa: E731
    lf = lambda out, b: ((out - target) ** 2).sum()  # noqa: E731
    wq = _int4_blocks_by_hand(w)
    grad = hand_err = sens = 0.0
    for x in data:
        y, yq = x @ w.T + bias, x @ wq.T + bias
        g = 2 * (y - target)  # dL/dy of the float model
        grad += float(((g * (yq - y)) ** 2).sum())
        hand_err += float(((yq - y) ** 2).sum())
        sens += float(((yq - target) ** 2).sum() - ((y - target) ** 2).sum())
    for method, expect in (("gradient", grad), ("layer_error", hand_err), ("sensitivity", sens)):
        _, st = auto_quantize(model(), {"effective_bits": 16}, [INT4], data, fs, lf, method=method, num_calib_steps=2)
        raw = st["candidate_stats"]["0"]["raw_scores"]
        assert raw[1] == 0.0  # NONE
        assert raw[0] == pytest.approx(expect, rel=1e-4), method
        assert expect != 0


def test_qkv_share_one_format():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(6)
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(128, 64), nn.Linear(128, 64), nn.Linear(128, 64)
            self.o_proj = nn.Linear(64, 128)

        def forward(self, x):
            return self.o_proj(self.q_proj(x) * self.k_proj(x) + self.v_proj(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

        def forward(self, x):
            return self.attn(x)

    m = Net().eval()
    data = [torch.randn(8, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    _, st = auto_quantize(m, {"effective_bits": 6}, [INT4, INT8], data, lambda mm, b: mm(b), method="layer_error")
    assert list(st["candidate_stats"]) == ["attn.*", "attn.o_proj"]
    assert st["candidate_stats"]["attn.*"]["module_names"] == ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
    rec = st["best"]["layer_recipe"]
    assert rec["attn.q_proj"] == rec["attn.k_proj"] == rec["attn.v_proj"]


def test_disabled_layers_stay_float_and_out_of_the_cost():
    m = _mlp()
    data, fs, lf = _problem(m)
    q, st = auto_quantize(m, {"effective_bits": 4}, [INT4], data, fs, lf, disabled_layers="4")
    assert list(st["candidate_stats"]) == ["0", "2"]
    assert not any(t.is_enabled for t in (q[4].weight_quantizer, q[4].input_quantizer))
    assert q[0].weight_quantizer.is_enabled


# --- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"constraints": {"effective_bits": 0}}, r"effective_bits'\] must be a number in \(0, 16\], got 0"),
        ({"constraints": {"effective_bits": 17}}, "got 17"),
        ({"constraints": {"effective_bits": "6"}}, "got '6'"),
        ({"constraints": {"bits": 6}}, "must be a dict with 'effective_bits'"),
        ({"constraints": {"effective_bits": 6, "size": 1}}, r"unknown constraint key\(s\) \['size'\]"),
        ({"constraints": {"effective_bits": 6, "cost_model": "active_moe"}}, "cost_model 'active_moe'"),
        ({"constraints": {"effective_bits": 3.5}}, "below the least reachable, 4.0000"),
        ({"quantization_formats": INT8}, "quantization_formats must be a list, got dict"),
        ({"quantization_formats": []}, "non-empty list"),
        ({"quantization_formats": [None]}, "at least one non-None format"),
        ({"quantization_formats": ["INT3_CFG"]}, r"quantization_formats\[0\] 'INT3_CFG' is not a preset name"),
        ({"quantization_formats": [42]}, r"quantization_formats\[0\] must be a config dict"),
        ({"quantization_formats": [{**INT8, "algorithm": {"method": "smoothquant", "alpha": 2}}]}, "alpha must be"),
        ({"method": "kl"}, "invalid method 'kl'"),
        ({"loss_func": None}, "method 'gradient' needs loss_func or forward_backward_step"),
        ({"num_score_steps": 0}, "num_score_steps must be an int >= 1, got 0"),
        ({"data_loader": []}, "yielded no batch"),
    ],
)
@pytest.mark.filterwarnings("ignore:auto_quantize. received a custom quantization format")
def test_bad_arguments(kwargs, match):
    m = _mlp()
    data, fs, lf = _problem(m)
    calls = []
    args = dict(
        constraints={"effective_bits": 6},
        quantization_formats=[INT4, INT8],
        data_loader=data,
        forward_step=lambda mm, b: calls.append(1) or mm(b),
        loss_func=lf,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        auto_quantize(m, **args)
    assert not calls  # refused before any calibration or scoring
    assert type(m[0]) is nn.Linear  # the caller's model untouched


def test_verbose_logs_the_table(caplog):
    m = _mlp()
    data, fs, lf = _problem(m)
    with caplog.at_level("INFO", logger=aq_mod.__name__):
        auto_quantize(m, {"effective_bits": 6}, [INT4, INT8], data, fs, lf, verbose=True, num_score_steps=1)
    text = caplog.text
    assert "score[INT4_BLOCKWISE_WEIGHT_ONLY_CFG]" in text and "effective bits" in text


def test_lazy_export():
    assert mtq.auto_quantize is auto_quantize


def test_layers_no_format_quantizes_are_not_searched_nor_counted():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(8)
            self.emb = nn.Embedding(1000, 128)  # off in every preset: 128000 weights that must not enter the cost
            self.fc = nn.Linear(128, 128)

        def forward(self, ids):
            return self.fc(self.emb(ids))

    m = Net().eval()
    data = [torch.randint(0, 1000, (4, 8), generator=torch.Generator().manual_seed(0))]
    q, st = auto_quantize(m, {"effective_bits": 4}, [INT4, INT8], data, lambda mm, b: mm(b), method="layer_error")
    assert list(st["candidate_stats"]) == ["fc"]
    assert st["total_params"] == 128 * 128
    assert st["best"]["recipe"] == {"fc": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"}
    assert not any(t.is_enabled for t in (q.emb.weight_quantizer,) if hasattr(q.emb, "weight_quantizer"))
