"""``FP8_AFFINE_KV_CFG`` / ``NVFP4_AFFINE_KV_CFG`` (ModelOpt 0.47's names and content) on tiny Hugging Face decoders
built from a config (no downloads): the K/V attention sees at every generate() step, save/restore of the bias,
ONNX export as ``Sub -> QuantizeLinear -> DequantizeLinear -> Add``, and ModelOpt's list form of the presets."""

import copy
import json

import numpy as np
import onnx
import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.conversion.utils import named_quantizers
from modelopt_lite.functional import microscaling, reference
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.onnx_export.ort_runner import ort_session
from modelopt_lite.presets import PRESETS
from modelopt_lite.presets.kv import KV_PATTERN, with_kv_cache

transformers = pytest.importorskip("transformers")
from decoder_helpers import generate_new as _generate  # noqa: E402
from decoder_helpers import kv_quantizers as _kv_quantizers  # noqa: E402
from decoder_helpers import prompt as _prompt
from decoder_helpers import tiny_decoder
from state_files import edit_saved_tensors


def _decoder(arch: str, attn: str = "eager", seed: int = 0):
    return tiny_decoder(arch, attn, seed, llama_hidden=32)  # head_dim 16: one NVFP4 block


KV_BIAS = {-2: None, -4: None, "type": "static"}


def _ref(q, x):
    """fq(x - b) + b by the reference numerics, with q's calibrated bias and per-tensor amax."""
    b, amax = q.bias_value, q.amax.float().reshape(())
    if q.num_bits == (2, 1):
        return microscaling.fake_nvfp4(x - b, microscaling.nvfp4_global_scale(amax), 16) + b
    return reference.fake_e4m3(x - b, amax / 448.0) + b


def _record_kv(model, prompt):
    kv = _kv_quantizers(model)
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
    return tokens, calls


# --- presets ---------------------------------------------------------------------------------------------------------
def test_affine_presets_content():
    assert mtq.FP8_AFFINE_KV_CFG["quant_cfg"][KV_PATTERN] == {
        "num_bits": (4, 3),
        "axis": None,
        "bias": KV_BIAS,
        "enable": True,
    }
    nv = mtq.NVFP4_AFFINE_KV_CFG["quant_cfg"][KV_PATTERN]
    assert nv["bias"] == KV_BIAS and nv["num_bits"] == (2, 1) and nv["block_sizes"]["type"] == "dynamic"
    for name in ("FP8_AFFINE_KV_CFG", "NVFP4_AFFINE_KV_CFG"):
        assert PRESETS[name] is getattr(mtq, name) is getattr(mtq.conversion, name)
        assert PRESETS[name]["quant_cfg"]["default"] == {"enable": False} and PRESETS[name]["algorithm"] == "max"
    merged = with_kv_cache(mtq.FP8_DEFAULT_CFG, mtq.FP8_AFFINE_KV_CFG)
    assert merged["quant_cfg"][KV_PATTERN]["bias"] == KV_BIAS


def test_affine_presets_match_modelopt():
    peer = pytest.importorskip("modelopt.torch.quantization")
    for name in ("FP8_AFFINE_KV_CFG", "NVFP4_AFFINE_KV_CFG"):
        entries = peer.__dict__[name]["quant_cfg"]
        assert all(e["quantizer_name"] == KV_PATTERN for e in entries)
        last = entries[-1]["cfg"]  # the later entry wins: the format with the bias
        ours = {k: v for k, v in getattr(mtq, name)["quant_cfg"][KV_PATTERN].items() if k != "enable"}
        assert last["bias"] == ours["bias"] == KV_BIAS
        assert tuple(last["num_bits"]) == ours["num_bits"]


