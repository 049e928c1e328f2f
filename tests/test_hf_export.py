"""``export_hf_checkpoint``: ModelOpt's unified HF checkpoint, key for key against nvidia-modelopt 0.47.0's own export
of the same decoder (stored in ``hf_reference/modelopt_reference.json``; regenerate with
``hf_reference/make_reference.py``), reloaded into real modules with the fake-quant model's outputs, and its errors.

The AWQ configs run with ``algorithm="max"`` and a fixed per-module ``pre_quant_scale`` (``hf_helpers.awq_scales``,
weights divided by it, as AWQ leaves them), on both sides: the search (tested elsewhere, and different from
ModelOpt's) is skipped, and q/k/v and gate/up get different scales, so the export's re-smoothing runs.
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
import modelopt_lite.export as mte
from modelopt_lite.export import export_hf_checkpoint, fuse_for_hf_export, load_hf_checkpoint
from modelopt_lite.export.hf_weights import pack_int4_rows, unpack_int4_rows

REF = json.loads((Path(__file__).parent / "hf_reference" / "modelopt_reference.json").read_text())
LOADABLE = ("FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG")


def our_config(name: str) -> dict:
    cfg = copy.deepcopy(getattr(mtq, name.removesuffix("+KV")))
    if name.endswith("+KV"):
        cfg = mtq.with_kv_cache(cfg, mtq.FP8_KV_CFG)
    if "AWQ" in name:
        cfg["algorithm"] = "max"
    return cfg


_CACHE: dict[tuple, torch.nn.Module] = {}


def quantized(name: str, dtype=torch.float32) -> torch.nn.Module:
    """The tiny Llama quantized with ``name`` (cached; tests must not modify it)."""
    if (name, dtype) not in _CACHE:
        model = H.tiny_llama().to(dtype)
        scales = H.awq_scales(model) if "AWQ" in name else {}
        mtq.quantize(model, our_config(name), H.forward_loop)
        for n, s in scales.items():
            model.get_submodule(n).input_quantizer.pre_quant_scale = s
        _CACHE[name, dtype] = model
    return _CACHE[name, dtype]


def exported(name: str, tmp_path) -> tuple[Path, dict]:
    out = tmp_path / name
    export_hf_checkpoint(quantized(name), out)
    return out, load_file(str(out / "model.safetensors"))


def test_public_imports():
    assert mtq.export_hf_checkpoint is mte.export_hf_checkpoint is export_hf_checkpoint
    assert mtq.load_hf_checkpoint is load_hf_checkpoint
    assert REF["producer"] == {"name": "modelopt", "version": "0.47.0"}


@pytest.mark.parametrize("name", H.CONFIGS)
def test_layout_and_configs_match_modelopt(name, tmp_path):
    out, tensors = exported(name, tmp_path)
    ref = REF["configs"][name]
    assert H.layout(tensors) == ref["tensors"]  # every key, dtype and shape
    qcfg = json.loads((out / "hf_quant_config.json").read_text())
    assert qcfg["quantization"] == ref["hf_quant_config"]
    assert qcfg["producer"] == {"name": "modelopt_lite", "version": mtq.__version__}
    cfg = json.loads((out / "config.json").read_text())
    assert H.without_producer(cfg["quantization_config"]) == ref["quantization_config"]
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert cfg["dtype"] == "float32" and cfg["hidden_size"] == H.HIDDEN


@pytest.mark.parametrize("name", H.VALUE_CONFIGS)
def test_weight_tensors_equal_modelopt_bit_for_bit(name, tmp_path):
    _, tensors = exported(name, tmp_path)
    want = REF["configs"][name]["digests"]
    got = {k: H.tensor_digest(v) for k, v in tensors.items() if k.endswith(H.WEIGHT_KEYS)}
    assert got == want


def test_fusion_shares_scales_and_folds_awq_into_norms(tmp_path):
    _, t = exported("NVFP4_DEFAULT_CFG", tmp_path)
    att = "model.layers.0.self_attn."
    for key in ("input_scale", "weight_scale_2"):
        vals = [t[f"{att}{p}_proj.{key}"] for p in "qkv"]
        assert vals[0].shape == () and all(torch.equal(v, vals[0]) for v in vals)
    assert not torch.equal(t[f"{att}o_proj.weight_scale_2"], t[f"{att}q_proj.weight_scale_2"])
    model = quantized("INT4_AWQ_CFG")
    _, t = exported("INT4_AWQ_CFG", tmp_path)
    pqs = torch.stack([model.get_submodule(f"{att}{p}_proj").input_quantizer.pre_quant_scale for p in "qkv"]).mean(0)
    ln = model.get_submodule("model.layers.0.input_layernorm").weight.detach()
    assert torch.equal(t["model.layers.0.input_layernorm.weight"], ln * pqs)
    assert f"{att}q_proj.pre_quant_scale" not in t
    assert torch.equal(
        t[f"{att}o_proj.pre_quant_scale"], model.get_submodule(f"{att}o_proj").input_quantizer.pre_quant_scale
    )
    assert model.get_submodule(f"{att}q_proj").input_quantizer.pre_quant_scale is not None  # the caller's model is kept


def test_kv_scales_are_amax_over_448(tmp_path):
    model = quantized("FP8_DEFAULT_CFG+KV")
    _, t = exported("FP8_DEFAULT_CFG+KV", tmp_path)
    for i in range(2):
        att = model.get_submodule(f"model.layers.{i}.self_attn")
        for kv in "kv":
            amax = getattr(att, f"{kv}_bmm_quantizer").amax.float().reshape(())
            assert torch.equal(t[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"], amax / torch.tensor(448.0))


def test_int4_row_packing_roundtrip():
    codes = torch.randint(-8, 8, (6, 5), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    packed = pack_int4_rows(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5)
    assert int(packed[0, 0]) == (int(codes[0, 0]) & 0xF) | ((int(codes[1, 0]) & 0xF) << 4)
    assert torch.equal(unpack_int4_rows(packed), codes)


def _real_vs_fake(fake, real, x) -> int:
    """Per real module: its output on the fake module's input within ``error_bound`` (0 on the dequant paths);
    then the logits, equal where every bound is 0. Returns the number of real modules checked."""
    real_mods = {n: m for n, m in real.named_modules() if type(m).__name__ in ("QuantizedLinear", "PreScaledLinear")}
    real_mods = {n: m for n, m in real_mods.items() if not n.endswith(".inner")}
    seen: dict = {}

    def keep(name):
        def hook(_m, args, out):  # returns None: the output is left alone
            seen.setdefault(name, (args[0], out))

        return hook

    hooks = [fake.get_submodule(n).register_forward_hook(keep(n)) for n in real_mods]
    with torch.no_grad():
        want, got = fake(x).logits, real(x).logits
    for h in hooks:
        h.remove()
    all_zero = True
    for n, m in real_mods.items():
        x_in, y_fake = seen[n]
        inner, x_inner = (m.inner, x_in * m.pre_quant_scale) if hasattr(m, "inner") else (m, x_in)
        with torch.no_grad():
            bound = inner.error_bound(x_inner)
            diff = (m(x_in).double() - y_fake.double()).abs()
        assert bool((diff <= bound).all()), n
        all_zero &= bool((bound == 0).all())
    if all_zero:
        assert torch.equal(got, want)
    return len(seen)


@pytest.mark.parametrize("name", LOADABLE)
def test_reloads_into_real_modules_with_the_fake_models_outputs(name, tmp_path):
    out, _ = exported(name, tmp_path)
    real = load_hf_checkpoint(H.tiny_llama(seed=5), out)  # other float weights: all are loaded
    kinds = {type(m).__name__ for m in real.modules()}
    assert "QuantizedLinear" in kinds and ("PreScaledLinear" in kinds) == ("AWQ" in name)
    fake = fuse_for_hf_export(quantized(name))
    x = torch.randint(0, H.VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    assert _real_vs_fake(fake, real, x) == 14  # 7 Linear layers per decoder layer


@pytest.mark.parametrize("name", ["NVFP4_DEFAULT_CFG", "INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG"])
def test_bfloat16_model_reloads_with_its_outputs(name, tmp_path):
    model = quantized(name, torch.bfloat16)
    export_hf_checkpoint(model, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["model.norm.weight"].dtype == torch.bfloat16
    assert t["model.layers.0.self_attn.q_proj.weight_scale"].dtype == H.torch_dtype(
        REF["configs"][name]["tensors"]["model.layers.0.self_attn.q_proj.weight_scale"][0]
    )
    if "AWQ" in name:
        assert t["model.layers.0.self_attn.o_proj.pre_quant_scale"].dtype == torch.bfloat16  # as ModelOpt writes it
    real = load_hf_checkpoint(H.tiny_llama().to(torch.bfloat16), tmp_path)
    x = torch.randint(0, H.VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    assert _real_vs_fake(fuse_for_hf_export(model), real, x) == 14


def test_export_does_not_modify_the_model(tmp_path):
    model = quantized("INT4_AWQ_CFG")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_hf_checkpoint(model, tmp_path / "x")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# --- errors ---------------------------------------------------------------------------------------------------------
def test_uncalibrated_quantizer_is_named(tmp_path):
    model = H.tiny_llama()
    mtq.quantize(model, our_config("FP8_DEFAULT_CFG"), H.forward_loop)
    model.get_submodule("model.layers.1.mlp.up_proj").input_quantizer.reset_amax()
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.input_quantizer' is not calibrated"):
        export_hf_checkpoint(model, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_unsupported_format_names_module_and_format(tmp_path):
    model = H.tiny_llama()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, H.forward_loop)
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.self_attn\.q_proj'.*int num_bits=8"):
        export_hf_checkpoint(model, tmp_path)


def test_enabled_output_quantizer_is_refused(tmp_path):
    model = copy.deepcopy(quantized("FP8_DEFAULT_CFG"))
    oq = model.get_submodule("model.layers.0.mlp.down_proj").output_quantizer
    oq.enable()
    oq.amax = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.down_proj'.*output_quantizer is enabled"):
        export_hf_checkpoint(model, tmp_path)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "ckpt"
    export_hf_checkpoint(quantized("FP8_DEFAULT_CFG"), out)
    return out


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(str(src / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


_Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.pop(f"{_Q}.weight_scale"),
            r"q_proj\.weight: is torch\.float8_e4m3fn \(128, 128\), expected torch\.float32",
        ),
        (lambda t: t.pop("model.norm.weight"), r"model\.norm\.weight: is missing"),
        (
            lambda t: t.update({f"{_Q}.weight_scale": t[f"{_Q}.weight_scale"].double()}),
            r"is torch\.float64 \(\), expected torch\.float32",
        ),
        (
            lambda t: t.update({f"{_Q}.weight": t[f"{_Q}.weight"][:64]}),
            r"q_proj\.weight: is torch\.float8_e4m3fn \(64, 128\)",
        ),
        (lambda t: t.update({f"{_Q}.weight_scale": torch.tensor(float("nan"))}), r"weight scales must be finite"),
        (
            lambda t: t.update({f"{_Q}.weight_scale_2": torch.tensor(1.0)}),
            r"unexpected tensor\(s\) \['weight_scale_2'\] for FP8",
        ),
        (lambda t: t.update({"model.extra": torch.zeros(1)}), r"model\.extra: has no place in the model"),
    ],
)
def test_loader_rejects_bad_tensors(fp8_dir, tmp_path, edit, match):
    bad = _rewrite(fp8_dir, tmp_path / "bad", edit)
    model = H.tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(model, bad)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing modified


def test_loader_rejects_corrupt_files_and_configs(fp8_dir, tmp_path):
    bad = _rewrite(fp8_dir, tmp_path / "trunc", lambda t: None)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_hf_checkpoint(H.tiny_llama(), bad)
    for i, (text, match) in enumerate(
        [
            ("{not json", "not valid UTF-8 JSON"),
            (
                '{"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}}',
                r"kv_cache_quant_algo: must be one of \['FP8', 'NVFP4'\]",
            ),
            ('{"quantization": {"quant_algo": "INT2"}}', r"quant_algo: must be one of"),
            ('{"quantization": {"quant_algo": "FP8", "exclude_modules": [1]}}', "exclude_modules: must be a list"),
            ('{"quantization": {"quant_algo": "FP8", "group_size": NaN}}', "JSON literal NaN"),
        ]
    ):
        d = _rewrite(fp8_dir, tmp_path / f"cfg{i}", lambda t: None)
        (d / "hf_quant_config.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            load_hf_checkpoint(H.tiny_llama(), d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_reloads_as_fp8_weights_equal_to_the_fake_quant_weights(dtype, tmp_path):
    """W4A8_AWQ has no INT4-with-FP8 real kernel: it loads as FP8 W8A8 whose dequantized weight is the fake-quant
    weight (INT4 stage, then the E4M3 stage) bit for bit, and whose input scale is the checkpoint's."""
    model = quantized("W4A8_AWQ_BETA_CFG", dtype)
    export_hf_checkpoint(model, tmp_path)
    real = load_hf_checkpoint(H.tiny_llama().to(dtype), tmp_path)
    fake = fuse_for_hf_export(model)
    name = "model.layers.1.mlp.down_proj"
    loaded, fake_mod = real.get_submodule(name), fake.get_submodule(name)
    inner = loaded.inner if hasattr(loaded, "inner") else loaded
    codes, scale = inner.weight, inner.weight_scale
    assert codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == tuple(fake_mod.weight.shape)
    with torch.no_grad():
        want = fake_mod.weight_quantizer(fake_mod.weight)
    assert torch.equal((codes.float() * scale).to(dtype), want)


