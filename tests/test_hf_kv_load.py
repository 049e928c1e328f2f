"""``load_hf_checkpoint`` with a KV cache: the ``k_scale`` / ``v_scale`` of an HF checkpoint back onto quantized
attention modules, bit for bit with the fake-quant model's key/value quantizers (FP8), and its errors."""

from __future__ import annotations

import copy
import warnings

import hf_helpers as H
import pytest
import torch
from safetensors.torch import load_file
from test_hf_export import _real_vs_fake, _rewrite

import modelopt_lite as mtq
from modelopt_lite.export import export_hf_checkpoint, fuse_for_hf_export, load_hf_checkpoint
from modelopt_lite.functional.scales import amax_for_scale, scale_from_amax

ATT = "model.layers.{}.self_attn"


def _kv_model(kv_cfg, dtype=torch.float32):
    model = H.tiny_llama().to(dtype)
    mtq.quantize(model, mtq.with_kv_cache(copy.deepcopy(mtq.FP8_DEFAULT_CFG), kv_cfg), H.forward_loop)
    return model


@pytest.fixture(scope="module")
def fp8_kv(tmp_path_factory):
    model = _kv_model(mtq.FP8_KV_CFG)
    out = tmp_path_factory.mktemp("fp8kv")
    export_hf_checkpoint(model, out)
    return model, out


def test_fp8_kv_cache_reloads_bit_for_bit(fp8_kv):
    model, out = fp8_kv
    t = load_file(str(out / "model.safetensors"))
    real = load_hf_checkpoint(H.tiny_llama(seed=5), out)
    x = torch.randn(2, 4, 9, 32, generator=torch.Generator().manual_seed(3)) * 3
    for i in range(2):
        att, fake_att = real.get_submodule(ATT.format(i)), model.get_submodule(ATT.format(i))
        assert type(att).__name__ == "QuantLlamaAttention"
        assert not att.q_bmm_quantizer.is_enabled and not att.softmax_quantizer.is_enabled
        for kv in "kv":
            q, fq = getattr(att, f"{kv}_bmm_quantizer"), getattr(fake_att, f"{kv}_bmm_quantizer")
            assert q.is_enabled and q.name == f"{ATT.format(i)}.{kv}_bmm_quantizer"
            scale = t[f"{ATT.format(i)}.{kv}_proj.{kv}_scale"]
            assert torch.equal(scale_from_amax(q.amax.float(), 448.0).reshape(()), scale)
            assert torch.equal(q(x), fq(x))  # the same E4M3 grid: bit for bit
    # the Linear layers as before (real within their bounds), and the KV quantization really applies
    ids = torch.randint(0, H.VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    assert _real_vs_fake(fuse_for_hf_export(model), real, ids) == 14
    with torch.no_grad():
        on = real(ids).logits
        for i in range(2):
            real.get_submodule(ATT.format(i)).k_bmm_quantizer.disable()
        off = real(ids).logits
    assert not torch.equal(on, off)


def test_nvfp4_kv_cache_reloads(tmp_path):
    model = _kv_model(mtq.NVFP4_KV_CFG)
    export_hf_checkpoint(model, tmp_path)
    real = load_hf_checkpoint(H.tiny_llama(), tmp_path)
    for i in range(2):
        att, fake_att = real.get_submodule(ATT.format(i)), model.get_submodule(ATT.format(i))
        for kv in "kv":
            q, fq = getattr(att, f"{kv}_bmm_quantizer"), getattr(fake_att, f"{kv}_bmm_quantizer")
            assert q.quant_desc.num_bits == (2, 1) and q.quant_desc.block_sizes == fq.quant_desc.block_sizes
            # only amax / 448 is stored: the recovered amax has the same scale at 448
            assert torch.equal(scale_from_amax(q.amax.float(), 448.0), scale_from_amax(fq.amax.float(), 448.0))


def test_amax_for_scale_inverts_the_true_division():
    a = torch.rand(3000, generator=torch.Generator().manual_seed(0)) * 1000 + 1e-6
    for bound in (448.0, 6.0 * 448.0, 127.0, 7.0):
        s = scale_from_amax(a, bound)
        for i in range(0, 3000, 7):
            amax, exact = amax_for_scale(s[i], bound)
            assert exact and amax.dtype == torch.float32 and torch.equal(scale_from_amax(amax, bound), s[i])
    # a scale that no float32 amax divides to (448 = 1.75 * 2**8: some scales are skipped) comes back inexact
    found = 0
    for bits in range(0x3F99999A, 0x3F99999A + 64):
        s = torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]
        amax, exact = amax_for_scale(s, 448.0)
        if not exact:
            found += 1
            assert abs(float(scale_from_amax(amax, 448.0)) - float(s)) <= float(torch.finfo(torch.float32).eps) * 2
    assert found > 0


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop(f"{ATT.format(1)}.v_proj.v_scale"), r"layers\.1\.self_attn\.v_proj\.v_scale: is missing"),
        (
            lambda t: t.update({f"{ATT.format(0)}.k_proj.k_scale": torch.tensor(-1.0)}),
            r"k_scale: must be finite and > 0",
        ),
        (
            lambda t: t.update({f"{ATT.format(0)}.k_proj.k_scale": torch.tensor(float("nan"))}),
            r"must be finite and > 0",
        ),
        (lambda t: t.update({f"{ATT.format(0)}.k_proj.k_scale": torch.ones(2)}), r"expected torch\.float32 \(\)"),
        (lambda t: t.update({"model.norm.k_proj.k_scale": torch.tensor(1.0)}), r"model\.norm'.*no quantized attention"),
    ],
)
def test_bad_kv_scales_are_refused_and_nothing_changes(fp8_kv, tmp_path, edit, match):
    bad = _rewrite(fp8_kv[1], tmp_path / "bad", edit)
    model = H.tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_hf_checkpoint(model, bad)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_kv_scales_and_the_config_must_agree(fp8_kv, tmp_path):
    d = _rewrite(fp8_kv[1], tmp_path / "noalgo", lambda t: None)
    (d / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": null}}')
    with pytest.raises(ValueError, match=r"k_scale: a KV-cache scale, but kv_cache_quant_algo is null"):
        load_hf_checkpoint(H.tiny_llama(), d)
    drop = [f"{ATT.format(i)}.{kv}_proj.{kv}_scale" for i in range(2) for kv in "kv"]
    d = _rewrite(fp8_kv[1], tmp_path / "nokeys", lambda t: [t.pop(k) for k in drop])
    with pytest.raises(ValueError, match=r"kv_cache_quant_algo: is 'FP8', but the checkpoint has no k_proj\.k_scale"):
        load_hf_checkpoint(H.tiny_llama(), d)


def test_a_scale_no_amax_divides_to_warns(fp8_kv, tmp_path):
    s = next(
        torch.tensor([b], dtype=torch.int32).view(torch.float32)[0]
        for b in range(0x3F99999A, 0x3F99999A + 64)
        if not amax_for_scale(torch.tensor([b], dtype=torch.int32).view(torch.float32)[0], 448.0)[1]
    )
    d = _rewrite(fp8_kv[1], tmp_path / "odd", lambda t: t.update({f"{ATT.format(0)}.k_proj.k_scale": s.clone()}))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        load_hf_checkpoint(H.tiny_llama(), d)
    assert any("is not float32(amax) / 448 for any amax" in str(x.message) for x in w)
