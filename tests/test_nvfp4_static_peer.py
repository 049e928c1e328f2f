"""Static NVFP4 against nvidia-modelopt 0.47 (skipped where it is not installed).

ModelOpt's static NVFP4 fake quant and its FP8 scale sweep need triton on CUDA (``static_blockwise_fp4_fake_quant``
raises "requires triton" on the CPU), so on the CPU the peer writes a NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG checkpoint
with max calibration (its weight quantizers promoted to StaticBlockScaleQuantizer, block amax flat, a global amax):
it restores here with the same amaxes, and gives the same bits as our own quantization of that config with max."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as ours
import modelopt_lite.opt as our_mto

mtq = pytest.importorskip("modelopt.torch.quantization")
mto = pytest.importorskip("modelopt.torch.opt")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(1))


def test_presets_match_modelopt():
    for name in ("NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG"):
        theirs, mine = getattr(mtq, name), getattr(ours, name)
        assert mine["algorithm"] == theirs["algorithm"]
        entries = {e["quantizer_name"]: e for e in theirs["quant_cfg"] if "parent_class" not in e}
        for pat in ("*weight_quantizer", "*input_quantizer"):
            want = {k: v for k, v in entries[pat]["cfg"].items() if k != "effective_bits"}
            got = {k: v for k, v in mine["quant_cfg"][pat].items() if k not in ("axis", "enable")}
            assert got == want, (name, pat)


def test_a_static_nvfp4_checkpoint_modelopt_wrote_restores_here(tmp_path):
    x = _x()
    peer = _mlp()
    cfg = copy.deepcopy(mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)
    cfg["algorithm"] = "max"  # the sweep needs triton/CUDA in ModelOpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(peer, cfg, lambda m: m(x))
    assert type(peer[0].weight_quantizer).__name__ == "StaticBlockScaleQuantizer"
    path = tmp_path / "peer.pth"
    mto.save(peer, path)
    model = our_mto.restore(_mlp(), path)
    sd_peer, sd_ours = peer.state_dict(), model.state_dict()
    for i in (0, 2):
        k = f"{i}.weight_quantizer"
        assert sd_peer[f"{k}._amax"].shape == (sd_ours[f"{k}._amax"].numel(), 1)  # flat there
        assert torch.equal(sd_ours[f"{k}._amax"].flatten(), sd_peer[f"{k}._amax"].flatten())
        assert torch.equal(sd_ours[f"{k}._global_amax"], sd_peer[f"{k}._global_amax"].float())
        assert model[i].weight_quantizer.quant_desc.nvfp4_static
    mine = ours.quantize(_mlp(), {**ours.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, "algorithm": "max"}, lambda m: m(x))
    with torch.no_grad():
        for i in (0, 2):
            w = model[i].weight
            assert torch.equal(model[i].weight_quantizer(w), mine[i].weight_quantizer(w))
        assert torch.equal(model(x), mine(x))


def test_modelopt_list_form_presets_run_here_as_ours():
    x = _x()
    for name in ("NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", "NVFP4_W4A4_WEIGHT_LOCAL_HESSIAN_CFG"):
        a = ours.quantize(_mlp(), copy.deepcopy(getattr(mtq, name)), lambda m: m(x))
        b = ours.quantize(_mlp(), getattr(ours, name), lambda m: m(x))
        for i in (0, 2):
            assert a[i].weight_quantizer.is_nvfp4_static
            assert torch.equal(a[i].weight_quantizer.amax, b[i].weight_quantizer.amax), name
        with torch.no_grad():
            assert torch.equal(a(x), b(x)), name
