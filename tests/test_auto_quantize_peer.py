"""auto_quantize against nvidia-modelopt 0.47's (optional: skipped where modelopt is not installed)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as mtq

NAMES = ["INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT8_DEFAULT_CFG"]


def _peer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("modelopt.torch.quantization")


def _problem():
    """A 3-Linear MLP, 3 batches and a squared-error loss to noisy targets (the same for ours and the peer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 256, generator=g) for _ in range(3)]
    with torch.no_grad():
        target = {id(x): model(x) + torch.randn(8, 16, generator=g) for x in data}

    def loss(out, b):
        return ((out - target[id(b)]) ** 2).sum()

    return model, data, loss


def test_gradient_scores_costs_and_recipe_match_modelopt():
    mtq_peer = _peer()
    model, data, loss = _problem()

    args = ({"effective_bits": 6},)
    kw = dict(data_loader=data, forward_step=lambda m, b: m(b), loss_func=loss, num_calib_steps=3, num_score_steps=3)
    _, ours = mtq.auto_quantize(
        copy.deepcopy(model), *args, quantization_formats=[getattr(mtq, n) for n in NAMES], **kw
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, peer = mtq_peer.auto_quantize(
            copy.deepcopy(model), *args, quantization_formats=[getattr(mtq_peer, n) for n in NAMES], **kw
        )
    for name, st in ours["candidate_stats"].items():
        ps = peer["candidate_stats"][f"{name}.quant_recipe"]
        assert [str(f).split("(")[0] for f in ps["formats"]] == st["formats"]
        assert st["scores"] == pytest.approx(ps["scores"], rel=1e-4)
        assert [c / 16 for c in st["costs"]] == pytest.approx(ps["costs"])
    peer_recipe = {k.split(".quant_recipe")[0]: str(v).split("(")[0] for k, v in peer["best"]["recipe"].items()}
    assert ours["best"]["recipe"] == peer_recipe
    assert ours["best"]["constraints"]["effective_bits"] == pytest.approx(peer["best"]["constraints"]["effective_bits"])


def test_kl_div_scores_and_costs_match_modelopt():
    mtq_peer = _peer()
    model, data, _ = _problem()
    with torch.no_grad():  # sharp logits: KL divergences far above float32 rounding of log-probabilities
        model[4].weight.mul_(30)
    kw = dict(data_loader=data, forward_step=lambda m, b: m(b), num_calib_steps=3, num_score_steps=3, method="kl_div")
    _, ours = mtq.auto_quantize(copy.deepcopy(model), {"effective_bits": 6}, [getattr(mtq, n) for n in NAMES], **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, peer = mtq_peer.auto_quantize(
            copy.deepcopy(model), {"effective_bits": 6}, [getattr(mtq_peer, n) for n in NAMES], **kw
        )
    assert peer["method"] == ours["method"] == "kl_div"
    for name, st in ours["candidate_stats"].items():
        ps = peer["candidate_stats"][f"{name}.quant_recipe"]
        assert [str(f).split("(")[0] for f in ps["formats"]] == st["formats"]
        assert st["scores"][-1] == ps["scores"][-1] == 0.0
        assert st["scores"][0] > st["scores"][1] > 0  # INT4 hurts more than INT8
        assert st["scores"] == pytest.approx(ps["scores"], rel=1e-4)
        assert [c / 16 for c in st["costs"]] == pytest.approx(ps["costs"])


@pytest.mark.parametrize("case", ["fixed", "spaces"])
def test_search_spaces_and_fixed_config_match_modelopt(case):
    mtq_peer = _peer()
    model, data, loss = _problem()

    def options(lib):
        int4, int8 = (getattr(lib, n) for n in NAMES)
        if case == "fixed":
            space = [{"module_name_patterns": ["4"], "quantization_formats": [int4]}]
            return dict(quantization_formats=None, fixed_quantization_config=int8, module_search_spaces=space)
        spaces = [
            {"module_name_patterns": ["0"], "quantization_formats": [int8], "allow_no_quant": False},
            {"module_name_patterns": ["4"], "quantization_formats": [int4, int8], "allow_no_quant": False},
        ]
        return dict(quantization_formats=[int4], module_search_spaces=spaces)

    kw = dict(data_loader=data, forward_step=lambda m, b: m(b), loss_func=loss, num_calib_steps=3, num_score_steps=3)
    q, ours = mtq.auto_quantize(copy.deepcopy(model), {"effective_bits": 8.1}, **options(mtq), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pq, peer = mtq_peer.auto_quantize(copy.deepcopy(model), {"effective_bits": 8.1}, **options(mtq_peer), **kw)
    assert list(ours["candidate_stats"]) == ["0", "2", "4"]
    for name, st in ours["candidate_stats"].items():
        ps = peer["candidate_stats"][f"{name}.quant_recipe"]
        assert [str(f).split("(")[0] for f in ps["formats"]] == st["formats"]
        assert st["scores"] == pytest.approx(ps["scores"], rel=1e-4)
        assert [c / 16 for c in st["costs"]] == pytest.approx(ps["costs"])
    peer_recipe = {k.split(".quant_recipe")[0]: str(v).split("(")[0] for k, v in peer["best"]["recipe"].items()}
    assert ours["best"]["recipe"] == peer_recipe
    assert ours["best"]["constraints"]["effective_bits"] == pytest.approx(peer["best"]["constraints"]["effective_bits"])
    with torch.no_grad():
        assert torch.allclose(q(data[0]), pq(data[0]), rtol=1e-5, atol=1e-5)
