"""Static NVFP4 state: ``state_dict``, ``mtq.save``/``restore`` and ``modelopt_lite.opt`` (ModelOpt's layout) carry
the block amaxes and ``_global_amax``; restored models give the same bits; bad files are refused."""

from __future__ import annotations

import json

import pytest
import torch
from state_files import edit_saved_tensors
from torch import nn

import modelopt_lite as mtq
import modelopt_lite.opt as mto


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 16), nn.ReLU(), nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(8, 40, generator=torch.Generator().manual_seed(1))


def _quantized() -> nn.Module:
    x = _x()
    model = mtq.quantize(_mlp(), mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, lambda m: m(x))
    q = model[0].weight_quantizer
    q.global_amax = q.global_amax * 1.5  # a global amax that is not the blocks' max: it must travel
    return model


def _same(a: nn.Module, b: nn.Module) -> None:
    x = _x()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    for i in (0, 2):
        qa, qb = a[i].weight_quantizer, b[i].weight_quantizer
        assert torch.equal(qa.amax, qb.amax) and torch.equal(qa.global_amax, qb.global_amax)
        assert qb._global_amax.dtype == torch.float32 and qb._global_amax.shape == ()


def test_state_dict_round_trip():
    model = _quantized()
    sd = model.state_dict()
    assert sd["0.weight_quantizer._amax"].shape == (16, 3) and sd["0.weight_quantizer._global_amax"].shape == ()
    fresh = mtq.quantize(_mlp(), mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, None)
    assert fresh[0].weight_quantizer.amax is None
    fresh.load_state_dict(sd)
    _same(model, fresh)


def test_mtq_save_restore(tmp_path):
    model = _quantized()
    mtq.save(model, tmp_path / "q")
    back = mtq.restore(_mlp(), tmp_path / "q")
    _same(model, back)


def test_mtq_restore_refuses_a_bad_global_amax(tmp_path):
    model = _quantized()
    j, s = mtq.save(model, tmp_path / "q")
    edit_saved_tensors(s, lambda t: t.__setitem__("0.weight_quantizer._global_amax", torch.tensor([1.0, 2.0])))
    with pytest.raises(ValueError, match=r"_global_amax: a global amax is one value"):
        mtq.restore(_mlp(), tmp_path / "q")
    assert json.loads(open(j).read())


def test_opt_state_and_checkpoint_round_trip(tmp_path):
    model = _quantized()
    state = mto.modelopt_state(model)
    qs = state["modelopt_state_dict"][0][1]["metadata"]["quantizer_state"]["0.weight_quantizer"]
    assert qs["_is_nvfp4_static_quantizer"] is True and qs["_is_static_block_scale_quantizer"] is True
    assert qs["_block_sizes"] == {-1: 16, "type": "static", "scale_bits": (4, 3)}
    bufs = qs["_pytorch_state_metadata"]["buffers"]
    assert bufs["_amax"]["shape"] == torch.Size([48, 1])  # ModelOpt's flat layout (rows * blocks, 1)
    assert bufs["_global_amax"]["shape"] == torch.Size([])
    back = mto.restore_from_modelopt_state(_mlp(), state)
    back.load_state_dict(model.state_dict())
    _same(model, back)
    mto.save(model, tmp_path / "m.pth")
    ck = torch.load(tmp_path / "m.pth", weights_only=True)
    assert ck["model_state_dict"]["0.weight_quantizer._amax"].shape == (48, 1)
    _same(model, mto.restore(_mlp(), tmp_path / "m.pth"))


def test_opt_refuses_lsq_state():
    state = mto.modelopt_state(_quantized())
    qs = state["modelopt_state_dict"][0][1]["metadata"]["quantizer_state"]["0.weight_quantizer"]
    qs["_lsq"] = True
    with pytest.raises(ValueError, match=r"'_lsq'=True \(learnable LSQ amaxes\) is not supported"):
        mto.restore_from_modelopt_state(_mlp(), state)


def test_lsq_mode_is_refused_at_save(tmp_path):
    model = _quantized()
    model[0].weight_quantizer.enable_lsq()
    with pytest.raises(ValueError, match=r"save: quantizer '0.weight_quantizer' is in LSQ mode"):
        mtq.save(model, tmp_path / "q")
    with pytest.raises(ValueError, match=r"'0.weight_quantizer': modelopt state of an LSQ-mode quantizer"):
        mto.modelopt_state(model)
    model[0].weight_quantizer.disable_lsq()
    mtq.save(model, tmp_path / "q")
