"""inspect_onnx's TensorRT-readiness section: per fusion pattern whether Q/DQ sits where TensorRT needs it, and the
float ops left, on small hand-built graphs with and without Q/DQ and on exported models; shown by the CLI."""

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_helpers import make_model
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.cli import main
from modelopt_lite.nn import ResidualAdd
from modelopt_lite.onnx_export.trt_readiness import check_readiness

F32, I8 = TensorProto.FLOAT, TensorProto.INT8


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F32, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, F32, None) for n in outputs],
        inits,
    )
    return make_model(g, 17, ort=False)


def _qdq(x, tag):
    """Q -> DQ of a run-time tensor with a shared scalar scale."""
    return [
        helper.make_node("QuantizeLinear", [x, "s", "z"], [f"{tag}_q"], name=f"{tag}_Q"),
        helper.make_node("DequantizeLinear", [f"{tag}_q", "s", "z"], [f"{tag}_dq"], name=f"{tag}_DQ"),
    ]


def _common():
    return [_init("s", np.float32(0.05)), _init("z", np.int8(0))]


def _wdq(name, shape, axis=0):
    """An int8 weight initializer and its DequantizeLinear (per channel on ``axis``)."""
    codes = np.arange(np.prod(shape), dtype=np.int64).reshape(shape) % 50 - 25
    inits = [_init(f"{name}_c", codes.astype(np.int8)), _init(f"{name}_s", np.full(shape[axis], 0.01, np.float32))]
    return inits, helper.make_node("DequantizeLinear", [f"{name}_c", f"{name}_s"], [f"{name}_w"], axis=axis, name=name)


def _status(rep, pattern):
    return sorted(c.status for c in rep.by_pattern(pattern))


# --- attention MatMuls -----------------------------------------------------------------------------------------------
def _attention(quantize_probs: bool, quantize_qk: bool = True):
    nodes, inits = [], _common()
    q, k = ("q_dq", "k_dq") if quantize_qk else ("q", "k")
    if quantize_qk:
        nodes += _qdq("q", "q") + _qdq("k", "k")
    nodes += [
        helper.make_node("Transpose", [k], ["kt"], perm=[0, 2, 1], name="T"),
        helper.make_node("MatMul", [q, "kt"], ["scores"], name="QK"),
        helper.make_node("Add", ["scores", "mask"], ["masked"], name="MaskAdd"),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1, name="Softmax"),
    ]
    nodes += _qdq("v", "v")
    probs = "p"
    if quantize_probs:
        nodes += _qdq("p", "p")
        probs = "p_dq"
    nodes.append(helper.make_node("MatMul", [probs, "v_dq"], ["out"], name="PV"))
    ins = [("q", [1, 4, 8]), ("k", [1, 4, 8]), ("v", [1, 4, 8]), ("mask", [1, 4, 4])]
    return _model(nodes, ins, ["out"], inits)


def test_attention_matmuls_need_both_inputs_quantized():
    rep = check_readiness(_attention(quantize_probs=True))
    assert _status(rep, "attention MatMul") == ["ready", "ready"]
    assert rep.by_pattern("residual Add") == []  # the mask Add feeds the Softmax: not a residual add
    assert rep.float_ops == {"Add": 1, "Softmax": 1}
    rep = check_readiness(_attention(quantize_probs=False))
    (pv,) = [c for c in rep.checks if c.node == "MatMul 'PV'"]
    assert pv.status == "missing" and pv.detail == "no Q/DQ on input 0 (p)" and not rep.ready
    assert rep.float_ops == {"Add": 1, "MatMul": 1, "Softmax": 1}
    rep = check_readiness(_attention(quantize_probs=True, quantize_qk=False))
    (qk,) = [c for c in rep.checks if c.node == "MatMul 'QK'"]
    assert qk.detail == "no Q/DQ on input 0 (q), input 1 (kt)"


