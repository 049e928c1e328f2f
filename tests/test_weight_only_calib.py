"""ModelOpt's weight-only calibration: ``quantize(model, cfg)`` / ``calibrate(model, algorithm="max")`` without a
forward loop calibrate the weight quantizers on the weights; activation quantizers stay uncalibrated (dynamic)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.nn import SequentialQuantizer


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    )


def _x():
    return torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))


def test_quantize_without_loop_calibrates_weights_only_and_keeps_train_mode():
    model = _net().train()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG)
    assert model.training and model[0].training
    w0, w3 = model[0].weight.detach(), model[3].weight.detach()
    assert torch.equal(model[0].weight_quantizer.amax, w0.abs().amax((1, 2, 3), keepdim=True))
    assert torch.equal(model[3].weight_quantizer.amax, w3.abs().amax(1, keepdim=True))
    for q in (model[0].input_quantizer, model[3].input_quantizer):
        assert not q.has_amax and q.is_quant_enabled and not q.is_calib_enabled
    # an uncalibrated input quantizer quantizes with each input's own max
    x = _x()
    with torch.no_grad():
        assert torch.equal(model[0].input_quantizer(x), mtq.fake_tensor_quant(x, x.abs().max(), 8, False, False))


def test_quantize_without_loop_and_algorithm_none_calibrates_nothing():
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["algorithm"] = None
    model = mtq.quantize(_net(), cfg)
    assert not model[0].weight_quantizer.has_amax and not model[3].weight_quantizer.has_amax


def test_calibrate_algorithm_max_without_loop_returns_the_model():
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["algorithm"] = None
    model = mtq.quantize(_net(), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # activation quantizers are not reported as "saw no data"
        out = mtq.calibrate(model, algorithm="max")
    assert out is model
    assert torch.equal(model[3].weight_quantizer.amax, model[3].weight.detach().abs().amax(1, keepdim=True))
    assert not model[0].input_quantizer.has_amax


def test_context_manager_form_still_calibrates_everything():
    model = mtq.quantize(_net(), mtq.INT8_DEFAULT_CFG)
    x = _x()
    with mtq.calibrate(model, "entropy"):
        model(x)
    assert model[0].input_quantizer.has_amax and model[3].input_quantizer.has_amax
    assert model[0].input_quantizer.quant_desc.calib_method == "histogram"


def test_weight_only_reaches_sequential_weight_quantizers():
    cfg = {
        "quant_cfg": {
            "*weight_quantizer": [
                {"num_bits": 4, "block_sizes": {-1: 16}, "enable": True},
                {"num_bits": (4, 3), "axis": None, "enable": True},
            ],
            "*input_quantizer": {"enable": False},
            "default": {"enable": False},
        },
        "algorithm": "max",
    }
    model = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(32, 8)), cfg)
    seq = model[0].weight_quantizer
    assert isinstance(seq, SequentialQuantizer)
    w = model[0].weight.detach()
    assert torch.equal(seq[1].amax, w.abs().max())
    assert torch.equal(seq[0].amax.flatten(), w.reshape(8, 2, 16).abs().amax(-1).flatten())


def test_matches_modelopt_weight_only_quantize():
    mtq_peer = pytest.importorskip("modelopt.torch.quantization")
    ours = mtq.quantize(_net(), mtq.INT8_DEFAULT_CFG)
    peer = mtq_peer.quantize(_net(), mtq_peer.INT8_DEFAULT_CFG)
    for i in (0, 3):
        assert torch.equal(ours[i].weight_quantizer.amax.flatten(), peer[i].weight_quantizer.amax.flatten())
        assert not ours[i].input_quantizer.has_amax
        assert getattr(peer[i].input_quantizer, "_amax", None) is None