# --- generate() ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, attn, preset",
    [
        ("gpt2", "eager", "FP8_AFFINE_KV_CFG"),
        ("llama", "sdpa", "FP8_AFFINE_KV_CFG"),
        ("llama", "eager", "NVFP4_AFFINE_KV_CFG"),
    ],
)
def test_generate_sees_reference_affine_kv_at_every_step(arch, attn, preset):
    model = _decoder(arch, attn)
    prompt = _prompt()
    calib_inputs: dict[str, torch.Tensor] = {}

    def loop(m):  # records what each K/V quantizer sees during calibration
        hooks = [
            q.register_forward_hook(lambda mod, i, o, n=n: calib_inputs.update({n: i[0].detach().clone()}))
            for n, q in _kv_quantizers(m).items()
        ]
        try:
            m(prompt)
        finally:
            for h in hooks:
                h.remove()

    assert mtq.quantize(model, PRESETS[preset], loop) is model
    kv = _kv_quantizers(model)
    assert {n for n, q in named_quantizers(model) if q.is_enabled} == set(kv) and len(kv) == 4
    # the calibrated bias is the mean over batch and sequence of what the quantizer saw: per head and channel
    for n, q in kv.items():
        x = calib_inputs[n]
        assert q.bias_value.shape == (1, x.shape[1], 1, x.shape[3])
        assert torch.equal(q.bias_value, x.float().mean(dim=(0, 2), keepdim=True)), n
        assert torch.equal(q.amax, (x - q.bias_value).abs().amax()), n
    tokens, calls = _record_kv(model, prompt)
    assert tokens.shape == (2, 4)
    for n, seen in calls.items():
        assert len(seen) == 4, n
        for step, (x, y) in enumerate(seen):
            assert y.dtype == x.dtype == torch.float32
            assert torch.equal(y, _ref(kv[n], x)), (n, step)
        assert any(not torch.equal(x, y) for x, y in seen), n
        for (x0, y0), (x1, y1) in zip(seen, seen[1:], strict=False):  # the cached part is seen as before
            axis = next(d for d in range(x1.dim()) if x1.shape[d] != x0.shape[d])
            assert torch.equal(x1.narrow(axis, 0, x0.shape[axis]), x0)
            assert torch.equal(y1.narrow(axis, 0, y0.shape[axis]), y0)
    with torch.no_grad():
        assert torch.equal(_generate(model, prompt), tokens)


# --- save / restore ----------------------------------------------------------------------------------------------------
def _quantized_gpt2():
    model = _decoder("gpt2")
    prompt = _prompt()
    mtq.quantize(model, mtq.FP8_AFFINE_KV_CFG, lambda m: m(prompt))
    return model, prompt


def test_affine_kv_saved_and_restored(tmp_path):
    model, prompt = _quantized_gpt2()
    js, _ = mtq.save(model, tmp_path / "kv")
    rec = json.loads(js.read_text())["quantizers"]["transformer.h.0.attn.k_bmm_quantizer"]
    assert "_bias_value" in rec["tensors"] and rec["bias"] is not None
    restored = mtq.restore(_decoder("gpt2"), tmp_path / "kv")
    ours, theirs = _kv_quantizers(model), _kv_quantizers(restored)
    for n in ours:
        assert theirs[n].bias == ours[n].bias == {**KV_BIAS, "method": "mean"}
        assert torch.equal(theirs[n].bias_value, ours[n].bias_value) and torch.equal(theirs[n].amax, ours[n].amax)
    with torch.no_grad():
        assert torch.equal(_generate(restored, prompt), _generate(model, prompt))


def _corrupt_tensor(tmp_path, key, value):
    edit_saved_tensors(tmp_path / "kv.safetensors", lambda t: t.__setitem__(key, value))


def test_corrupted_bias_in_saved_files_is_rejected(tmp_path):
    model, _ = _quantized_gpt2()
    key = "transformer.h.1.attn.v_bmm_quantizer._bias_value"
    mtq.save(model, tmp_path / "kv")
    good = model.transformer.h[1].attn.v_bmm_quantizer.bias_value
    nan = good.clone()
    nan[0, 1, 0, 3] = float("nan")
    _corrupt_tensor(tmp_path, key, nan)
    with pytest.raises(ValueError, match=rf"restore: .*kv.safetensors: {key}: must be finite, got nan"):
        mtq.restore(_decoder("gpt2"), tmp_path / "kv")
    _corrupt_tensor(tmp_path, key, torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match=rf"{key}: shape \(1, 2, 3, 8\) does not fit: the reduced dimension"):
        mtq.restore(_decoder("gpt2"), tmp_path / "kv")
    _corrupt_tensor(tmp_path, key, good.double())
    with pytest.raises(ValueError, match=rf"{key}: must be float32, got torch.float64"):
        mtq.restore(_decoder("gpt2"), tmp_path / "kv")

    mtq.save(model, tmp_path / "kv")
    js = tmp_path / "kv.json"
    doc = json.loads(js.read_text())
    entry = doc["quantizers"]["transformer.h.1.attn.v_bmm_quantizer"]
    entry["bias"] = {"__dict__": [[-2, None], ["type", "weekly"]]}
    js.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"v_bmm_quantizer'\]\.bias: .*bias type must be one of .*'weekly'"):
        mtq.restore(_decoder("gpt2"), tmp_path / "kv")
    entry["bias"] = None  # the tensor is still listed, but the quantizer now has no bias
    js.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=rf"{key}: shape \(1, 2, 1, 8\) does not fit: the quantizer has no bias"):
        mtq.restore(_decoder("gpt2"), tmp_path / "kv")