# --- GEMM / MatMul with weights --------------------------------------------------------------------------------------
def test_gemm_with_weights_ready_weight_only_and_missing():
    inits, wdq = _wdq("w1", [8, 6], axis=1)
    inits2, wdq2 = _wdq("w2", [6, 4], axis=0)
    nodes = [
        *_qdq("x", "x"),
        wdq,
        helper.make_node("MatMul", ["x_dq", "w1_w"], ["h"], name="fc1"),  # W8A8: ready
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),  # bias add: fused epilogue
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),  # activation: fused epilogue
        wdq2,
        helper.make_node("Gemm", ["r", "w2_w"], ["y"], name="fc2"),  # weight DQ, float activation: weight-only
        helper.make_node("MatMul", ["y", "w3"], ["out"], name="fc3"),  # float weight: missing
    ]
    inits += inits2 + _common() + [_init("b1", np.zeros(6, np.float32)), _init("w3", np.ones((4, 2), np.float32))]
    rep = check_readiness(_model(nodes, [("x", [3, 8])], ["out"], inits))
    by = {c.node: c for c in rep.checks}
    assert by["MatMul 'fc1'"].status == "ready" and by["MatMul 'fc1'"].pattern == "GEMM/MatMul with weights"
    assert by["Gemm 'fc2'"].status == "weight-only" and "input 0 (r) in float" in by["Gemm 'fc2'"].detail
    assert by["MatMul 'fc3'"].status == "missing"
    assert by["MatMul 'fc3'"].detail == "weight (input 1, w3) has no DequantizeLinear; input 0 (y) has no Q/DQ"
    assert rep.by_pattern("attention MatMul") == [] and rep.by_pattern("residual Add") == []
    assert rep.float_ops == {"MatMul": 1}  # bias Add and Relu fuse into fc1, fc2 is weight-only
    text = "\n".join(rep.format())
    assert "GEMM/MatMul with weights: 2 of 3 in place (1 ready, 1 weight-only, 1 missing)" in text
    assert "float ops left: MatMul 1" in text


def test_a_slice_of_a_dequantized_weight_is_a_weight():
    """nn.MultiheadAttention's cross-attention: the packed in-projection weight is dequantized once, then split into
    its Q/K/V rows: each MatMul still reads a dequantized weight; a slice with run-time bounds is not a weight."""
    inits, wdq = _wdq("w", [8, 12], axis=1)
    inits += _common() + [_init(n, np.array([v], np.int64)) for n, v in (("s0", 0), ("s1", 4), ("ax", 1))]
    nodes = [
        *_qdq("x", "x"),
        wdq,
        helper.make_node("Slice", ["w_w", "s0", "s1", "ax"], ["wq"], name="slice"),
        helper.make_node("MatMul", ["x_dq", "wq"], ["y"], name="fc"),
        helper.make_node("Slice", ["w_w", "s0", "n", "ax"], ["wr"], name="dyn_slice"),
        helper.make_node("MatMul", ["x_dq", "wr"], ["z"], name="fc_dyn"),
    ]
    model = _model(nodes, [("x", [3, 8])], ["y", "z"], inits)
    model.graph.input.append(helper.make_tensor_value_info("n", TensorProto.INT64, [1]))
    rep = check_readiness(model)
    by = {c.node: c for c in rep.checks}
    assert (by["MatMul 'fc'"].pattern, by["MatMul 'fc'"].status) == ("GEMM/MatMul with weights", "ready")
    assert (by["MatMul 'fc_dyn'"].pattern, by["MatMul 'fc_dyn'"].status) == ("attention MatMul", "missing")
    from modelopt_lite.onnx_export import attention_matmuls

    assert [m.name for m in attention_matmuls(model)] == ["fc_dyn"]


def test_shape_arithmetic_and_data_movement_are_not_float_ops():
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"], name="shape"),
        helper.make_node("Mul", ["shp", "two"], ["shp2"], name="int_mul"),  # int64 shape arithmetic
        helper.make_node("Reshape", ["x", "shp"], ["xr"], name="reshape"),
        helper.make_node("Transpose", ["xr"], ["xt"], perm=[1, 0], name="tr"),
        helper.make_node("Sigmoid", ["xt"], ["out"], name="sig"),
    ]
    rep = check_readiness(_model(nodes, [("x", [3, 4])], ["out"], [_init("two", np.array([2, 1], np.int64))]))
    assert rep.checks == [] and rep.float_ops == {"Sigmoid": 1}
    assert rep.format()[1:] == ["  (no Conv, GEMM, MatMul or residual Add)", "  float ops left: Sigmoid 1"]


