"""fp8_scale_sweep on static NVFP4 weights (ModelOpt's NVFP4MSECalibrator): each block amax is the candidate
``global_amax * v / 448`` (v each positive finite E4M3 value) with the least weight error, the global amax fixed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import model_calib
from modelopt_lite.algorithms import weight_mse
from modelopt_lite.functional import microscaling as mx

STATIC_W = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}, "enable": True}


def _model(k=40) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(k, 6), nn.ReLU(), nn.Linear(6, 3))


def _cfg(k_static=True) -> dict:
    cfg = copy.deepcopy(mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)
    if not k_static:
        cfg["quant_cfg"]["*weight_quantizer"] = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"])
    return cfg


def _brute_force(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per block: every candidate through the reference, the first least squared error."""
    cands = weight_mse.fp8_scale_candidates()
    assert cands.numel() == 126 and torch.equal(cands[-1], torch.tensor(1.0))
    nb = -(-w.shape[1] // 16)
    out = torch.empty(w.shape[0], nb)
    gs = mx.nvfp4_global_scale(g)
    for r in range(w.shape[0]):
        for b in range(nb):
            blk = w[r, b * 16 : (b + 1) * 16].float()
            best, best_a = None, None
            for c in cands:
                a = g * c
                y = mx.fake_nvfp4(blk, gs, 16, block_amax=a.reshape(1))
                loss = ((blk - y) ** 2).sum()
                if best is None or loss < best:
                    best, best_a = loss, a
            out[r, b] = best_a
    return out


@pytest.mark.parametrize("k", [40, 32])  # 40: a partial last block
def test_sweep_matches_brute_force(k):
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1))
    model = mtq.quantize(_model(k), _cfg(), lambda m: m(x))
    for i in (0, 2):
        q, w = model[i].weight_quantizer, model[i].weight.detach()
        assert torch.equal(q.global_amax, w.abs().amax())  # fixed at the max calibration's value
        assert torch.equal(q.amax, _brute_force(w, q.global_amax))
    # it helps: the weight error is below the max calibration's
    ref = mtq.quantize(_model(k), {**_cfg(), "algorithm": "max"}, lambda m: m(x))
    w = model[0].weight.detach()
    e_sweep = ((model[0].weight_quantizer(w) - w) ** 2).sum()
    e_max = ((ref[0].weight_quantizer(w) - w) ** 2).sum()
    assert e_sweep < e_max


def test_mse_calibrate_entry_point_and_config_form_agree():
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    a = mtq.quantize(_model(), _cfg(), lambda m: m(x))
    b = mtq.quantize(_model(), {**_cfg(), "algorithm": "max"}, lambda m: m(x))
    model_calib.mse_calibrate(b, lambda m: m(x), fp8_scale_sweep=True)
    c = mtq.quantize(_model(), {**_cfg(), "algorithm": None}, None)
    model_calib.mse_calibrate(c, fp8_scale_sweep=True)  # weights only
    for i in (0, 2):
        assert torch.equal(a[i].weight_quantizer.amax, b[i].weight_quantizer.amax)
        assert torch.equal(a[i].weight_quantizer.amax, c[i].weight_quantizer.amax)


def test_sweep_skips_other_weights_with_a_warning():
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"fp8_scale_sweep=True refines only static NVFP4.*: 0, 2"):
        model = mtq.quantize(_model(), _cfg(k_static=False), lambda m: m(x))
    assert model[0].weight_quantizer.amax.shape == ()  # dynamic NVFP4: its max-calibrated global amax
    assert torch.equal(model[0].weight_quantizer.amax, model[0].weight.detach().abs().amax())


def test_multiplier_search_on_static_nvfp4_keeps_the_global_amax():
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    cfg = {**_cfg(), "algorithm": {"method": "mse", "step_size": 0.25, "stop_multiplier": 2.0}}
    model = mtq.quantize(_model(), cfg, lambda m: m(x))
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    assert torch.equal(q.global_amax, w.abs().amax())
    first = mx._block_amax(mx._blocks(w, 16))
    ratios = q.amax / first
    mults = weight_mse.multipliers(0.25, 0.25, 2.0)
    assert all(bool((ratios.flatten()[i] - mults).abs().min() < 1e-6) for i in range(ratios.numel()))


@pytest.mark.filterwarnings("ignore:.*has 6 input features, not a multiple")
def test_local_hessian_sweeps_static_weights_on_the_candidate_grid():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    model = mtq.quantize(_model(32), copy.deepcopy(mtq.NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG), lambda m: m(x))
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    scales = mx.nvfp4_block_scales(w, mx.nvfp4_global_scale(q.global_amax), 16, q.amax)
    cands = weight_mse.fp8_scale_candidates()
    assert torch.equal(q.amax, q.global_amax * cands[torch.searchsorted(cands * 448, scales)])
    plain = mtq.quantize(_model(32), _cfg(), lambda m: m(x))
    assert not torch.equal(q.amax, plain[0].weight_quantizer.amax)  # the Hessian weighting matters


@pytest.mark.filterwarnings("ignore:.*has 6 input features, not a multiple")
def test_local_hessian_sweep_is_optimal_per_block():
    """Each chosen block amax minimises ``dW_b H_b dW_b^T`` over the 126 candidates (a float64 brute force; the
    float32 search may pick another candidate only within rounding of the minimum)."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2)) * torch.logspace(-1, 0.5, 32)
    alg = {"method": "local_hessian", "fp8_scale_sweep": True, "debug": True}
    model = _model(32)
    mtq.quantize(model, {**copy.deepcopy(mtq.NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG), "algorithm": alg}, lambda m: m(x))
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    h = model._local_hessian_accumulators["0"].hessian().double()
    gs = mx.nvfp4_global_scale(q.global_amax)
    cands = weight_mse.fp8_scale_candidates()
    picked_any_non_max = False
    for r in range(w.shape[0]):
        for b in range(2):
            blk = w[r, b * 16 : (b + 1) * 16]
            losses = []
            for c in cands:
                dw = (blk - mx.fake_nvfp4(blk, gs, 16, block_amax=(q.global_amax * c).reshape(1))).double()
                losses.append(float(dw @ h[b] @ dw))
            chosen = mx.fake_nvfp4(blk, gs, 16, block_amax=q.amax[r, b].reshape(1))
            dw = (blk - chosen).double()
            assert float(dw @ h[b] @ dw) <= min(losses) * (1 + 1e-5) + 1e-12, (r, b)
            picked_any_non_max |= not torch.equal(q.amax[r, b], blk.abs().max())
    assert picked_any_non_max
