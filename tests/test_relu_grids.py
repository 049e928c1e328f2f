"""share_relu_grids: one grid across a ReLU, so ORT runs DQ -> Relu -> Q as a uint8 Clip, with torch == ORT."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.examples import MLP


class FunctionalRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _calibrated(model, cfg=None):
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randn(32, model.body[0].in_features if hasattr(model, "body") else 8, generator=gen) * 2 for _ in range(3)
    ]

    def loop(m):
        for b in batches:
            m(b)

    q = copy.deepcopy(model).eval()
    mtq.quantize(q, cfg or mtq.INT8_ORT_CFG, loop)
    return q, loop, batches


def test_pairs_found_and_grids_shared():
    torch.manual_seed(0)
    q, loop, _ = _calibrated(MLP(8, 16, 4, depth=2))
    before = {n: m.input_quantizer.amax.clone() for n, m in [("body.2", q.body[2]), ("head", q.head)]}
    pairs = mtq.share_relu_grids(q, loop)
    assert pairs == [
        ("body.0.output_quantizer", "body.2.input_quantizer"),
        ("body.2.output_quantizer", "head.input_quantizer"),
    ]
    assert torch.equal(q.body[2].input_quantizer.amax, q.body[0].output_quantizer.amax)
    assert torch.equal(q.head.input_quantizer.amax, q.body[2].output_quantizer.amax)
    # the consumer's grid only grows: max|y| >= max(relu(y))
    assert q.body[2].input_quantizer.amax.item() >= before["body.2"].item()
    assert q.head.input_quantizer.amax.item() >= before["head"].item()


def test_consumer_becomes_an_identity_in_torch():
    torch.manual_seed(1)
    q, loop, batches = _calibrated(MLP(8, 16, 4, depth=1))
    mtq.share_relu_grids(q, loop)
    y = q.body[0](batches[0])  # Linear with its output quantizer
    r = torch.relu(y)
    assert torch.equal(q.head.input_quantizer(r), r)


def test_inplace_relu_is_followed_and_functional_relu_is_not():
    torch.manual_seed(2)
    m = MLP(8, 16, 4, depth=1)
    m.body[1] = nn.ReLU(inplace=True)
    q, loop, _ = _calibrated(m)
    assert mtq.share_relu_grids(q, loop) == [("body.0.output_quantizer", "head.input_quantizer")]
    f, floop, _ = _calibrated(FunctionalRelu())
    assert mtq.share_relu_grids(f, floop) == []


def test_mismatched_quantizers_are_left_alone():
    torch.manual_seed(3)
    cfg = copy.deepcopy(mtq.INT8_ORT_CFG)
    cfg["quant_cfg"]["head.input_quantizer"] = {"num_bits": 7}
    q, loop, _ = _calibrated(MLP(8, 16, 4, depth=1), cfg)
    amax = q.head.input_quantizer.amax.clone()
    assert mtq.share_relu_grids(q, loop) == []
    assert torch.equal(q.head.input_quantizer.amax, amax)


def test_exported_graph_runs_clips_and_matches_torch(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnx

    from modelopt_lite.onnx_export.ort_runner import ort_session

    torch.manual_seed(4)
    q, loop, batches = _calibrated(MLP(8, 16, 4, depth=2))
    rep = mtq.export_onnx(q, batches[0], tmp_path / "before.onnx", target="onnxruntime")
    ops = [n.op_type for n in onnx.load(str(tmp_path / "before.onnx")).graph.node]
    assert ops.count("Relu") >= 1 and ops.count("Relu") + ops.count("Clip") == 2  # a grid can match by chance
    assert any(
        f"{ops.count('Relu')} DequantizeLinear -> Relu -> QuantizeLinear chain(s) join two grids and stay "
        "float; modelopt_lite.share_relu_grids(model, forward_loop)" in n
        for n in rep.notes
    ), rep.notes
    assert mtq.share_relu_grids(q, loop)
    rep = mtq.export_onnx(
        q, batches[0], tmp_path / "after.onnx", target="onnxruntime", dynamic_axes={"input": {0: "batch"}}
    )
    assert any(
        "2 DequantizeLinear -> Relu -> QuantizeLinear chain(s) on one grid run as a uint8 Clip" in n for n in rep.notes
    )
    ops = [n.op_type for n in onnx.load(str(tmp_path / "after.onnx")).graph.node]
    assert ops.count("Clip") == 2 and "Relu" not in ops
    x = torch.cat(batches)
    got = ort_session(tmp_path / "after.onnx", optimize=False).run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        want = q(x).numpy()
    assert np.array_equal(got, want)  # every node as written: bit-exact