# --- Conv and residual Add -------------------------------------------------------------------------------------------
def _conv_block(skip: str):
    """Conv -> BatchNormalization -> Add(., skip) -> Relu, with skip 'float', 'qdq' or 'both' (conv output too)."""
    inits, wdq = _wdq("cw", [2, 2, 1, 1])
    inits += _common() + [_init(n, np.ones(2, np.float32)) for n in ("g", "b", "m", "v")]
    nodes = [
        *_qdq("x", "x"),
        wdq,
        helper.make_node("Conv", ["x_dq", "cw_w"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"], name="bn"),
    ]
    main = "bn"
    if skip == "both":
        nodes += _qdq("bn", "bn")
        main = "bn_dq"
    nodes += [
        helper.make_node("Add", [main, "x" if skip == "float" else "x_dq"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["out"], name="relu"),
    ]
    return _model(nodes, [("x", [1, 2, 3, 3])], ["out"], inits)


def test_residual_add_fused_when_the_skip_branch_is_quantized():
    rep = check_readiness(_conv_block("qdq"))
    (add,) = rep.by_pattern("residual Add")
    assert add.status == "fused" and add.detail == "fused into Conv 'conv' (skip branch quantized)"
    assert _status(rep, "Conv") == ["ready"] and rep.ready and rep.float_ops == {}
    info = mtq.inspect_onnx(_conv_block("qdq"))
    assert info.unquantized == [] and info.quantized_ops == info.compute_ops == 2
    assert info.tensorrt is not None and info.tensorrt.ready


def test_residual_add_without_qdq_and_with_a_requantized_conv_output():
    rep = check_readiness(_conv_block("float"))
    (add,) = rep.by_pattern("residual Add")
    assert add.status == "missing" and "skip input 1 (x)" in add.detail
    assert rep.float_ops == {"Add": 1, "Relu": 1}  # the Conv (and its BatchNormalization) are quantized
    rep = check_readiness(_conv_block("both"))
    (add,) = rep.by_pattern("residual Add")
    assert add.status == "ready" and "Conv 'conv''s output is re-quantized" in add.detail
    assert rep.float_ops == {}


def test_float_model_everything_missing():
    inits = [_init("cw", np.ones((2, 2, 1, 1), np.float32))] + [
        _init(n, np.ones(2, np.float32)) for n in ("g", "b", "m", "v")
    ]
    nodes = [
        helper.make_node("Conv", ["x", "cw"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"], name="bn"),
        helper.make_node("Add", ["bn", "x"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["out"], name="relu"),
    ]
    rep = check_readiness(_model(nodes, [("x", [1, 2, 3, 3])], ["out"], inits))
    (conv,) = rep.by_pattern("Conv")
    assert conv.status == "missing"
    assert conv.detail == "weight (input 1, cw) has no DequantizeLinear; input 0 (x) has no Q/DQ"
    assert _status(rep, "residual Add") == ["missing"]
    assert rep.float_ops == {"Add": 1, "BatchNormalization": 1, "Conv": 1, "Relu": 1}


# --- exported models and the CLI ------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, residual_module: bool):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)
        self.add = ResidualAdd() if residual_module else None

    def forward(self, x):
        y = self.conv2(torch.relu(self.conv1(x)))
        return torch.relu(self.add(y, x) if self.add is not None else y + x)


def test_exported_blocks_with_and_without_residual_add_module(tmp_path, capsys):
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    paths = {}
    for residual in (True, False):
        torch.manual_seed(0)
        m = _Block(residual).eval()
        mtq.quantize(m, mtq.INT8_DEFAULT_CFG, lambda mm: mm(x))
        paths[residual] = tmp_path / f"b{int(residual)}.onnx"
        mtq.export_onnx(m, x, paths[residual])
    good, bad = (mtq.inspect_onnx(paths[k]).tensorrt for k in (True, False))
    assert good.ready and _status(good, "Conv") == ["ready", "ready"] and _status(good, "residual Add") == ["fused"]
    assert good.float_ops == {}
    assert not bad.ready and _status(bad, "residual Add") == ["missing"] and bad.float_ops == {"Add": 1, "Relu": 1}
    assert main(["inspect", str(paths[False])]) == 0
    out = capsys.readouterr().out
    assert "TensorRT readiness (Q/DQ where TensorRT's fusions need it):" in out
    assert "  Conv: 2 of 2 in place (2 ready)" in out
    assert "  residual Add: 0 of 1 in place (1 missing)" in out
    assert "  float ops left: Add 1, Relu 1" in out
    assert "TensorRT readiness" not in mtq.inspect_onnx(paths[True]).format(tensorrt=False)


def test_an_elementwise_function_of_one_layer_output_is_not_a_residual_add():
    """GELU (tanh form) adds ``x`` and ``c * x**3`` of the same GEMM output: no residual, and a real residual Add
    after it is still found."""
    inits, wdq = _wdq("w", [4, 4], axis=1)
    inits += _common() + [_init("c", np.float32(0.044715)), _init("three", np.float32(3.0))]
    nodes = [
        *_qdq("x", "x"),
        wdq,
        helper.make_node("MatMul", ["x_dq", "w_w"], ["h"], name="fc"),
        helper.make_node("Pow", ["h", "three"], ["h3"], name="pow"),
        helper.make_node("Mul", ["h3", "c"], ["ch3"], name="mul"),
        helper.make_node("Add", ["h", "ch3"], ["inner"], name="gelu_add"),
        helper.make_node("Tanh", ["inner"], ["t"], name="tanh"),
        helper.make_node("MatMul", ["t", "w_w"], ["h2"], name="fc2"),
        helper.make_node("Add", ["h2", "x"], ["out"], name="residual"),
    ]
    rep = check_readiness(_model(nodes, [("x", [2, 4])], ["out"], inits))
    assert [c.node for c in rep.by_pattern("residual Add")] == ["Add 'residual'"]
    assert rep.float_ops == {"Add": 2, "Mul": 1, "Pow": 1, "Tanh": 1}