# --- ONNX export -----------------------------------------------------------------------------------------------------
class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=pos, use_cache=False).logits


def _producer(g, name):
    return next(n for n in g.node if name in n.output)


def test_affine_kv_exports_sub_qdq_add(tmp_path):
    model, prompt = _quantized_gpt2()
    path = tmp_path / "gpt2_affine.onnx"
    mtq.export_onnx(_Logits(model), prompt, path)
    g = onnx.load(path).graph
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    qs = [n for n in g.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == 4
    biases = sorted(q.bias_value.flatten().tolist() for q in _kv_quantizers(model).values())
    found = []
    for q in qs:
        sub = _producer(g, q.input[0])
        assert sub.op_type == "Sub"
        dq = next(n for n in g.node if n.op_type == "DequantizeLinear" and q.output[0] in n.input)
        add = next(n for n in g.node if n.op_type == "Add" and dq.output[0] in n.input)
        assert sub.input[1] == add.input[1] and sub.input[1] in inits  # the same bias initializer both sides
        b = inits[sub.input[1]]
        assert b.dtype == np.float32 and b.shape == (1, 2, 1, 8)
        found.append(b.flatten().tolist())
    assert sorted(found) == biases
    with torch.no_grad():
        expected = _Logits(model)(prompt)
    got = torch.from_numpy(ort_session(path).run(None, {"input": prompt.numpy()})[0])
    assert torch.allclose(got, expected, atol=1e-4)


class _OneQuantizer(torch.nn.Module):
    def __init__(self, q):
        super().__init__()
        self.q = q

    def forward(self, x):
        return self.q(x)


@pytest.mark.parametrize(
    "num_bits, target, dynamo",
    [
        ((4, 3), "onnxruntime", False),
        ((4, 3), "tensorrt", False),
        (8, "onnxruntime", False),
        ((4, 3), "tensorrt", True),
    ],
)
def test_quantizer_output_bit_exact_in_ort(tmp_path, num_bits, target, dynamo):
    q = TensorQuantizer(name="kq")
    q.set_from_attribute_config({"num_bits": num_bits, "axis": None, "bias": dict(KV_BIAS)})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 6, 8, generator=g) * 2 + torch.linspace(-5, 30, 8)
    with mtq.calibrate(q, "max"):
        q(x)
    x = torch.randn(4, 3, 11, 8, generator=g) * 3 + torch.linspace(-5, 30, 8)  # also outside the calibrated range
    m = _OneQuantizer(q)
    path = tmp_path / "q.onnx"
    mtq.export_onnx(m, x, path, target=target, dynamo=dynamo)
    g = onnx.load(path).graph
    assert [n.op_type for n in g.node] == ["Sub", "QuantizeLinear", "DequantizeLinear", "Add"]
    sub, add = g.node[0], g.node[3]
    assert sub.input[0] == g.input[0].name and add.input[0] == g.node[2].output[0] and sub.input[1] == add.input[1]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    assert torch.equal(torch.from_numpy(inits[sub.input[1]].copy()), q.bias_value)
    with torch.no_grad():
        want = m(x)
    got = torch.from_numpy(ort_session(path).run(None, {g.input[0].name: x.numpy()})[0])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if num_bits == (4, 3):
        assert torch.equal(want, _ref(q, x))


