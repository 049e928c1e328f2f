"""Hugging Face attention (transformers 5.x) with attention quantizers: BERT eager and sdpa with padding masks,
GPT-2 and Llama (GQA) decoders built from small configs, KV-cache decoding, save/restore."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attention_helpers import capture_inputs, reference  # noqa: E402

import modelopt_lite as mtq  # noqa: E402
from modelopt_lite.nn import ATTENTION_QUANTIZERS  # noqa: E402
from modelopt_lite.nn.modules.quant_attention_hf import is_hf_attention_class  # noqa: E402

ALL_OFF = {"quant_cfg": {"default": {"enable": False}}, "algorithm": "max"}


def bert(impl: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    cfg._attn_implementation = impl
    return transformers.BertModel(cfg, add_pooling_layer=False).eval()


def gpt2(impl: str):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = impl
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama(impl: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    cfg._attn_implementation = impl
    return transformers.LlamaForCausalLM(cfg).eval()


def feed():
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def quantized(model, cfg, data):
    q = copy.deepcopy(model)
    mtq.quantize(q, cfg, lambda m: m(**data))
    return q


def attention_modules(model):
    return {n: m for n, m in model.named_modules() if hasattr(m, "q_bmm_quantizer")}


def test_the_attention_computing_classes_are_found():
    from transformers.models.bert import modeling_bert as mb
    from transformers.models.gpt2 import modeling_gpt2 as mg
    from transformers.models.llama import modeling_llama as ml

    assert is_hf_attention_class(mb.BertSelfAttention) and is_hf_attention_class(mb.BertCrossAttention)
    assert is_hf_attention_class(mg.GPT2Attention) and is_hf_attention_class(ml.LlamaAttention)
    # wrappers and non-attention classes are not: each attention is quantized once
    assert not any(is_hf_attention_class(c) for c in (mb.BertAttention, mb.BertLayer, ml.LlamaMLP, torch.nn.Linear))
    q = quantized(bert("eager"), ALL_OFF, feed())
    assert sorted(attention_modules(q)) == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    assert type(q.encoder.layer[0].attention.self).__name__ == "QuantBertSelfAttention"
    assert type(q.encoder.layer[0].attention.self.query).__name__ == "QuantLinear"  # its children converted too
    assert type(q.encoder.layer[0].attention).__name__ == "BertAttention"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("build", [bert, gpt2, llama])
def test_quantizers_off_is_bit_identical(build, impl):
    model, data = build(impl), feed()
    q = quantized(model, ALL_OFF, data)
    assert attention_modules(q)
    with torch.no_grad():
        a, b = model(**data), q(**data)
    key = "last_hidden_state" if "last_hidden_state" in a else "logits"
    assert torch.equal(a[key], b[key])


def test_bert_eager_attention_equals_reference():
    """The eager interface's matmuls get the quantizers: Q and K^T into the first, P and V into the second; the
    module output equals the attention computed here with the fake quantization written out."""
    model, data = bert("eager"), feed()
    q = quantized(model, mtq.INT8_ATTENTION_CFG, data)
    attn = q.encoder.layer[0].attention.self
    seen, hooks = capture_inputs(attn)
    got = {}
    hooks.append(
        attn.register_forward_pre_hook(lambda m, a, kw: got.__setitem__("mask", kw["attention_mask"]), with_kwargs=True)
    )
    hooks.append(attn.register_forward_hook(lambda m, a, o: got.__setitem__("out", o)))
    try:
        with torch.no_grad():
            q(**data)
    finally:
        for h in hooks:
            h.remove()
    qi, kti, vi = (seen[n][0] for n in ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer"))
    assert qi.shape == vi.shape == (3, 4, 7, 8) and kti.shape == (3, 4, 8, 7)  # K^T: the matmul's own operand
    ref, p = reference(attn, qi, kti, vi, attn.scaling, got["mask"])
    out, weights = got["out"]
    assert torch.equal(out, ref.transpose(1, 2).reshape(3, 7, 32))
    # the interface returns its probabilities as computed (float); their quantized copy fed P @ V
    assert torch.equal(seen["softmax_quantizer"][0], weights) and torch.equal(seen["softmax_quantizer"][1], p)
    assert not torch.equal(weights, p)


@pytest.mark.slow
def test_bert_eager_and_sdpa_quantize_alike_with_padding():
    data = feed()
    eager, sdpa = bert("eager"), bert("sdpa")
    qe, qs = quantized(eager, mtq.INT8_ATTENTION_CFG, data), quantized(sdpa, mtq.INT8_ATTENTION_CFG, data)
    for name, m in attention_modules(qe).items():
        ms = qs.get_submodule(name)
        for n in ATTENTION_QUANTIZERS:
            torch.testing.assert_close(getattr(m, n).amax, getattr(ms, n).amax, rtol=1e-6, atol=0), (name, n)
    with torch.no_grad():
        he, hs = qe(**data).last_hidden_state, qs(**data).last_hidden_state
        ref = eager(**data).last_hidden_state
    torch.testing.assert_close(he, hs, rtol=1e-4, atol=1e-4)
    # padding: a sample's real tokens do not see its pad tokens (same result as the sample alone, unpadded)
    with torch.no_grad():
        alone = qs(input_ids=data["input_ids"][2:, :3], attention_mask=data["attention_mask"][2:, :3])
    torch.testing.assert_close(hs[2, :3], alone.last_hidden_state[0], rtol=1e-4, atol=1e-4)
    cos = torch.nn.functional.cosine_similarity(he.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99 and not torch.equal(he, ref)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("build", [gpt2, llama])
def test_decoder_attention_and_kv_cache_decoding(build, impl):
    model, data = build(impl), feed()
    q = quantized(model, mtq.INT8_ATTENTION_CFG, data)
    mods = attention_modules(q)
    assert len(mods) == 2
    for name, m in mods.items():
        for n in ATTENTION_QUANTIZERS:
            tq = getattr(m, n)
            assert tq.is_enabled and tq.amax is not None and float(tq.amax) > 0, (name, n)
    ids = data["input_ids"][:1]
    with torch.no_grad():
        full = q(input_ids=ids).logits
        ref = model(input_ids=ids).logits
        # decode the last token from the cache of the first six: the cached keys/values go through k/v_bmm
        pre = q(input_ids=ids[:, :6], use_cache=True)
        step = q(input_ids=ids[:, 6:], past_key_values=pre.past_key_values, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=1e-4, atol=1e-4)
    cos = torch.nn.functional.cosine_similarity(full.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99 and not torch.equal(full, ref)


def test_save_restore_round_trip(tmp_path):
    model, data = bert("sdpa"), feed()
    q = quantized(model, mtq.INT8_ATTENTION_CFG, data)
    mtq.save(q, tmp_path / "state")
    fresh = mtq.restore(bert("sdpa"), tmp_path / "state")
    with torch.no_grad():
        assert torch.equal(fresh(**data).last_hidden_state, q(**data).last_hidden_state)
    m = attention_modules(fresh)["encoder.layer.1.attention.self"]
    assert m.softmax_quantizer.is_enabled and torch.equal(
        m.softmax_quantizer.amax, q.encoder.layer[1].attention.self.softmax_quantizer.amax
    )
