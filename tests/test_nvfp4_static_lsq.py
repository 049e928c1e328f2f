"""LSQ on static NVFP4 weights (ModelOpt's ``lsq`` / ``enable_lsq``): learnable pre/post block amaxes, the forward
``e2m1(w / ds_pre) * ds_post`` and its straight-through gradients, checked against a hand computation."""

from __future__ import annotations

import copy

import pytest
import torch
from test_nvfp4_static import STATIC, calibrated
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import model_calib
from modelopt_lite.formats import e2m1_round
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.nn import TensorQuantizer


def _calibrated(w) -> TensorQuantizer:
    return calibrated(w, name="fc.weight_quantizer")


def _w(shape=(3, 40)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lsq_at_the_calibrated_amax_is_the_static_quantizer(dtype):
    w = _w().to(dtype)
    q = _calibrated(w)
    y = q(w)
    for kw in ({}, {"tied_amax": True}, {"learnable_amax": ["pre", "post"]}):
        q.enable_lsq(**kw)
        assert torch.equal(q(w), y)
    q.disable_lsq()
    assert q.amax_pre is None and torch.equal(q(w), y)


def test_parameters_by_option():
    q = _calibrated(_w())
    q.enable_lsq()  # ModelOpt's default: post learnable, pre frozen
    assert isinstance(q._amax_post, nn.Parameter) and not isinstance(q._amax_pre, nn.Parameter)
    assert [n for n, _ in q.named_parameters()] == ["_amax_post"]
    q.enable_lsq(tied_amax=True, learnable_amax="post")
    assert [n for n, _ in q.named_parameters()] == ["_amax_post"] and q.amax_pre is q.amax_post
    q.enable_lsq(learnable_amax=[])
    assert list(q.parameters()) == [] and q._amax_pre.dtype == torch.float32
    with pytest.raises(ValueError, match="'fc.weight_quantizer': learnable_amax must be 'pre', 'post'"):
        q.enable_lsq(learnable_amax="both")
    with pytest.raises(ValueError, match="enable_lsq needs a calibrated static NVFP4"):
        TensorQuantizer(STATIC).enable_lsq()


def test_gradients_match_a_hand_computation():
    w = _w((2, 32))
    q = _calibrated(w)
    q.enable_lsq(learnable_amax=["pre", "post"])
    with torch.no_grad():
        q._amax_pre.mul_(0.7)  # pre below post: some elements clip (no gradient for them), the rest move
        q._amax_post.mul_(1.2)
    wr = w.clone().requires_grad_(True)
    gout = torch.randn(2, 32, generator=torch.Generator().manual_seed(5))
    (q(wr) * gout).sum().backward()
    gs = mx.nvfp4_global_scale(q.global_amax).double()
    pre, post = q._amax_pre.detach().double(), q._amax_post.detach().double()
    # block scales: e4m3(a / (6 gs)) * gs; d ds / d a = 1 / 6 (straight through the E4M3 rounding)
    ds_pre = (pre / (6 * gs)).float().to(torch.float8_e4m3fn).double() * gs
    ds_post = (post / (6 * gs)).float().to(torch.float8_e4m3fn).double() * gs
    wb, gb = w.double().reshape(2, 2, 16), gout.double().reshape(2, 2, 16)
    v = wb / ds_pre.unsqueeze(-1)
    qv = e2m1_round(v.float()).double()
    inside = (v.abs() <= 6).double()
    # the 448 clamp of the scale stops the gradient (the largest block of post * 1.2 is above it)
    live_pre, live_post = (pre / (6 * gs) <= 448).double(), (post / (6 * gs) <= 448).double()
    assert 0 < live_post.sum() < live_post.numel()
    want_post = (gb * qv).sum(-1) / 6 * live_post
    want_pre = (gb * ds_post.unsqueeze(-1) * inside * (-wb / ds_pre.unsqueeze(-1) ** 2)).sum(-1) / 6 * live_pre
    want_x = (gb * ds_post.unsqueeze(-1) * inside / ds_pre.unsqueeze(-1)).reshape(2, 32)
    assert 0 < inside.sum() < inside.numel()
    torch.testing.assert_close(q._amax_post.grad.double(), want_post, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(q._amax_pre.grad.double(), want_pre, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(wr.grad.double(), want_x, rtol=1e-5, atol=1e-7)


def test_unquantized_pre_scale():
    w = _w((2, 32))
    q = _calibrated(w)
    q.enable_lsq(quantize_pre_scale=False)
    gs = mx.nvfp4_global_scale(q.global_amax)
    ds_pre = (q._amax_pre / torch.tensor(6.0)).unsqueeze(-1)
    ds_post = (mx.nvfp4_block_scales(w, gs, 16, q._amax_post) * gs).unsqueeze(-1)
    want = (e2m1_round(w.reshape(2, 2, 16) / ds_pre) * ds_post).reshape(2, 32)
    assert torch.equal(q(w), want)


def test_lsq_algorithm_converts_static_nvfp4_weights_and_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    cfg = copy.deepcopy(mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)
    cfg["algorithm"] = {"method": "lsq", "scale_algorithm": {"method": "mse", "fp8_scale_sweep": True}}
    mtq.quantize(model, cfg, lambda m: m(x))
    swept = copy.deepcopy(model)
    for i in (0, 2):
        q = model[i].weight_quantizer
        assert q.amax_post is not None and isinstance(q._amax_post, nn.Parameter)
        assert torch.equal(q._amax_post, q.amax)  # starts at the swept amax
    model(x).square().mean().backward()
    assert model[0].weight_quantizer._amax_post.grad.abs().sum() > 0
    other = copy.deepcopy(swept)
    for i in (0, 2):
        other[i].weight_quantizer.disable_lsq()
    model_calib.lsq(other, lambda m: m(x), scale_algorithm={"method": "max"}, tied_amax=True)
    assert other[0].weight_quantizer.amax_pre is other[0].weight_quantizer.amax_post
