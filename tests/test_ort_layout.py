"""The exact rewrites of the target="onnxruntime" layout, checked node by node in ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper

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
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


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
    assert ort_layout.resolve_weights("uint8") == "uint8"
    assert ort_layout.resolve_weights("auto") == ("int8" if ort_layout.host_has_vnni() else "uint8")
