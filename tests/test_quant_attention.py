"""Attention quantizers on nn.MultiheadAttention and on modules calling F.scaled_dot_product_attention: placement
(exact against a reference that applies the fake quantization in the test), masks, need_weights, batch_first,
is_causal, GQA, and bit-identity with the float module when the quantizers are off."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from attention_helpers import capture_inputs, fake_int8, reference
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.nn import (
    ATTENTION_QUANTIZERS,
    QuantModuleRegistry,
    QuantMultiheadAttention,
    register_attention_module,
)
from modelopt_lite.nn.modules.quant_attention import AttentionQuantMode

E, H = 16, 4


class MHAModel(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, batch_first=batch_first)

    def forward(self, x, pad=None, mask=None, need_weights=True, average=True):
        return self.mha(
            x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=need_weights, average_attn_weights=average
        )


def _mha_inputs(batch_first: bool):
    torch.manual_seed(0)
    x = torch.randn(3, 6, E) if batch_first else torch.randn(6, 3, E)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True: not allowed (nn.MultiheadAttention's convention)
    return x, pad, causal


_INT8_A = {"num_bits": 8, "axis": None, "calib_method": "max", "enable": True}
#: the attention matmul inputs only (the projections stay float; test_quant_mha_projections covers them)
ATTENTION_ONLY_CFG = {
    "quant_cfg": {"default": {"enable": False}, "*[qkv]_bmm_quantizer": _INT8_A, "*softmax_quantizer": _INT8_A},
    "algorithm": "max",
}
ALL_OFF_CFG = {"quant_cfg": {"default": {"enable": False}}, "algorithm": "max"}


def _quantized_mha(batch_first: bool, cfg=ATTENTION_ONLY_CFG):
    torch.manual_seed(1)
    model = MHAModel(batch_first).eval()
    x, pad, causal = _mha_inputs(batch_first)
    q = copy.deepcopy(model)
    mtq.quantize(q, cfg, lambda m: m(x, pad, causal))
    return model, q, (x, pad, causal)


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_quantizers_off_is_bit_identical(batch_first):
    model, q, (x, pad, causal) = _quantized_mha(batch_first, ALL_OFF_CFG)
    assert isinstance(q.mha, QuantMultiheadAttention)
    assert not any(m.is_enabled for m in q.mha.modules() if isinstance(m, mtq.TensorQuantizer))
    with torch.no_grad():
        for kw in ({}, {"pad": pad}, {"mask": causal}, {"pad": pad, "mask": causal}):
            for need_weights in (True, False):
                a, wa = model(x, need_weights=need_weights, **kw)
                b, wb = q(x, need_weights=need_weights, **kw)
                assert torch.equal(a, b)
                assert (wa is None and wb is None) or torch.equal(wa, wb)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "pad", "causal", "both"])
def test_mha_quantized_equals_reference(batch_first, masks):
    _, q, (x, pad, causal) = _quantized_mha(batch_first)
    mha = q.mha
    for n in ATTENTION_QUANTIZERS:
        assert getattr(mha, n).is_enabled and getattr(mha, n).amax is not None, n
    kw = {"pad": pad if masks in ("pad", "both") else None, "mask": causal if masks in ("causal", "both") else None}
    seen, hooks = capture_inputs(mha)
    try:
        with torch.no_grad():
            out, w = q(x, need_weights=True, average=False, **kw)
            out2, none = q(x, need_weights=False, **kw)
            out3, w_avg = q(x, need_weights=True, average=True, **kw)
    finally:
        for h in hooks:
            h.remove()
    assert none is None and torch.equal(out, out2) and torch.equal(out, out3)  # one path, whatever need_weights says
    qi, ki, vi = (seen[n][0] for n in ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer"))
    L = S = 6
    assert qi.shape == ki.shape == vi.shape == (3, H, L, E // H)  # (batch, heads, seq, head_dim) on every layout
    # the projections: the quantizers see exactly what the float attention computes from
    xs = x if not batch_first else x.transpose(0, 1)
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    torch.testing.assert_close(qi, F.linear(xs, wq, bq).reshape(L, 3, H, E // H).permute(1, 2, 0, 3))
    torch.testing.assert_close(vi, F.linear(xs, wv, bv).reshape(S, 3, H, E // H).permute(1, 2, 0, 3))
    mask = None
    if kw["mask"] is not None:
        mask = torch.zeros(L, S).masked_fill(kw["mask"], float("-inf"))[None, None]
    if kw["pad"] is not None:
        kpm = torch.zeros(3, S).masked_fill(kw["pad"], float("-inf"))[:, None, None, :]
        mask = kpm if mask is None else mask + kpm
    ref, p = reference(mha, qi, ki.transpose(-2, -1), vi, (E // H) ** -0.5, mask)
    assert torch.equal(w, p) and torch.equal(w_avg, p.mean(dim=1))
    assert torch.equal(seen["softmax_quantizer"][1], p)
    o = F.linear(ref.permute(2, 0, 1, 3).reshape(L * 3, E), mha.out_proj.weight, mha.out_proj.bias).view(L, 3, E)
    assert torch.equal(out, o.transpose(0, 1) if batch_first else o)
    if kw["pad"] is not None:
        assert bool((w[1, :, :, 4:] == 0).all())  # padded keys get no attention


def test_mha_unbatched_and_calibration_pass_through():
    _, q, (x, _, _) = _quantized_mha(True)
    with torch.no_grad():
        out, w = q(x[0])  # (L, E): unbatched
        full, wf = q(x[:1])
    assert out.shape == (6, E) and w.shape == (6, 6)
    assert torch.equal(out, full[0]) and torch.equal(w, wf[0])
    # quantizers enabled but collecting (quantization off): the explicit path computes the float attention
    float_model = MHAModel(True).eval()
    float_model.load_state_dict({k: v for k, v in q.state_dict().items() if "quantizer" not in k})
    for n in ATTENTION_QUANTIZERS:
        getattr(q.mha, n).disable_quant()
    with torch.no_grad():
        a, wa = q(x)
        b, wb = float_model(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-6)


def test_mha_real_quant_mode_is_rejected():
    _, q, (x, _, _) = _quantized_mha(True)
    q.mha.softmax_quantizer.set_from_attribute_config({"fake_quant": False})
    with pytest.raises(ValueError, match="QuantMultiheadAttention: quantizer 'softmax_quantizer'.*fake_quant=False"):
        q(x)


class SDPAttention(nn.Module):
    """A user module computing attention with F.scaled_dot_product_attention (GQA: 4 query heads, 2 kv heads)."""

    def __init__(self, causal: bool, gqa: bool = False):
        super().__init__()
        self.causal, self.gqa = causal, gqa
        self.q = nn.Linear(E, E)
        self.kv = nn.Linear(E, E if gqa else 2 * E)

    def heads(self, t, n):
        return t.reshape(t.shape[0], t.shape[1], n, -1).transpose(1, 2)

    def forward(self, x, mask=None):
        q = self.heads(self.q(x), H)
        k, v = (self.heads(t, H // 2 if self.gqa else H) for t in self.kv(x).chunk(2, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=self.gqa)
        return o.transpose(1, 2).reshape(x.shape)


@pytest.fixture
def registered_sdpa():
    cls = register_attention_module(SDPAttention)
    yield cls
    QuantModuleRegistry.unregister(SDPAttention)


@pytest.mark.parametrize("causal,gqa", [(True, False), (False, True), (True, True)])
def test_sdpa_module_is_causal_and_gqa(registered_sdpa, causal, gqa):
    torch.manual_seed(0)
    model = SDPAttention(causal, gqa).eval()
    x = torch.randn(2, 5, E)
    off = mtq.quantize(copy.deepcopy(model), mtq.INT8_DEFAULT_CFG, lambda m: m(x))  # the root converts: returned
    assert type(off).__name__ == "QuantSDPAttention"
    for name, tq in mtq.conversion.named_quantizers(off):
        assert tq.is_enabled == ("input" in name or "weight" in name), name
        tq.disable()  # the Linears' too: everything float
    with torch.no_grad():
        assert torch.equal(off(x), model(x))  # quantizers off: the fused SDPA call itself
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_ATTENTION_CFG, lambda m: m(x))
    seen, hooks = capture_inputs(q)
    try:
        with torch.no_grad():
            out = q(x)
    finally:
        for h in hooks:
            h.remove()
    qi, ki, vi = (seen[n][0] for n in ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer"))
    assert ki.shape == (2, H // 2 if gqa else H, 5, E // H)  # key/value quantized before the GQA repeat
    mask = torch.zeros(5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf")) if causal else None
    r = 2 if gqa else 1
    k_t = fake_int8(ki, q.k_bmm_quantizer).repeat_interleave(r, dim=1).transpose(-2, -1)
    v = fake_int8(vi, q.v_bmm_quantizer).repeat_interleave(r, dim=1)
    s = torch.matmul(fake_int8(qi, q.q_bmm_quantizer), k_t) * (E // H) ** -0.5
    p = fake_int8(torch.softmax(s if mask is None else s + mask, dim=-1), q.softmax_quantizer)
    ref = torch.matmul(p, v).transpose(1, 2).reshape(x.shape)
    assert torch.equal(out, ref)
    with torch.no_grad():
        cos = F.cosine_similarity(out.flatten(), model(x).flatten(), dim=0)
    assert cos > 0.99


def test_sdpa_bool_mask_and_fully_masked_rows(registered_sdpa):
    torch.manual_seed(0)
    model = SDPAttention(False).eval()
    x = torch.randn(2, 5, E)
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    keep[1, :, 2, :] = False  # query 2 of sample 1 attends to nothing: 0 (as torch's SDPA), never NaN
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_ATTENTION_CFG, lambda m: m(x, keep))
    with torch.no_grad():
        out = q(x, keep)
        ref = model(x, keep)
    assert torch.isfinite(out).all() and torch.equal(out[1, 2], torch.zeros(E)) and torch.equal(ref[1, 2], out[1, 2])
    with pytest.raises(TypeError, match="attn_mask must be bool or floating point, got torch.int64"):
        q(x, keep.long())


def test_kv_only_keeps_the_fused_kernel(registered_sdpa):
    torch.manual_seed(0)
    model = SDPAttention(True).eval()
    x = torch.randn(2, 5, E)
    cfg = {"quant_cfg": {"default": {"enable": False}, "*[kv]_bmm_quantizer": {"num_bits": 8, "axis": None}}}
    q = mtq.quantize(copy.deepcopy(model), cfg, lambda m: m(x))
    assert [n for n in ATTENTION_QUANTIZERS if getattr(q, n).is_enabled] == ["k_bmm_quantizer", "v_bmm_quantizer"]
    seen, hooks = capture_inputs(q)
    with torch.no_grad():
        out = q(x)
    for h in hooks:
        h.remove()
    qh = model.heads(model.q(x), H)
    ref = F.scaled_dot_product_attention(qh, seen["k_bmm_quantizer"][1], seen["v_bmm_quantizer"][1], is_causal=True)
    assert torch.equal(out, ref.transpose(1, 2).reshape(x.shape))


def test_mode_is_scoped_to_the_module_and_thread(registered_sdpa):
    """Nothing global: F.scaled_dot_product_attention outside the module (also in another thread while the module
    runs) is the float kernel; the mode is gone after the forward, also when it raised."""
    torch.manual_seed(0)
    model = SDPAttention(False).eval()
    x = torch.randn(2, 5, E)
    q = mtq.quantize(copy.deepcopy(model), mtq.INT8_ATTENTION_CFG, lambda m: m(x))
    a = torch.randn(2, H, 5, 4)
    ref = F.scaled_dot_product_attention(a, a, a)
    results = []

    def other():
        results.append(torch.equal(F.scaled_dot_product_attention(a, a, a), ref))

    class Probe(nn.Module):
        def forward(self, t):
            th = threading.Thread(target=other)
            th.start()
            th.join()
            return t

    q.q = nn.Sequential(q.q, Probe())  # runs inside the quantized forward
    with torch.no_grad():
        q(x)
        with pytest.raises(RuntimeError):
            q(torch.randn(2, 5, E + 1))
    assert results == [True]
    assert not torch.overrides._is_torch_function_mode_enabled()
    assert torch.equal(F.scaled_dot_product_attention(a, a, a), ref)


def test_nested_attention_modules_quantize_once(registered_sdpa):
    """An attention module running inside another's forward handles its own calls (no double quantization)."""
    torch.manual_seed(0)
    inner = SDPAttention(False).eval()
    x = torch.randn(2, 5, E)
    q = mtq.quantize(copy.deepcopy(inner), mtq.INT8_ATTENTION_CFG, lambda m: m(x))
    counts = {n: 0 for n in ATTENTION_QUANTIZERS}
    for n in ATTENTION_QUANTIZERS:
        getattr(q, n).register_forward_hook(lambda m, i, o, n=n: counts.__setitem__(n, counts[n] + 1))

    class Outer:
        q_bmm_quantizer = k_bmm_quantizer = v_bmm_quantizer = softmax_quantizer = staticmethod(lambda t: t * 0)

    with torch.no_grad(), AttentionQuantMode(Outer()):
        out = q(x)
    assert counts == dict.fromkeys(ATTENTION_QUANTIZERS, 1)
    with torch.no_grad():
        assert torch.equal(out, q(x))