def test_w4a8_bad_second_scale_is_refused(tmp_path):
    export_hf_checkpoint(quantized("W4A8_AWQ_BETA_CFG"), tmp_path / "ok")
    key = "model.layers.0.self_attn.q_proj.weight_scale_2"
    bad = _rewrite(tmp_path / "ok", tmp_path / "bad", lambda t: t.update({key: torch.tensor(float("nan"))}))
    model = H.tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"q_proj\.weight_scale_2.*finite and > 0"):
        load_hf_checkpoint(model, bad)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_loader_rejects_a_different_architecture(fp8_dir):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=H.VOCAB,
        hidden_size=64,
        intermediate_size=H.FFN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(
        ValueError,
        match=r"down_proj\.weight: is torch\.float8_e4m3fn \(128, 256\), expected torch\.float8_e4m3fn \(64, 256\)",
    ):
        load_hf_checkpoint(transformers.LlamaForCausalLM(cfg), fp8_dir)


class _TwoHeads(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(32, 16), torch.nn.Linear(32, 16))

    def forward(self, x):  # both read x: a fused group
        return torch.cat([self[0](x), self[1](x)], -1)


def test_non_hf_model_needs_a_dummy_input_for_the_fusion(tmp_path):
    torch.manual_seed(0)
    model = _TwoHeads()
    x = torch.randn(4, 32)
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    with pytest.raises(ValueError, match=r"pass dummy_input="):
        export_hf_checkpoint(model, tmp_path / "a")
    export_hf_checkpoint(model, tmp_path / "b", dummy_input=x)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["hf_quant_config.json", "model.safetensors"]
    t = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert torch.equal(t["0.weight_scale_2"], t["1.weight_scale_2"]) and torch.equal(
        t["0.input_scale"], t["1.input_scale"]
    )
    assert json.loads((tmp_path / "b" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"


def test_mixed_formats_are_refused():
    from modelopt_lite.export.hf_formats import hf_quant_config

    with pytest.raises(ValueError, match=r"mixes formats \{'FP8': 'a', 'NVFP4': 'b'\}"):
        hf_quant_config({"a": "FP8", "b": "NVFP4"}, None, 16, [], "0")


def test_excluded_modules_are_summarized_with_prefix_wildcards():
    from modelopt_lite.export.hf_formats import summarize_excluded

    quantized = ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    excluded = ["lm_head", "model.embed_tokens", "model.vision.a", "model.vision.b"]
    assert summarize_excluded(excluded, quantized) == ["lm_head", "model.embed_tokens", "model.vision*"]
