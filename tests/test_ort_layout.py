"""The exact rewrites of the target="onnxruntime" layout, checked node by node in ONNX Runtime."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper
from onnx_helpers import make_model

from modelopt_lite.onnx_export import ort_layout
from modelopt_lite.onnx_export.ort_runner import ort_session


def _chain(scale_in: float, scale_out: float, zp_in: int = 128, zp_out: int = 128) -> onnx.ModelProto:
    """uint8 codes -> DQ(scale_in, zp_in) -> Relu -> Q(scale_out, zp_out) -> uint8 codes."""
    inits = [
        numpy_helper.from_array(np.float32(scale_in), "s_in"),
        numpy_helper.from_array(np.float32(scale_out), "s_out"),
        numpy_helper.from_array(np.uint8(zp_in), "z_in"),
        numpy_helper.from_array(np.uint8(zp_out), "z_out"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["q", "s_in", "z_in"], ["f"], name="dq"),
        helper.make_node("Relu", ["f"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "s_out", "z_out"], ["y"], name="q_out"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("q", TensorProto.UINT8, [256])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [256])],
        inits,
    )
    return make_model(graph, 17)


CODES = np.arange(256, dtype=np.uint8)


@pytest.mark.parametrize("scale", [0.0371, 1.0, 3.0e-5, 7.5])
def test_relu_between_one_grid_becomes_an_exact_uint8_clip(scale):
    model = _chain(scale, scale)
    want = ort_session(model, optimize=False).run(None, {"q": CODES})[0]
    g = ort_layout.Graph(model)
    assert ort_layout.relu_to_clip(g) == (1, 0)
    out = g.commit()
    assert [n.op_type for n in out.graph.node] == ["Clip"]
    got = ort_session(out, optimize=False).run(None, {"q": CODES})[0]
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    assert np.array_equal(got, np.maximum(CODES, 128))


@pytest.mark.parametrize("scales,zps", [((0.5, 0.25), (128, 128)), ((0.5, 0.5), (128, 0))])
def test_relu_between_two_grids_is_left_alone(scales, zps):
    g = ort_layout.Graph(_chain(*scales, *zps))
    assert ort_layout.relu_to_clip(g) == (0, 1)
    assert [n.op_type for n in g.commit().graph.node] == ["DequantizeLinear", "Relu", "QuantizeLinear"]


def test_bad_ort_weights_value_names_the_choices():
    with pytest.raises(ValueError, match=r"ort_weights must be one of \('auto', 'int8', 'uint8'\), got 'fp8'"):
        ort_layout.resolve_weights("fp8")
    assert [ort_layout.resolve_weights(w) for w in ("auto", "int8", "uint8")] == ["auto", "int8", "uint8"]


# --- weight storage: the file never depends on the exporting CPU ---------------------------------------------------
K, N = 64, 16


def _gemm(codes: np.ndarray, act=np.uint8) -> onnx.ModelProto:
    """uint8 activations (scale 1, zero point 0) x int8 weight codes (scale 1, per output channel), as the layout
    writes them: the float Gemm output is then the exact integer sum (all sums < 2**24)."""
    inits = [
        numpy_helper.from_array(np.float32(1.0), "sx"),
        numpy_helper.from_array(act(0), "zx"),
        numpy_helper.from_array(codes.astype(np.int8), "w"),
        numpy_helper.from_array(np.ones(codes.shape[0], np.float32), "sw"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="in.Q"),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xf"], name="in.DQ"),
        helper.make_node("DequantizeLinear", ["w", "sw"], ["wf"], axis=0, name="w.DQ"),
        helper.make_node("Gemm", ["xf", "wf"], ["y"], transB=1, name="gemm"),
    ]
    graph = helper.make_graph(
        nodes,
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, codes.shape[1]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, codes.shape[0]])],
        inits,
    )
    return make_model(graph, 17)


def _codes(bound: int, seed: int = 0) -> np.ndarray:
    """int8 weight codes in [-bound, bound], both ends present in every row (the worst case for int16 sums)."""
    c = np.random.default_rng(seed).integers(-bound, bound + 1, size=(N, K))
    c[:, 0::4], c[:, 1::4] = bound, -bound
    c[: N // 2] = bound  # half the rows all +bound
    return c


def _weight_types(model: onnx.ModelProto) -> list[int]:
    inits = {t.name: t.data_type for t in model.graph.initializer}
    return [inits[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]


@pytest.mark.parametrize("vnni", [False, True])
def test_layout_does_not_depend_on_the_exporting_cpu(monkeypatch, vnni):
    monkeypatch.setattr(ort_layout, "host_has_vnni", lambda: vnni)
    for weights, wide_type, narrow_type in [
        ("auto", TensorProto.UINT8, TensorProto.INT8),
        ("uint8", TensorProto.UINT8, TensorProto.UINT8),
        ("int8", TensorProto.INT8, TensorProto.INT8),
    ]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wide, _ = ort_layout.apply(_gemm(_codes(127)), weights=weights)
        narrow, _ = ort_layout.apply(_gemm(_codes(64)), weights=weights)
        assert _weight_types(wide) == [wide_type] and _weight_types(narrow) == [narrow_type], weights


def test_auto_weights_are_int8_exactly_within_the_reduced_range():
    assert ort_layout.SAFE_INT8_WEIGHT * 255 * 2 <= 32767 < (ort_layout.SAFE_INT8_WEIGHT + 1) * 255 * 2
    for bound, want in [(64, TensorProto.INT8), (65, TensorProto.UINT8), (63, TensorProto.INT8)]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "auto" never warns
            out, notes = ort_layout.apply(_gemm(_codes(bound)), weights="auto")
        assert _weight_types(out) == [want], bound
        assert ort_layout.wide_int8_weights(out) == []
        kind = "int8" if want == TensorProto.INT8 else "uint8"
        assert any(n.startswith(f"onnxruntime layout (ort_weights='auto'): 1 {kind} weight(s)") for n in notes), notes


def test_int8_weights_beyond_the_reduced_range_warn_and_say_vnni_only():
    with pytest.warns(UserWarning, match=r"1 int8 weight\(s\) with codes beyond \+-64 \(first: 'w'\): exact in ONNX "):
        out, notes = ort_layout.apply(_gemm(_codes(127)), weights="int8")
    assert ort_layout.wide_int8_weights(out) == ["w"]
    assert any("exact only on CPUs with VNNI or AMX" in n for n in notes), notes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 7-bit codes stored as int8: exact everywhere, no warning
        _, notes = ort_layout.apply(_gemm(_codes(64)), weights="int8")
    assert any("codes within +-64: exact on every CPU" in n for n in notes), notes


def _fused_output(model: onnx.ModelProto, x: np.ndarray, tmp_path, **kw) -> tuple[np.ndarray, list[str]]:
    opt = str(tmp_path / "opt.onnx")
    y = ort_session(model, optimized_model_path=opt, **kw).run(None, {"x": x})[0]
    return y, [n.op_type for n in onnx.load(opt).graph.node]


@pytest.mark.parametrize("bound", [64, 127])
def test_int8_weights_in_orts_fused_kernel(tmp_path, bound):
    """ORT's u8 x s8 kernel on the worst case (activations 255, weights +-bound): exact for 7-bit codes on every
    CPU; for full-range codes only on CPUs with VNNI/AMX (without, ``vpmaddubsw`` saturates int16 pair sums)."""
    codes = _codes(bound)
    x = np.full((8, K), 255.0, np.float32)
    x[4:] = np.random.default_rng(1).integers(0, 256, size=(4, K))
    want = (x.astype(np.int64) @ codes.T.astype(np.int64)).astype(np.float32)  # |sums| < 2**24: exact in float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = ort_layout.apply(_gemm(codes), weights="int8")
    got, ops = _fused_output(model, x, tmp_path, exact=False)  # every fusion on, whatever the weights
    assert "DequantizeLinear" not in ops[ops.index("QuantizeLinear") :], ops  # the weight DQ was fused away
    assert got.dtype == np.float32 and got.shape == want.shape  # the fused kernel ran on every CPU
    assert np.array_equal(got, np.rint(got)) and np.abs(got).max() <= 255 * bound * K  # integer sums, in range
    if bound <= ort_layout.SAFE_INT8_WEIGHT or ort_layout.host_has_vnni():  # elsewhere int16 pair sums may saturate
        np.testing.assert_array_equal(got, want)
    unfused, _ = _fused_output(model, x, tmp_path, optimize=False)
    np.testing.assert_array_equal(unfused, want)  # the graph as written: exact float sums of integers


@pytest.mark.parametrize("vnni", [False, True])
def test_ort_session_keeps_the_int8_fusions_only_where_exact(monkeypatch, vnni):
    from modelopt_lite.onnx_export import ort_runner

    monkeypatch.setattr(ort_runner, "host_has_vnni", lambda: vnni)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wide, _ = ort_layout.apply(_gemm(_codes(127)), weights="int8")
    narrow, _ = ort_layout.apply(_gemm(_codes(64)), weights="auto")
    uint8, _ = ort_layout.apply(_gemm(_codes(127)), weights="auto")

    def disabled(model, **kw):
        opts = ort_session(model, **kw).get_session_options()
        try:
            return opts.get_session_config_entry("session.disable_quant_qdq") == "1"
        except RuntimeError:  # never set
            return False

    assert disabled(wide) is not vnni  # full-range int8 weights: fused only where VNNI makes them exact
    assert not disabled(narrow) and not disabled(uint8)  # exact on every CPU: always fused
    assert not disabled(wide, exact=False)
    assert disabled(_gemm(_codes(127), act=np.int8))  # TensorRT-style: int8 activations and weights, not fused
    assert not disabled(_gemm(_codes(127), act=np.int8), exact=False)