def test_presets_leave_attention_off_and_attention_presets_enable_it():
    from modelopt_lite.presets import PRESETS

    for name, cfg in PRESETS.items():
        attention = "ATTENTION" in name
        assert ("*softmax_quantizer" in cfg["quant_cfg"]) == attention, name
        assert cfg["quant_cfg"]["default"] == {"enable": False}, name
        assert list(cfg["quant_cfg"])[-1] == "*mlp.gate.*", name  # DEFAULT_DISABLED stays last
    assert mtq.FP8_ATTENTION_CFG["quant_cfg"]["*[qkv]_bmm_quantizer"]["num_bits"] == (4, 3)
    assert mtq.INT8_SMOOTHQUANT_ATTENTION_CFG["algorithm"] == {"method": "smoothquant", "alpha": 0.8}


def test_fp8_attention_on_mha():
    _, q, (x, pad, _) = _quantized_mha(True, mtq.FP8_ATTENTION_CFG)
    assert q.mha.q_bmm_quantizer.quant_desc.num_bits == (4, 3)
    seen, hooks = capture_inputs(q.mha)
    with torch.no_grad():
        q(x, pad)
    for h in hooks:
        h.remove()
    for n in ATTENTION_QUANTIZERS:
        i, o = seen[n]
        assert torch.equal(o, mtq.scaled_e4m3(i, getattr(q.mha, n).amax)), n
