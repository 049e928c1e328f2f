"""Every GEMM of nn.MultiheadAttention quantized: the in-projection (packed or separate weights) and out_proj beside
the attention matmuls. Exact against a reference written here (fake quantization done by hand), calibration,
save/restore, and the ONNX export (Q/DQ on both inputs of every MatMul/Gemm, ORT agreeing per node)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from attention_helpers import fake_int8, reference
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.nn import QuantLinear, QuantMultiheadAttention, QuantNonDynamicallyQuantizableLinear

E, H, L, S, N = 16, 4, 6, 5, 3
KINDS = ("self", "cross_kv", "cross_all", "kdim")  # q=k=v; k=v; all distinct; kdim/vdim != embed_dim (separate weights)


class Net(nn.Module):
    def __init__(self, kind: str, batch_first: bool):
        super().__init__()
        kd = (8, 12) if kind == "kdim" else (None, None)
        self.kind = kind
        self.mha = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kd[0], vdim=kd[1])

    def forward(self, x, mem, mem2, pad=None, mask=None, need_weights=True):
        if self.kind == "self":
            k = v = x
        elif self.kind == "cross_kv":
            k = v = mem
        else:
            k, v = mem, mem2
        return self.mha(x, k, v, key_padding_mask=pad, attn_mask=mask, need_weights=need_weights)


def _inputs(kind: str, batch_first: bool):
    torch.manual_seed(0)
    src = L if kind == "self" else S
    kd, vd = (8, 12) if kind == "kdim" else (E, E)

    def t(seq, d, scale=1.0):
        return (torch.randn(N, seq, d) if batch_first else torch.randn(seq, N, d)) * scale

    x, mem, mem2 = t(L, E), t(src, kd, 3.0), t(src, vd, 0.5)
    pad = torch.zeros(N, src, dtype=torch.bool)
    pad[1, src - 2 :] = True
    causal = torch.ones(L, src, dtype=torch.bool).triu(1)
    return x, mem, mem2, pad, causal


def _quantized(kind: str, batch_first: bool, cfg=mtq.INT8_ATTENTION_CFG):
    torch.manual_seed(1)
    model = Net(kind, batch_first).eval()
    x, mem, mem2, pad, causal = _inputs(kind, batch_first)
    q = copy.deepcopy(model)
    mtq.quantize(q, cfg, lambda m: m(x, mem, mem2, pad, causal))
    return model, q, (x, mem, mem2, pad, causal)


def _enabled(module):
    return sorted(n for n, m in module.named_modules() if isinstance(m, mtq.TensorQuantizer) and m.is_enabled)


def _reference(m, kind, query, key, value, mask):
    """The quantized MHA by hand, sequence-first: one input quantizer, weights per row, out_proj a QuantLinear."""
    fq = m.in_proj_input_quantizer
    b = m.in_proj_bias
    xq = fake_int8(query, fq)
    if kind == "kdim":
        bq, bk, bv = b.chunk(3)
        q = F.linear(xq, fake_int8(m.q_proj_weight, m.q_proj_weight_quantizer), bq)
        k = F.linear(fake_int8(key, fq), fake_int8(m.k_proj_weight, m.k_proj_weight_quantizer), bk)
        v = F.linear(fake_int8(value, fq), fake_int8(m.v_proj_weight, m.v_proj_weight_quantizer), bv)
    else:
        w = fake_int8(m.in_proj_weight, m.in_proj_weight_quantizer)
        if kind == "self":  # one packed GEMM
            q, k, v = F.linear(xq, w, b).chunk(3, dim=-1)
        elif kind == "cross_kv":
            (wq, wkv), (bq, bkv) = w.split([E, 2 * E]), b.split([E, 2 * E])
            q = F.linear(xq, wq, bq)
            k, v = F.linear(fake_int8(key, fq), wkv, bkv).chunk(2, dim=-1)
        else:
            (wq, wk, wv), (bq, bk, bv) = w.chunk(3), b.chunk(3)
            q, k, v = F.linear(xq, wq, bq), F.linear(fake_int8(key, fq), wk, bk), F.linear(fake_int8(value, fq), wv, bv)

    def heads(t):  # (seq, N, E) -> (N, H, seq, head_dim)
        return t.reshape(t.shape[0], N, H, E // H).permute(1, 2, 0, 3)

    qh, kh, vh = heads(q), heads(k), heads(v)
    o, p = reference(m, qh, kh.transpose(-2, -1), vh, (E // H) ** -0.5, mask)
    o = o.permute(2, 0, 1, 3).reshape(L * N, E)
    op = m.out_proj
    o = F.linear(fake_int8(o, op.input_quantizer), fake_int8(op.weight, op.weight_quantizer), op.bias)
    return o.view(L, N, E), p, (qh, kh, vh)


def test_conversion_names_and_defaults():
    packed = QuantMultiheadAttention(E, H)
    assert type(packed.out_proj) is QuantNonDynamicallyQuantizableLinear and isinstance(packed.out_proj, QuantLinear)
    assert packed.projection_quantizer_names() == ("in_proj_input_quantizer", "in_proj_weight_quantizer")
    assert packed.in_proj_weight_quantizer.quant_desc.axis == 0 and packed.in_proj_input_quantizer.is_enabled
    sep = QuantMultiheadAttention(E, H, kdim=8, vdim=12)
    assert sep.projection_quantizer_names() == (
        "in_proj_input_quantizer",
        "q_proj_weight_quantizer",
        "k_proj_weight_quantizer",
        "v_proj_weight_quantizer",
    )
    assert not hasattr(sep, "in_proj_weight_quantizer")
    q = mtq.quantize(nn.Sequential(nn.MultiheadAttention(E, H)), mtq.INT8_DEFAULT_CFG)
    assert type(q[0].out_proj) is QuantNonDynamicallyQuantizableLinear
    with pytest.raises(TypeError, match="expects a torch.nn.modules.linear.NonDynamicallyQuantizableLinear"):
        QuantNonDynamicallyQuantizableLinear.from_float(nn.Linear(4, 4))


@pytest.mark.parametrize("kind", KINDS)
def test_int8_default_quantizes_every_gemm_but_not_the_attention(kind):
    model, q, (x, mem, mem2, pad, causal) = _quantized(kind, True, mtq.INT8_DEFAULT_CFG)
    weights = ["in_proj_weight_quantizer"] if kind != "kdim" else [f"{c}_proj_weight_quantizer" for c in "kqv"]
    assert _enabled(q.mha) == sorted(
        ["in_proj_input_quantizer", *weights, "out_proj.input_quantizer", "out_proj.weight_quantizer"]
    )
    m = q.mha
    if kind != "kdim":
        assert torch.equal(m.in_proj_weight_quantizer.amax, m.in_proj_weight.abs().amax(1, keepdim=True))
        assert m.in_proj_weight_quantizer.amax.shape == (3 * E, 1)  # per output channel over the packed 3E rows
    used = {"self": [x], "cross_kv": [x, mem], "cross_all": [x, mem, mem2], "kdim": [x, mem, mem2]}[kind]
    assert float(m.in_proj_input_quantizer.amax) == max(float(t.abs().max()) for t in used)  # one shared scale
    with torch.no_grad():
        a, _ = model(x, mem, mem2, pad, causal)
        b, _ = q(x, mem, mem2, pad, causal)
    assert not torch.equal(a, b) and torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "both"])
def test_all_int8_mha_equals_reference(kind, batch_first, masks):
    _, q, (x, mem, mem2, pad, causal) = _quantized(kind, batch_first)
    m = q.mha
    assert all(getattr(m, n).amax is not None for n in m.projection_quantizer_names())
    kw = {"pad": pad, "mask": causal} if masks == "both" else {}
    with torch.no_grad():
        out, w = q(x, mem, mem2, need_weights=True, **kw)
        out2, none = q(x, mem, mem2, need_weights=False, **kw)
    assert none is None and torch.equal(out, out2)

    def seq_first(t):
        return t.transpose(0, 1) if batch_first else t

    key, value = {"self": (x, x), "cross_kv": (mem, mem)}.get(kind, (mem, mem2))
    src = key.shape[1] if batch_first else key.shape[0]
    mask = None
    if masks == "both":
        mask = torch.zeros(L, src).masked_fill(causal, float("-inf"))[None, None]
        mask = mask + torch.zeros(N, src).masked_fill(pad, float("-inf"))[:, None, None, :]
    with torch.no_grad():
        ref, p, _ = _reference(m, kind, seq_first(x), seq_first(key), seq_first(value), mask)
    assert torch.equal(out, seq_first(ref))
    assert torch.equal(w, p.mean(dim=1))


def test_projection_quantizers_alone_and_real_quant_rejected():
    """Projections quantized, attention matmuls float (INT8_DEFAULT_CFG): still the explicit, exact path."""
    _, q, (x, mem, mem2, _, _) = _quantized("cross_kv", False, mtq.INT8_DEFAULT_CFG)
    m = q.mha
    with torch.no_grad():
        out, _ = q(x, mem, mem2)
        ref, _, _ = _reference(m, "cross_kv", x, mem, mem, None)
    assert torch.equal(out, ref)
    m.in_proj_weight_quantizer.set_from_attribute_config({"fake_quant": False})
    with pytest.raises(ValueError, match="QuantMultiheadAttention: quantizer 'in_proj_weight_quantizer'.*fake_quant"):
        q(x, mem, mem2)


@pytest.mark.parametrize("kind", ["self", "kdim"])
def test_save_restore(tmp_path, kind):
    model, q, (x, mem, mem2, pad, causal) = _quantized(kind, True)
    mtq.save(q, tmp_path / "mha")
    fresh = mtq.restore(copy.deepcopy(model), tmp_path / "mha")
    assert isinstance(fresh.mha, QuantMultiheadAttention)
    assert type(fresh.mha.out_proj) is QuantNonDynamicallyQuantizableLinear
    assert _enabled(fresh.mha) == _enabled(q.mha)
    with torch.no_grad():
        assert torch.equal(fresh(x, mem, mem2, pad, causal)[0], q(x, mem, mem2, pad, causal)[0])


class _Export(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, mem=None, mem2=None):
        return self.net(x, mem, mem2, need_weights=False)[0]


@pytest.mark.parametrize("kind", ["self", "cross_kv", "kdim"])
def test_export_every_mha_gemm_has_qdq_and_ort_agrees(tmp_path, kind):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from modelopt_lite.onnx_export import attention_matmuls, compare_with_onnxruntime, export_onnx, float_rounding_only
    from modelopt_lite.onnx_export.trt_readiness import check_readiness

    _, q, (x, mem, mem2, _, _) = _quantized(kind, True)
    args = {"self": (x,), "cross_kv": (x, mem), "kdim": (x, mem, mem2)}[kind]  # the inputs the graph keeps
    model, path = _Export(q).eval(), tmp_path / f"{kind}.onnx"
    export_onnx(model, args, path)
    proto = onnx.load(path)
    rep = check_readiness(proto)
    gemms = {"self": 2, "cross_kv": 3, "kdim": 4}[kind]  # in-projection GEMM(s) + out_proj
    assert [c.status for c in rep.by_pattern("GEMM/MatMul with weights")] == ["ready"] * gemms, rep.format()
    assert [c.status for c in rep.by_pattern("attention MatMul")] == ["ready"] * 2, rep.format()
    layers = [n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm")]
    assert len(layers) == gemms + 2 and rep.ready
    assert all(m.both_quantized for m in attention_matmuls(path))
    report = compare_with_onnxruntime(model, path, args)
    ok, why = float_rounding_only(report)
    assert ok, why + "\n" + report.format()
    names = [r.name for r in report.rows]
    for n in ("q_bmm", "k_bmm", "v_bmm", "softmax"):
        assert f"net.mha.{n}_quantizer" in names
    assert "net.mha.out_proj.input_quantizer" in names
    if kind == "self":  # one Q/DQ on the shared input (cross-attention: one per tensor, see the module docstring)
        assert "net.mha.in_proj_input_quantizer" in names


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_fast_paths_do_not_bypass_the_quantizers(norm_first):
    """In eval with autograd off torch runs nn.TransformerEncoderLayer as one fused op (and nn.TransformerEncoder on
    nested tensors) on the raw parameters: quantized, the slow path runs, equal to the layer-by-layer computation."""
    from modelopt_lite.nn import QuantTransformerEncoder, QuantTransformerEncoderLayer

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, norm_first=norm_first)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x, pad = torch.randn(N, L, E), torch.zeros(N, L, dtype=torch.bool)
    pad[1, 4:] = True
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_ATTENTION_CFG, lambda m: m(x, src_key_padding_mask=pad))
    assert type(q) is QuantTransformerEncoder and type(q.layers[0]) is QuantTransformerEncoderLayer
    with torch.no_grad():
        got = q(x, src_key_padding_mask=pad)
        h = x
        for lyr in q.layers:  # the slow path by hand, through the quantized children
            kw = {"attn_mask": None, "key_padding_mask": pad, "need_weights": False}
            if norm_first:
                h = h + lyr.self_attn(lyr.norm1(h), lyr.norm1(h), lyr.norm1(h), **kw)[0]
                h = h + lyr.linear2(F.relu(lyr.linear1(lyr.norm2(h))))
            else:
                h = lyr.norm1(h + lyr.self_attn(h, h, h, **kw)[0])
                h = lyr.norm2(h + lyr.linear2(F.relu(lyr.linear1(h))))
        assert torch.equal(got[pad.logical_not()], h[pad.logical_not()])
        assert not torch.equal(got, model(x, src_key_padding_mask=pad))
    off = mtq.quantize(copy.deepcopy(model), {"quant_cfg": {"default": {"enable": False}}, "algorithm": None})
    with torch.no_grad():  # every quantizer off: the float model, fast paths included
        assert torch.equal(off(x, src_key_padding_mask=pad), model(x, src_key_padding_mask=pad))
