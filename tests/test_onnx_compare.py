"""compare_with_onnxruntime: quantizer-by-quantizer agreement of an export with its torch model, and the module
paths the export gives its Q/DQ nodes (a Sequential's child is ``body.0``, not ``body.body.0``)."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import numpy_helper

import modelopt_lite as mtq
from modelopt_lite.examples import load_digits_data, trained_digits_model
from modelopt_lite.onnx_export import compare_with_onnxruntime, export_onnx


@pytest.fixture(scope="module")
def data():
    return load_digits_data()


def _exported(kind, config, target, data, path):
    q = copy.deepcopy(trained_digits_model(kind, data=data))
    mtq.quantize(q, config, lambda m: [m(b) for b in data.calib_batches(8, 64)])
    q.eval()
    rep = export_onnx(
        q, data.x_test[:4], path, target=target, input_names=["input"], dynamic_axes={"input": {0: "batch"}}
    )
    return q, rep


def test_ort_layout_agrees_everywhere_and_names_are_module_paths(tmp_path, data):
    q, rep = _exported("mlp", mtq.INT8_ORT_CFG, "onnxruntime", data, tmp_path / "m.onnx")
    r = compare_with_onnxruntime(q, tmp_path / "m.onnx", data.x_test)
    names = [row.name for row in r.rows]
    assert names == [
        "body.0.input_quantizer",
        "body.0.output_quantizer",
        "body.2.output_quantizer",
        "head.output_quantizer",
    ]
    assert all(q.get_submodule(n) is not None for n in names)
    assert rep.activations[0]["site"] == "body.0.input_quantizer"
    assert r.first_divergence is None and r.output_max_diff == [0.0] and r.skipped == {}
    assert r.rows[0].input_max_diff == 0.0 and r.rows[1].input_max_diff is None  # Gemm -> Q: fusable, not exposed
    assert r.rows[1].elements == len(data.x_test) * q.body[0].out_features
    text = r.format()
    assert "body.2.output_quantizer" in text and "outputs max |ORT - torch|: 0" in text


def assert_float_rounding_only(report, ulps=1e-5):
    """What a correct export with float ops between its quantizers (ORT's Conv/Gemm summing in another order than
    torch) may show, on any CPU: the quantizers agree up to the first that differs; there the float input already
    differs, by float32 rounding only, and the quantized values move by at most one step, on few elements (values
    within rounding of a boundary). Later quantizers see those steps and may differ more."""
    first = report.first_divergence
    if first is None:
        return
    before = report.rows[: report.rows.index(first)]
    assert all(r.agrees and (r.input_max_diff is None or r.input_max_diff <= ulps) for r in before), report.format()
    assert first.input_max_diff is not None and 0 < first.input_max_diff <= ulps, report.format()
    assert first.max_steps <= 1.0 + 1e-5 and first.differing <= first.elements // 1000, report.format()


def test_a_wrong_scale_in_the_file_shows_as_a_quantizer_whose_input_agrees(tmp_path, data):
    q, _ = _exported("cnn", mtq.INT8_DEFAULT_CFG, "tensorrt", data, tmp_path / "c.onnx")
    m = onnx.load(tmp_path / "c.onnx")
    node = next(n for n in m.graph.node if n.name == "conv2.input_quantizer.Q")
    init = next(t for t in m.graph.initializer if t.name == node.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.01), init.name))
    onnx.save(m, tmp_path / "bad.onnx")
    good = compare_with_onnxruntime(q, tmp_path / "c.onnx", data.x_test)
    bad = compare_with_onnxruntime(q, os.fspath(tmp_path / "bad.onnx"), data.x_test)
    assert [r.name for r in good.rows] == ["conv1.input_quantizer", "conv2.input_quantizer", "fc.input_quantizer"]
    assert good.rows[0].agrees and good.rows[0].input_max_diff == 0.0  # the network input: nothing computed yet
    assert_float_rounding_only(good)  # TensorRT layout: float convs between the quantizers
    first = bad.first_divergence
    assert first.name == "conv2.input_quantizer"
    # the scale error: its input agrees to float rounding, yet many values move (far more than rounding moves)
    assert first.input_max_diff <= 1e-5 and first.differing > max(1000, first.elements // 100) and first.max_steps > 0.5
    assert bad.rows[0].agrees


def test_ort_layout_of_the_cnn_agrees_everywhere_on_every_cpu(tmp_path, data):
    """The onnxruntime layout with 7-bit weights (stored as int8, ORT's u8 x s8 kernels): bit-identical."""
    q, rep = _exported("cnn", mtq.INT8_ORT_REDUCED_RANGE_CFG, "onnxruntime", data, tmp_path / "c.onnx")
    assert {k.split()[1] for k in rep.qdq_counts if "per-channel" in k} == {"INT8", "INT32"}
    r = compare_with_onnxruntime(q, tmp_path / "c.onnx", data.x_test)
    assert r.rows and r.first_divergence is None and r.output_max_diff == [0.0], r.format()


def test_argument_count_is_checked(tmp_path, data):
    q, _ = _exported("mlp", mtq.INT8_DEFAULT_CFG, "tensorrt", data, tmp_path / "m.onnx")
    with pytest.raises(ValueError, match=r"takes 1 input\(s\) \['input'\], got 2 argument"):
        compare_with_onnxruntime(q, tmp_path / "m.onnx", (data.x_test, data.x_test))


@pytest.mark.slow
def test_nested_containers_export_their_module_paths(tmp_path):
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = torch.nn.Sequential(
                torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(8, 8))
            )

        def forward(self, x):
            return self.seq(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Inner()])
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.blocks[0](x))

    torch.manual_seed(0)
    model = Outer()
    x = torch.randn(32, 8)
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    for dynamo in (False, True):
        rep = export_onnx(model.eval(), x[:2], tmp_path / f"n{dynamo}.onnx", dynamo=dynamo)
        sites = sorted(a["site"] for a in rep.activations) + sorted(w["site"] for w in rep.weights)
        assert sites[:3] == [
            "blocks.0.seq.0.input_quantizer",
            "blocks.0.seq.2.0.input_quantizer",
            "head.input_quantizer",
        ], dynamo
        assert all(model.get_submodule(s) is not None for s in sites)
