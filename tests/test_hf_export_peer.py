"""``export_hf_checkpoint`` against nvidia-modelopt's own ``export_hf_checkpoint`` in the same process, tensor for
tensor (skipped where nvidia-modelopt is not importable; run it with ``/tmp/venv-peer/bin/python -m pytest``).

FP8 (with and without the FP8 KV cache) and NVFP4 are calibrated by both sides (max): every tensor of the two
checkpoints is bit-identical. For the AWQ configs the searches differ, so ModelOpt's calibrated state (smoothed
weights, ``pre_quant_scale``, every amax) is copied into our model first; then the export (its re-smoothing of
q/k/v and gate/up, the norm folding, the packing and the scales) is compared bit for bit as well.

bfloat16 models: the same, except FP8 weight codes, where ModelOpt divides the bfloat16 weight by the float32 scale
in bfloat16 (a 0-dim tensor does not promote) and rounds twice; ours divide in float32 and round once, as both
fake-quant models do. The differing codes are checked to be exactly ModelOpt's double rounding.
"""

from __future__ import annotations

import copy
import json
import warnings

import hf_helpers as H
import pytest
import torch
from safetensors.torch import load_file

import modelopt_lite as ours
from modelopt_lite.export import export_hf_checkpoint, load_hf_checkpoint
from modelopt_lite.functional.scales import scale_from_amax

mtq = pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed (the pinned peer)")
peer_export = pytest.importorskip("modelopt.torch.export").export_hf_checkpoint
pytestmark = pytest.mark.slow  # ModelOpt's AWQ search and export: tens of seconds per config


def _peer_cfg(name: str) -> dict:
    base = getattr(mtq, name.removesuffix("+KV"))
    if not name.endswith("+KV"):
        return base
    return {"quant_cfg": base["quant_cfg"] + mtq.FP8_KV_CFG["quant_cfg"], "algorithm": base["algorithm"]}


def _our_cfg(name: str) -> dict:
    cfg = copy.deepcopy(getattr(ours, name.removesuffix("+KV")))
    if name.endswith("+KV"):
        cfg = ours.with_kv_cache(cfg, ours.FP8_KV_CFG)
    if "AWQ" in name:
        cfg["algorithm"] = "max"  # ModelOpt's AWQ result is copied in below
    return cfg


def _copy_state(peer, model) -> None:
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in peer.state_dict().items():
            if k.endswith("._pre_quant_scale"):
                model.get_submodule(k.removesuffix("._pre_quant_scale")).pre_quant_scale = v.float()
            elif k in sd:
                sd[k].copy_(v.reshape(sd[k].shape))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", H.CONFIGS)
def test_every_tensor_equals_modelopts_export(name, dtype, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer = H.tiny_llama().to(dtype)
        mtq.quantize(peer, _peer_cfg(name), H.forward_loop)
        model = H.tiny_llama().to(dtype)
        ours.quantize(model, _our_cfg(name), H.forward_loop)
        if "AWQ" in name:
            _copy_state(peer, model)
        export_hf_checkpoint(model, tmp_path / "ours")
        peer_export(peer, export_dir=str(tmp_path / "peer"))
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("ours", "peer"))
    assert H.layout(a) == H.layout(b)
    differ = [k for k in a if not torch.equal(_raw(a[k]), _raw(b[k]))]
    if dtype == torch.bfloat16 and name.startswith("FP8"):
        fresh = H.tiny_llama().to(dtype)
        assert differ and all(k.endswith("proj.weight") for k in differ)
        for k in differ:
            w = fresh.get_submodule(k.removesuffix(".weight")).weight.detach()
            twice = (w / b[k + "_scale"]).to(torch.float8_e4m3fn)  # bf16 quotient, then E4M3
            assert torch.equal(_raw(twice), _raw(b[k]))
            fake = model.get_submodule(k.removesuffix(".weight")).weight_quantizer(w)
            assert torch.equal((a[k].float() * a[k + "_scale"]).to(dtype), fake)  # ours: the fake-quant weight
        differ = []
    assert differ == []
    qa, qb = (json.loads((tmp_path / d / "hf_quant_config.json").read_text()) for d in ("ours", "peer"))
    assert qa["quantization"] == qb["quantization"]
    ca, cb = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("ours", "peer"))
    assert H.without_producer(ca.pop("quantization_config")) == H.without_producer(cb.pop("quantization_config"))
    assert ca == cb  # the rest of config.json too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_svdquant_every_tensor_equals_modelopts_export(dtype, tmp_path):
    """NVFP4 SVDQuant: ModelOpt's SVDQuant layers and ours hold the same scales and factors
    (``hf_helpers.svdquant_state``, in the model's dtype; ModelOpt's NVFP4 search needs CUDA); the two exports (the
    shared-branch re-SVD of q/k/v and gate/up included) are identical tensor for tensor, and so are the configs."""
    from modelopt.torch.quantization.conversion import create_and_replace_svdquant_linear_on_the_fly

    def prepared():
        m = H.tiny_llama()
        state = {k: tuple(t.to(dtype) for t in v) for k, v in H.svdquant_state(m).items()}
        return m.to(dtype), state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, state = prepared()
        mtq.quantize(peer, mtq.NVFP4_DEFAULT_CFG, H.forward_loop)
        create_and_replace_svdquant_linear_on_the_fly(peer)
        H.set_svdquant_state(peer, state)
        model, _ = prepared()
        ours.quantize(model, ours.NVFP4_DEFAULT_CFG, H.forward_loop)
        H.set_svdquant_state(model, state)
        export_hf_checkpoint(model, tmp_path / "ours")
        peer_export(peer, export_dir=str(tmp_path / "peer"))
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("ours", "peer"))
    assert H.layout(a) == H.layout(b)
    assert "model.layers.1.mlp.up_proj.weight_quantizer._svdquant_lora_b" in a
    assert [k for k in a if not torch.equal(_raw(a[k]), _raw(b[k]))] == []
    qa, qb = (json.loads((tmp_path / d / "hf_quant_config.json").read_text()) for d in ("ours", "peer"))
    assert qa["quantization"] == qb["quantization"] and qa["quantization"]["quant_algo"] == "NVFP4_SVD"
    ca, cb = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("ours", "peer"))
    assert H.without_producer(ca.pop("quantization_config")) == H.without_producer(cb.pop("quantization_config"))
    assert ca == cb


def test_modelopts_fp8_kv_checkpoint_reloads_with_its_kv_quantizers(tmp_path):
    """ModelOpt's own FP8 + FP8-KV checkpoint loads here: every k_scale / v_scale comes back exactly as the scale of
    the reloaded key / value quantizer, which then quantizes as ModelOpt's calibrated KV quantizer (same scale)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer = H.tiny_llama()
        mtq.quantize(peer, _peer_cfg("FP8_DEFAULT_CFG+KV"), H.forward_loop)
        peer_export(peer, export_dir=str(tmp_path / "peer"))
    t = load_file(str(tmp_path / "peer" / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every stored scale has an exact amax
        real = load_hf_checkpoint(H.tiny_llama(), tmp_path / "peer")
    for i in range(2):
        att = real.get_submodule(f"model.layers.{i}.self_attn")
        for kv in "kv":
            q = getattr(att, f"{kv}_bmm_quantizer")
            want = t[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"]
            assert q.is_enabled and torch.equal(scale_from_amax(q.amax.float(), 448.0).reshape(()), want)
