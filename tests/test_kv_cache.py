"""KV-cache quantization of decoder models (tiny Hugging Face GPT-2 and Llama built from a config, no downloads):
the presets, the k/v values attention sees at every generate() step, save/restore of the scales, ONNX export."""

import copy

import onnx
import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.conversion.utils import named_quantizers
from modelopt_lite.functional import microscaling, reference
from modelopt_lite.onnx_export.ort_runner import ort_session
from modelopt_lite.onnx_export.trt_readiness import check_readiness
from modelopt_lite.presets import PRESETS
from modelopt_lite.presets.base import DEFAULT_DISABLED
from modelopt_lite.presets.kv import KV_PATTERN, with_kv_cache

transformers = pytest.importorskip("transformers")
from decoder_helpers import generate_new as _generate  # noqa: E402
from decoder_helpers import kv_quantizers as _kv_quantizers  # noqa: E402
from decoder_helpers import prompt as _prompt
from decoder_helpers import tiny_decoder as _decoder


def _ref(q, x):
    """The reference fake quant of ``x`` with q's calibrated per-tensor amax (numerics contract)."""
    amax = q.amax.float().reshape(())
    if q.num_bits == (2, 1):  # NVFP4: blocks of 16 along the head dimension under the global scale
        return microscaling.fake_nvfp4(x, microscaling.nvfp4_global_scale(amax), 16)
    if q.num_bits == (4, 3):
        return reference.fake_e4m3(x, amax / 448.0)
    return reference.fake_quant_int(x, amax / 127.0, -128, 127)


# --- presets ---------------------------------------------------------------------------------------------------------
def test_kv_presets_content_and_merge():
    assert mtq.FP8_KV_CFG["quant_cfg"][KV_PATTERN] == {"num_bits": (4, 3), "axis": None, "enable": True}
    assert mtq.INT8_KV_CFG["quant_cfg"][KV_PATTERN] == {
        "num_bits": 8,
        "axis": None,
        "calib_method": "max",
        "enable": True,
    }
    for name in ("FP8_KV_CFG", "INT8_KV_CFG"):
        cfg = PRESETS[name]
        assert cfg["quant_cfg"]["default"] == {"enable": False} and cfg["algorithm"] == "max"
    base = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    merged = with_kv_cache(mtq.INT8_DEFAULT_CFG, mtq.FP8_KV_CFG)
    assert mtq.INT8_DEFAULT_CFG == base  # not mutated
    keys = list(merged["quant_cfg"])
    assert merged["quant_cfg"][KV_PATTERN]["num_bits"] == (4, 3)
    assert merged["quant_cfg"]["*weight_quantizer"] == base["quant_cfg"]["*weight_quantizer"]
    assert keys.index(KV_PATTERN) < min(keys.index(k) for k in DEFAULT_DISABLED)  # the disabled entries still win
    assert merged["algorithm"] == base["algorithm"]
    with pytest.raises(TypeError, match="with_kv_cache: kv_config must be a dict with a 'quant_cfg' dict"):
        with_kv_cache(mtq.INT8_DEFAULT_CFG, {"quant_cfg": [1]})
    with pytest.raises(ValueError, match="no KV-cache entries"):
        with_kv_cache(mtq.INT8_DEFAULT_CFG, mtq.INT8_DEFAULT_CFG | {"quant_cfg": {"default": {"enable": False}}})


def test_kv_preset_matches_modelopt():
    peer = pytest.importorskip("modelopt.torch.quantization")
    (entry,) = peer.FP8_KV_CFG["quant_cfg"]
    assert entry["quantizer_name"] == KV_PATTERN
    ours = mtq.FP8_KV_CFG["quant_cfg"][KV_PATTERN]
    assert tuple(entry["cfg"]["num_bits"]) == ours["num_bits"] and entry["cfg"]["axis"] is ours["axis"]