def test_uncalibrated_static_bias_is_not_exported(tmp_path):
    q = TensorQuantizer(name="kq")
    q.set_from_attribute_config({"num_bits": (4, 3), "axis": None, "bias": dict(KV_BIAS)})
    q.amax = 2.0
    with pytest.raises(ValueError, match=r"cannot export: 1 quantizer\(s\) with an uncalibrated static affine bias"):
        mtq.export_onnx(_OneQuantizer(q), torch.randn(1, 2, 3, 4), tmp_path / "x.onnx")


# --- ModelOpt's list form, and the peer itself --------------------------------------------------------------------------
def test_modelopt_list_form_equals_ours():
    peer = pytest.importorskip("modelopt.torch.quantization")
    prompt = _prompt()
    for name in ("FP8_AFFINE_KV_CFG", "NVFP4_AFFINE_KV_CFG"):
        listed = copy.deepcopy(peer.__dict__[name])
        assert isinstance(listed["quant_cfg"], list)
        # ModelOpt's KV presets carry no "disable everything else" entry: merge them like ours
        listed["quant_cfg"] = [{"quantizer_name": "*", "enable": False}, *listed["quant_cfg"]]
        listed["algorithm"] = "max"
        a = mtq.quantize(_decoder("gpt2"), listed, lambda m: m(prompt))
        b = mtq.quantize(_decoder("gpt2"), getattr(mtq, name), lambda m: m(prompt))
        qa, qb = _kv_quantizers(a), _kv_quantizers(b)
        for n in qb:
            assert qa[n].bias == qb[n].bias and torch.equal(qa[n].bias_value, qb[n].bias_value), (name, n)
            assert torch.equal(qa[n].amax, qb[n].amax)
        with torch.no_grad():
            assert torch.equal(a(prompt).logits, b(prompt).logits), name


def test_peer_gpt2_affine_kv_on_cpu():
    """ModelOpt 0.47 runs FP8_AFFINE_KV_CFG on CPU (with an explicit "algorithm": "max"; without one its KV-only
    preset leaves the bias uncalibrated and the forward fails). Its per-head bias and amax equal ours to float32
    rounding: its quantized attention computes K and V with its own projection, so they differ by ulps."""
    peer = pytest.importorskip("modelopt.torch.quantization")
    prompt = _prompt()
    ours = mtq.quantize(_decoder("gpt2"), mtq.FP8_AFFINE_KV_CFG, lambda m: m(prompt))
    cfg = copy.deepcopy(peer.FP8_AFFINE_KV_CFG)
    cfg["algorithm"] = "max"
    theirs = _decoder("gpt2")
    peer.quantize(theirs, cfg, lambda m: m(prompt))
    tq = {n: m for n, m in theirs.named_modules() if n.endswith(("k_bmm_quantizer", "v_bmm_quantizer"))}
    for n, q in _kv_quantizers(ours).items():
        assert tq[n]._bias_value.shape == q.bias_value.shape == (1, 2, 1, 8)
        assert torch.allclose(tq[n]._bias_value, q.bias_value, rtol=0, atol=1e-6), n
        assert torch.allclose(tq[n]._amax.float(), q.amax, rtol=1e-5, atol=0), n


def test_dynamic_max_min_bias_exports_bit_exact(tmp_path):
    """A dynamic bias is computed in the graph (ReduceMax/ReduceMin/Add/Div: exact, so ORT equals torch)."""
    q = TensorQuantizer(name="kq")
    q.set_from_attribute_config(
        {"num_bits": (4, 3), "axis": None, "bias": {-2: None, -4: None, "type": "dynamic", "method": "max_min"}}
    )
    q.amax = 6.0
    x = torch.randn(3, 2, 9, 8, generator=torch.Generator().manual_seed(4)) * 2 + torch.linspace(-5, 30, 8)
    path = tmp_path / "dyn.onnx"
    rep = mtq.export_onnx(_OneQuantizer(q), x, path)
    assert any("dynamic affine bias" in n for n in rep.notes)
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert {"ReduceMax", "ReduceMin", "Sub", "QuantizeLinear", "DequantizeLinear", "Add"} <= set(ops)
    with torch.no_grad():
        want = q(x)
    got = torch.from_numpy(ort_session(path).run(None, {"input": x.numpy()})[0])
    assert torch.equal(got, want)
