"""Static NVFP4 weights leave through fake2real / save_real / load_real and the unified HF checkpoint with their stored
block amaxes and global amax (``weight_scale`` = the E4M3 block scales from them, ``weight_scale_2`` = global / 2688);
reloaded outputs equal the fake-quant model's."""

from __future__ import annotations

import copy

import hf_helpers as H
import pytest
import torch
from safetensors.torch import load_file
from test_hf_export import _real_vs_fake
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.export import export_hf_checkpoint, fuse_for_hf_export, load_hf_checkpoint
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.real import fake2real, load_real, save_real


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    mtq.quantize(model, mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, lambda m: m(x))
    q = model[0].weight_quantizer
    q.global_amax = q.global_amax * 1.25  # stored values, not recomputable from the weight
    return model, x


def test_fake2real_and_load_real(tmp_path):
    model, x = _mlp()
    with torch.no_grad():
        ref = model(x)
    real = fake2real(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(real(x), ref)
    bufs = dict(real[0].named_buffers())
    wq = model[0].weight_quantizer
    gs = mx.nvfp4_global_scale(wq.global_amax)
    assert torch.equal(bufs["weight_global_scale"], gs)
    s = mx.nvfp4_block_scales(model[0].weight.detach(), gs, 16, wq.amax)
    assert torch.equal(bufs["weight_block_scale"].view(torch.float8_e4m3fn).float(), s)
    save_real(real, tmp_path / "ckpt")
    torch.manual_seed(3)
    loaded = load_real(nn.Sequential(nn.Linear(40, 32), nn.ReLU(), nn.Linear(32, 8)), tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)


def test_fake2real_refuses_lsq_mode():
    model, _ = _mlp()
    model[0].weight_quantizer.enable_lsq()
    with pytest.raises(ValueError, match=r"fake2real: module '0': the weight quantizer is in LSQ mode"):
        fake2real(model)


def test_hf_checkpoint_uses_the_stored_amaxes(tmp_path):
    model = H.tiny_llama()
    cfg = {**copy.deepcopy(mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG), "algorithm": "max"}  # the sweep: tested apart
    mtq.quantize(model, cfg, H.forward_loop)
    o = model.model.layers[0].self_attn.o_proj  # not fused with anything: its own global amax
    assert o.weight_quantizer.is_nvfp4_static
    o.weight_quantizer.amax = o.weight_quantizer.amax * torch.linspace(0.5, 1.0, o.weight_quantizer.amax.shape[-1])
    export_hf_checkpoint(model, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.0.self_attn.o_proj"
    gs = mx.nvfp4_global_scale(o.weight_quantizer.global_amax)
    assert torch.equal(t[f"{key}.weight_scale_2"].float(), gs)
    s = mx.nvfp4_block_scales(o.weight.detach(), gs, 16, o.weight_quantizer.amax)
    assert torch.equal(t[f"{key}.weight_scale"].float(), s)
    # q/k/v share one global amax (the group's max), as ModelOpt's fused export
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight_scale_2" for p in "qkv"]
    assert t[qkv[0]] == t[qkv[1]] == t[qkv[2]]
    real = load_hf_checkpoint(H.tiny_llama(seed=5), tmp_path)
    fake = fuse_for_hf_export(model)
    x = torch.randint(0, H.VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    assert _real_vs_fake(fake, real, x) == 14
