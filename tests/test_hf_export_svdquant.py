"""``export_hf_checkpoint`` of NVFP4 SVDQuant models: ModelOpt's ``NVFP4_SVD`` layout (key for key against
nvidia-modelopt 0.47.0's own export, stored in ``hf_reference/modelopt_reference.json``; tensor for tensor in
``test_hf_export_peer.py``), the export's shared low-rank branch of q/k/v and gate/up, the reload into real modules
with the fake-quant model's outputs, and the refusals.

The model is the tiny decoder with SVDQuant's result set directly (``hf_helpers.svdquant_state``: AWQ-like scales,
rank-8 factors, residual weights; NVFP4 max calibration), so no search runs; ``test_svdquant.py`` tests the search.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import hf_helpers as H
import pytest
import torch
from safetensors.torch import load_file, save_file

import modelopt_lite as mtq
from modelopt_lite.export import export_hf_checkpoint, fuse_for_hf_export, load_hf_checkpoint
from modelopt_lite.export.hf_load import LowRankLinear

REF = json.loads((Path(__file__).parent / "hf_reference" / "modelopt_reference.json").read_text())["configs"]
SVD = "NVFP4_SVDQUANT_DEFAULT_CFG"
A, B = "weight_quantizer._svdquant_lora_a", "weight_quantizer._svdquant_lora_b"
ATT = "model.layers.0.self_attn."
_CACHE: dict = {}


def svd_model() -> torch.nn.Module:
    """The tiny decoder, NVFP4, with SVDQuant factors on every Linear but the head (cached: do not modify)."""
    if "m" not in _CACHE:
        model = H.tiny_llama()
        state = H.svdquant_state(model)
        mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, H.forward_loop)
        H.set_svdquant_state(model, state)
        _CACHE["m"] = model
    return _CACHE["m"]


@pytest.fixture(scope="module")
def svd_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("svd")
    export_hf_checkpoint(svd_model(), out)
    return out


def test_layout_and_configs_match_modelopt(svd_dir):
    ref = REF[SVD]
    assert H.layout(load_file(str(svd_dir / "model.safetensors"))) == ref["tensors"]
    assert ref["tensors"][f"{ATT}q_proj.{A}"] == ["float32", [H.SVD_RANK, H.HIDDEN]]  # the stored peer layout
    assert json.loads((svd_dir / "hf_quant_config.json").read_text())["quantization"] == ref["hf_quant_config"]
    entry = json.loads((svd_dir / "config.json").read_text())["quantization_config"]
    assert H.without_producer(entry) == ref["quantization_config"]
    assert entry["quant_algo"] == "NVFP4_SVD" and entry["config_groups"]["group_0"]["pre_quant_scale"] is True


def test_fused_groups_share_one_branch_and_keep_the_full_weight(svd_dir):
    t = load_file(str(svd_dir / "model.safetensors"))
    model = svd_model()
    fused = fuse_for_hf_export(model)
    for group in (("q_proj", "k_proj", "v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        keys = [(ATT if "mlp" not in g else "model.layers.0.") + g for g in group]
        assert all(torch.equal(t[f"{k}.{A}"], t[f"{keys[0]}.{A}"]) for k in keys)
        assert all(torch.equal(t[f"{k}.pre_quant_scale"], t[f"{keys[0]}.pre_quant_scale"]) for k in keys)
        assert all(torch.equal(t[f"{k}.weight_scale_2"], t[f"{keys[0]}.weight_scale_2"]) for k in keys)
        for k in keys:  # (R' + B'A') * mean == (R + BA) * old: the member's float function is unchanged
            old, new = model.get_submodule(k), fused.get_submodule(k)
            before = (old.weight + old.weight_quantizer.svdquant_lora_b @ old.weight_quantizer.svdquant_lora_a).double()
            after = (new.weight + new.weight_quantizer.svdquant_lora_b @ new.weight_quantizer.svdquant_lora_a).double()
            s_old = old.input_quantizer.pre_quant_scale.double()
            s_new = new.input_quantizer.pre_quant_scale.double()
            torch.testing.assert_close(after * s_new, before * s_old, rtol=1e-5, atol=1e-6)
            assert torch.equal(t[f"{k}.{B}"], new.weight_quantizer.svdquant_lora_b)
    o = f"{ATT}o_proj"  # not fused: its own branch, bit for bit
    assert torch.equal(t[f"{o}.{A}"], model.get_submodule(o).weight_quantizer.svdquant_lora_a)


def _compare(fake, real, x) -> int:
    """Per LowRankLinear: its output on the fake module's input within the real NVFP4 module's error bound (plus
    the rounding of adding the same branch); the logits equal where every bound is 0. Returns the module count."""
    mods = {n: m for n, m in real.named_modules() if isinstance(m, LowRankLinear)}
    seen: dict = {}

    def keep(name):
        def hook(_m, args, out):  # returns None: the output is left alone
            seen.setdefault(name, (args[0], out))

        return hook

    hooks = [fake.get_submodule(n).register_forward_hook(keep(n)) for n in mods]
    with torch.no_grad():
        want, got = fake(x).logits, real(x).logits
    for h in hooks:
        h.remove()
    exact = True
    for n, m in mods.items():
        x_in, y_fake = seen[n]
        with torch.no_grad():
            bound = m.inner.error_bound(x_in * m.pre_quant_scale)
            y = m(x_in)
        slack = 4 * torch.finfo(y.dtype).eps * y_fake.abs()
        assert bool(((y.double() - y_fake.double()).abs() <= bound + slack).all()), n
        exact &= bool((bound == 0).all())
    if exact:
        assert torch.equal(got, want)
    return len(mods)


def test_reloads_into_real_modules_with_the_fake_models_outputs(svd_dir):
    real = load_hf_checkpoint(H.tiny_llama(seed=5), svd_dir)
    low = [m for m in real.modules() if isinstance(m, LowRankLinear)]
    assert len(low) == 14 and all(m.lora_a.shape == (H.SVD_RANK, m.lora_a.shape[1]) for m in low)
    x = torch.randint(0, H.VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    assert _compare(fuse_for_hf_export(svd_model()), real, x) == 14


def test_a_layer_without_factors_is_nvfp4_svd_too(tmp_path):
    """SVDQuant's skip_layers keep NVFP4 without a branch: still NVFP4_SVD (as ModelOpt), no factor keys."""
    model = copy.deepcopy(svd_model())
    o = model.get_submodule(f"{ATT}o_proj")
    o.weight_quantizer.svdquant_lora_a = o.weight_quantizer.svdquant_lora_b = None
    export_hf_checkpoint(model, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4_SVD"
    assert f"{ATT}o_proj.{A}" not in t and f"{ATT}q_proj.{A}" in t and f"{ATT}o_proj.pre_quant_scale" in t
    real = load_hf_checkpoint(H.tiny_llama(), tmp_path)
    assert type(real.get_submodule(f"{ATT}o_proj")).__name__ == "PreScaledLinear"
    assert isinstance(real.get_submodule(f"{ATT}q_proj"), LowRankLinear)


def test_branch_on_int4_weights_is_refused(tmp_path):
    model = H.tiny_llama()
    cfg = copy.deepcopy(mtq.INT4_SVDQUANT_CFG)
    cfg["algorithm"] = "max"
    mtq.quantize(model, cfg, H.forward_loop)
    wq = model.get_submodule(f"{ATT}q_proj").weight_quantizer
    wq.svdquant_lora_a, wq.svdquant_lora_b = torch.ones(2, H.HIDDEN), torch.ones(H.HIDDEN, 2)
    with pytest.raises(ValueError, match=r"q_proj'.*SVDQuant low-rank branch on W4A16_AWQ.*NVFP4 only"):
        export_hf_checkpoint(model, tmp_path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop(f"{ATT}o_proj.{B}"), r"o_proj\.weight_quantizer\._svdquant_lora_b: is missing"),
        (lambda t: t.__setitem__(f"{ATT}o_proj.{A}", torch.zeros(3, 5)), r"o_proj\.weight_quantizer\._svdquant_lora_a"),
        (
            lambda t: t.__setitem__(f"{ATT}o_proj.{B}", torch.zeros(H.HIDDEN, H.SVD_RANK + 1)),
            r"_svdquant_lora_b: is torch.float32 \(128, 9\), expected torch.float32 \(128, 8\)",
        ),
        (
            lambda t: t[f"{ATT}o_proj.{A}"].__setitem__((0, 0), float("nan")),
            r"o_proj\.weight_quantizer\._svdquant_lora_a: must be finite",
        ),
        (lambda t: t.__setitem__(f"{ATT}o_proj.{A}", t[f"{ATT}o_proj.{A}"].double()), r"float64"),
    ],
)
def test_loader_rejects_bad_factors(svd_dir, tmp_path, edit, match):
    t = load_file(str(svd_dir / "model.safetensors"))
    edit(t)
    for f in ("hf_quant_config.json", "config.json"):
        (tmp_path / f).write_text((svd_dir / f).read_text())
    save_file(t, str(tmp_path / "model.safetensors"))
    model = H.tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(model, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing modified