# --- generate() with a quantized KV cache ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, attn, preset",
    [
        ("gpt2", "eager", "FP8_KV_CFG"),
        ("llama", "eager", "INT8_KV_CFG"),
        ("llama", "sdpa", "FP8_KV_CFG"),
        ("llama", "sdpa", "NVFP4_KV_CFG"),
        ("gpt2", "eager", "NVFP4_KV_CFG"),
    ],
)
def test_generate_sees_reference_quantized_kv_at_every_step(arch, attn, preset):
    model = _decoder(arch, attn)
    prompt = _prompt()
    mtq.quantize(model, PRESETS[preset], lambda m: m(prompt))
    kv = _kv_quantizers(model)
    enabled = {n for n, q in named_quantizers(model) if q.is_enabled}
    assert enabled == set(kv) and len(kv) == 4  # only the keys and values of both layers
    assert all(q.amax is not None and q.amax.numel() == 1 for q in kv.values())
    calls: dict[str, list] = {n: [] for n in kv}
    hooks = [
        q.register_forward_hook(lambda mod, i, o, n=n: calls[n].append((i[0].detach().clone(), o.detach().clone())))
        for n, q in kv.items()
    ]
    try:
        with torch.no_grad():
            tokens = _generate(model, prompt)
    finally:
        for h in hooks:
            h.remove()
    assert tokens.shape == (2, 4) and tokens.dtype == torch.long
    for n, seen in calls.items():
        assert len(seen) == 4, n  # the prompt, then one step per new token (the last token needs no forward)
        for step, (x, y) in enumerate(seen):
            assert y.dtype == x.dtype == torch.float32
            assert torch.equal(y, _ref(kv[n], x)), (n, step)
        assert any(not torch.equal(x, y) for x, y in seen), n  # values were actually quantized
        # the cache grows by one position per step and the cached part is seen exactly as before
        for (x0, y0), (x1, y1) in zip(seen, seen[1:], strict=False):
            axis = next(d for d in range(x1.dim()) if x1.shape[d] != x0.shape[d])
            assert x1.shape[axis] == x0.shape[axis] + 1
            assert torch.equal(x1.narrow(axis, 0, x0.shape[axis]), x0)
            assert torch.equal(y1.narrow(axis, 0, y0.shape[axis]), y0)
    with torch.no_grad():
        assert torch.equal(_generate(model, prompt), tokens)  # deterministic (greedy)


def test_kv_cache_with_a_model_preset():
    model = _decoder("llama")
    prompt = _prompt()
    mtq.quantize(model, with_kv_cache(mtq.INT8_DEFAULT_CFG, mtq.FP8_KV_CFG), lambda m: m(prompt))
    kv = _kv_quantizers(model)
    assert all(q.is_enabled and q.num_bits == (4, 3) for q in kv.values())
    layer0 = model.model.layers[0]
    assert (
        layer0.self_attn.q_proj.weight_quantizer.is_enabled and layer0.self_attn.q_proj.weight_quantizer.num_bits == 8
    )
    assert not layer0.self_attn.q_bmm_quantizer.is_enabled and not layer0.self_attn.softmax_quantizer.is_enabled
    assert not model.lm_head.weight_quantizer.is_enabled  # "*lm_head*" stays off
    with torch.no_grad():
        assert _generate(model, prompt).shape == (2, 4)


# --- save / restore and export ---------------------------------------------------------------------------------------
class _Logits(torch.nn.Module):
    """A cache-free forward with explicit mask and positions (exportable with the TorchScript exporter)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos, use_cache=False).logits


def test_kv_scales_saved_restored_and_exported(tmp_path):
    model = _decoder("gpt2")
    prompt = _prompt()
    mtq.quantize(model, mtq.FP8_KV_CFG, lambda m: m(prompt))
    mtq.save(model, tmp_path / "kv")
    restored = mtq.restore(_decoder("gpt2"), tmp_path / "kv")
    ours, theirs = _kv_quantizers(model), _kv_quantizers(restored)
    assert list(ours) == list(theirs)
    for n in ours:
        assert theirs[n].is_enabled and theirs[n].num_bits == (4, 3)
        assert torch.equal(theirs[n].amax, ours[n].amax), n
    with torch.no_grad():
        assert torch.equal(_generate(restored, prompt), _generate(model, prompt))

    path = tmp_path / "gpt2_kv.onnx"
    mtq.export_onnx(_Logits(restored), prompt, path)
    g = onnx.load(path).graph
    inits = {t.name: t for t in g.initializer}
    qs = [n for n in g.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == 4  # K and V of both layers, nothing else
    scales = sorted(float(onnx.numpy_helper.to_array(inits[q.input[1]])) for q in qs)
    expected = sorted(float(q.amax.float() / 448.0) for q in theirs.values())
    assert scales == expected
    assert all(inits[q.input[2]].data_type == onnx.TensorProto.FLOAT8E4M3FN for q in qs)
    rep = check_readiness(onnx.load(path))
    att = rep.by_pattern("attention MatMul")
    assert len(att) == 4 and all(c.status == "missing" and "input 1" not in c.detail for c in att)  # K, V quantized
    with torch.no_grad():
        expected_logits = _Logits(restored)(prompt)
    got = torch.from_numpy(ort_session(path).run(None, {"input": prompt.numpy()})[0])
    assert got.shape == expected_logits.shape and torch.allclose(got, expected_logits, atol=1e-4)
