"""Quantized attention exported to ONNX: every attention MatMul reads Q/DQ on both inputs, and ONNX Runtime agrees
with torch quantizer by quantizer (a difference only where float ops already differ, by at most one step)."""

from __future__ import annotations

import copy

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

import modelopt_lite as mtq  # noqa: E402
from modelopt_lite.onnx_export import (  # noqa: E402
    DivergenceReport,
    QuantizerDiff,
    attention_matmuls,
    compare_with_onnxruntime,
    export_onnx,
    float_rounding_only,
)


class MHA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x, pad):
        return self.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]


class HF(torch.nn.Module):
    """A Hugging Face base model as ``(ids, mask) -> last_hidden_state``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _hf(kind: str, impl: str):
    torch.manual_seed(0)
    if kind == "bert":
        cfg = transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
        )
        cfg._attn_implementation = impl
        return HF(transformers.BertModel(cfg, add_pooling_layer=False))
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = impl
        return HF(transformers.GPT2Model(cfg))
    cfg = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    cfg._attn_implementation = impl
    return HF(transformers.LlamaModel(cfg))


def _inputs(kind: str):
    torch.manual_seed(1)
    if kind == "mha":
        pad = torch.zeros(3, 6, dtype=torch.bool)
        pad[1, 4:] = True
        return torch.randn(3, 6, 16), pad
    ids = torch.randint(1, 100, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return ids, mask


def _export_and_check(model, args, path, cfg, layers: int):
    q = copy.deepcopy(model).eval()
    mtq.quantize(q, cfg, lambda m: m(*args))
    export_onnx(q, args, path)
    found = attention_matmuls(path)
    assert len(found) == 2 * layers, [m.name for m in found]
    assert all(m.both_quantized for m in found), [(m.name, m.quantized) for m in found]
    names = {n.name for n in onnx.load(path).graph.node if n.op_type == "QuantizeLinear"}
    assert {n for n in names if "bmm" in n or "softmax" in n} == {
        f"{prefix}.{n}_quantizer.Q" for prefix in _attention_paths(q) for n in ("q_bmm", "k_bmm", "v_bmm", "softmax")
    }
    report = compare_with_onnxruntime(q, path, args)
    ok, why = float_rounding_only(report)
    assert ok, why + "\n" + report.format()
    assert report.rows and not report.skipped, report.format()
    return q, report


def _attention_paths(model):
    return [n for n, m in model.named_modules() if hasattr(m, "softmax_quantizer")]


def test_mha_export(tmp_path):
    _, report = _export_and_check(MHA(), _inputs("mha"), tmp_path / "mha.onnx", mtq.INT8_ATTENTION_CFG, 1)
    assert [r.name for r in report.rows] == [
        "mha.in_proj_input_quantizer",
        "mha.q_bmm_quantizer",
        "mha.k_bmm_quantizer",
        "mha.v_bmm_quantizer",
        "mha.softmax_quantizer",
        "mha.out_proj.input_quantizer",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,impl", [("bert", "eager"), ("bert", "sdpa"), ("gpt2", "sdpa"), ("llama", "eager"), ("llama", "sdpa")]
)
def test_hf_attention_export(tmp_path, kind, impl):
    _export_and_check(_hf(kind, impl), _inputs(kind), tmp_path / f"{kind}.onnx", mtq.INT8_ATTENTION_CFG, 2)


@pytest.mark.slow
def test_fp8_attention_export(tmp_path):
    _export_and_check(_hf("bert", "eager"), _inputs("bert"), tmp_path / "fp8.onnx", mtq.FP8_ATTENTION_CFG, 2)


def test_attention_matmuls_sees_a_missing_qdq(tmp_path):
    """Attention quantizers off (INT8_DEFAULT_CFG): the Linear MatMuls read quantized weights and inputs, the
    attention MatMuls read float activations, and attention_matmuls says so."""
    q = copy.deepcopy(_hf("bert", "eager")).eval()
    args = _inputs("bert")
    mtq.quantize(q, mtq.INT8_DEFAULT_CFG, lambda m: m(*args))
    export_onnx(q, args, tmp_path / "d.onnx")
    found = attention_matmuls(tmp_path / "d.onnx")
    assert len(found) == 4 and not any(m.quantized[0] or m.quantized[1] for m in found)


def test_float_rounding_only_rule():
    row = QuantizerDiff
    same = DivergenceReport([row("a", 1000, 0.0, 0, 0.0), row("b", 1000, 0.0, 0, 0.0)])
    assert float_rounding_only(same) == (True, "every quantizer agrees")
    ok, why = float_rounding_only(DivergenceReport([row("a", 1000, 0.0, 0, 0.0), row("b", 4000, 3e-6, 2, 1.0)]))
    assert ok and "first difference at b: 2 value(s)" in why
    bad_scale = DivergenceReport([row("a", 1000, 0.0, 0, 0.0), row("b", 4000, 0.0, 900, 1.0)])
    assert float_rounding_only(bad_scale) == (
        False,
        "b: first difference is 900 of 4000 value(s), up to 1 scale step(s): more than float rounding moves",
    )
    same_input = DivergenceReport([row("b", 4000, 0.0, 1, 1.0)])
    assert float_rounding_only(same_input) == (False, "b: values differ while the float input differs by 0")
    drifted = DivergenceReport([row("a", 10, 1e-3, 0, 0.0), row("b", 4000, 1e-3, 1, 1.0)])
    assert not float_rounding_only(drifted)[0]
    two_steps = DivergenceReport([row("b", 4000, 1e-6, 1, 2.0)])
    assert not float_rounding_only(two_steps)[0]


@pytest.mark.slow
def test_dynamo_export_of_the_scoped_mode(tmp_path):
    """torch.export traces through the TorchFunctionMode entered in the attention forward too."""
    args = _inputs("bert")
    q = copy.deepcopy(_hf("bert", "eager")).eval()
    mtq.quantize(q, mtq.INT8_ATTENTION_CFG, lambda m: m(*args))
    export_onnx(q, args, tmp_path / "d.onnx", dynamo=True)
    found = attention_matmuls(tmp_path / "d.onnx")
    assert len(found) == 4 and all(m.both_quantized for m in found)
    ok, why = float_rounding_only(compare_with_onnxruntime(q, tmp_path / "d.onnx", args))
    assert ok, why
