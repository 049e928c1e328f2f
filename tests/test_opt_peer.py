"""``modelopt_lite.opt`` against nvidia-modelopt (skipped where it is not installed): a checkpoint ModelOpt's
``mto.save`` wrote for INT8, FP8 and INT4-blockwise restores into our model with equal amax and matching outputs,
and ours restores in ModelOpt."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as ours
import modelopt_lite.opt as our_mto

mtq = pytest.importorskip("modelopt.torch.quantization")
mto = pytest.importorskip("modelopt.torch.opt")

CFGS = ("INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 16), nn.ReLU(), nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(32, 256, generator=torch.Generator().manual_seed(1))


def _amaxes(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.endswith("_amax")}


@pytest.mark.parametrize("cfg", CFGS)
def test_a_checkpoint_modelopt_wrote_restores_here(cfg, tmp_path):
    x = _x()
    peer = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(peer, getattr(mtq, cfg), lambda m: m(x))
    path = tmp_path / "peer.pth"
    mto.save(peer, path)
    model = our_mto.restore(_mlp(), path)
    mine, theirs = _amaxes(model), _amaxes(peer)
    assert sorted(mine) == sorted(theirs)
    for k, a in theirs.items():
        assert mine[k].dtype == torch.float32
        assert torch.equal(mine[k].flatten(), a.flatten()), (
            k
        )  # INT4 blocks: (rows * blocks, 1) there, (rows, blocks) here
    with torch.no_grad():
        y_ours, y_peer = model(x), peer(x)
    assert y_ours.dtype == y_peer.dtype and y_ours.shape == y_peer.shape
    # the peer scales by a reciprocal multiply on the CPU, we divide (ONNX Runtime's rule): outputs agree to float32 rounding (max 1.2e-7 here)
    torch.testing.assert_close(y_ours, y_peer, rtol=1e-5, atol=1e-6)
    # and exactly our own quantization of the same settings
    fresh = ours.quantize(_mlp(), getattr(ours, cfg), lambda m: m(x))
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


@pytest.mark.parametrize("cfg", ("INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG"))
def test_our_checkpoint_restores_in_modelopt(cfg, tmp_path):
    x = _x()
    model = ours.quantize(_mlp(), getattr(ours, cfg), lambda m: m(x))
    path = tmp_path / "ours.pth"
    our_mto.save(model, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer = mto.restore(_mlp(), path)
    for k, a in _amaxes(model).items():
        assert torch.equal(peer.state_dict()[k], a), k
    with torch.no_grad():
        torch.testing.assert_close(peer(x), model(x), rtol=1e-5, atol=1e-6)


def test_modelopt_state_has_modelopt_layout():
    x = _x()
    model = ours.quantize(_mlp(), ours.INT8_DEFAULT_CFG, lambda m: m(x))
    peer = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(peer, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    mine, theirs = our_mto.modelopt_state(model), mto.modelopt_state(peer)
    assert set(mine) == set(theirs)
    q_mine = mine["modelopt_state_dict"][-1][1]["metadata"]["quantizer_state"]
    q_theirs = theirs["modelopt_state_dict"][-1][1]["metadata"]["quantizer_state"]
    assert sorted(q_mine) == sorted(q_theirs)
    for name, st in q_theirs.items():
        for key in ("_num_bits", "_axis", "_block_sizes", "_unsigned", "_narrow_range", "_disabled", "_if_quant"):
            assert q_mine[name][key] == st[key], (name, key)
        assert q_mine[name]["_pytorch_state_metadata"] == st["_pytorch_state_metadata"], name
