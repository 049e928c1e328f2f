"""SequentialQuantizer (W4A8: INT4 blocks then FP8) exported to chained Q/DQ and saved/restored; ModelOpt's extra
quantizer attributes (trt_high_precision_dtype, pass_through_bwd, constant amax, no-op keys) (issue 14)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.nn import SequentialQuantizer, TensorQuantizer
from modelopt_lite.onnx_export.ort_runner import ort_session

W4A8 = {
    "quant_cfg": {
        "*weight_quantizer": [
            {"num_bits": 4, "block_sizes": {-1: 16}, "enable": True},
            {"num_bits": (4, 3), "axis": None, "enable": True},
        ],
        "*input_quantizer": {"num_bits": (4, 3), "axis": None},
        "default": {"enable": False},
    },
    "algorithm": "max",
}


def _w4a8():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 8))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    mtq.quantize(m, W4A8, lambda mm: mm(x))
    return m.eval(), x


class Chain(torch.nn.Module):
    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, x):
        return self.seq(x)


def _run(path, x):
    sess = ort_session(str(path))
    return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_sequential_quantizer_plain_export_is_a_bit_exact_chain(tmp_path, dynamo):
    m, _ = _w4a8()
    seq = m[0].weight_quantizer
    w = m[0].weight.detach().clone()
    model = Chain(seq).eval()
    with torch.no_grad():
        ref = model(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (w,), str(tmp_path / "s.onnx"), dynamo=dynamo, opset_version=19)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "s.onnx")).graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 2
    assert torch.equal(_run(tmp_path / "s.onnx", w), ref)


def test_sequential_weight_export_onnx_folds_int4_then_fp8(tmp_path):
    m, x = _w4a8()
    report = mtq.export_onnx(m, x, tmp_path / "e.onnx")
    assert report.opset == 21
    q = report.inspection.qdq
    assert q["DequantizeLinear INT4 block(axis=1, size=16)"] == 1
    assert q["QuantizeLinear FLOAT8E4M3FN per-tensor"] == 2
    with torch.no_grad():
        ref = m(x)
    # the weight path: int4 initializer -> DQ -> FP8 Q/DQ equals the torch SequentialQuantizer output exactly
    from onnx.reference import ReferenceEvaluator

    proto = onnx.load(str(tmp_path / "e.onnx"))
    gemm = next(n for n in proto.graph.node if n.op_type == "Gemm")
    proto.graph.output.append(onnx.helper.make_tensor_value_info(gemm.input[1], onnx.TensorProto.FLOAT, None))
    outs = ReferenceEvaluator(proto).run(None, {proto.graph.input[0].name: x.numpy()})
    with torch.no_grad():
        wq = m[0].weight_quantizer(m[0].weight)
    np.testing.assert_array_equal(outs[-1], wq.numpy())
    assert outs[0].shape == tuple(ref.shape)


def test_sequential_quantizer_save_restore_round_trip(tmp_path):
    m, x = _w4a8()
    m[0].input_quantizer.set_from_attribute_config({"trt_high_precision_dtype": "Half", "pass_through_bwd": True})
    mtq.save(m, tmp_path / "s.json")
    torch.manual_seed(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 8))
    r = mtq.restore(fresh, tmp_path / "s.json")
    seq = r[0].weight_quantizer
    assert isinstance(seq, SequentialQuantizer) and [q.num_bits for q in seq] == [4, (4, 3)]
    for a, b in zip(seq, m[0].weight_quantizer):
        assert torch.equal(a.amax, b.amax)
    assert r[0].input_quantizer.trt_high_precision_dtype == "Half" and r[0].input_quantizer.pass_through_bwd
    with torch.no_grad():
        assert torch.equal(r(x), m(x))


def test_restore_rejects_a_bad_peer_setting_in_the_file(tmp_path):
    m, _ = _w4a8()
    mtq.save(m, tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    doc["quantizers"]["0.input_quantizer"]["peer"]["trt_high_precision_dtype"] = "Double"
    (tmp_path / "s.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"0.input_quantizer'\]\.peer\.trt_high_precision_dtype.*'Double'"):
        mtq.restore(torch.nn.Sequential(torch.nn.Linear(32, 8)), tmp_path / "s.json")


def test_pass_through_bwd_gives_the_plain_straight_through_gradient():
    x = torch.tensor([-5.0, 0.3, 1.0, 5.0], requires_grad=True)
    q = TensorQuantizer(amax=2.0)
    q(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0, 0.0]))  # ours by default: zero outside the range
    x.grad = None
    q.set_from_attribute_config({"pass_through_bwd": True})
    y = q(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(4))
    with torch.no_grad():
        assert torch.equal(y, q(x))


def test_peer_attributes_in_a_config():
    cfg = {
        "quant_cfg": {
            "*weight_quantizer": {
                "num_bits": 8,
                "axis": 0,
                "trt_high_precision_dtype": "Half",
                "rotate": False,
                "bias": None,
                "backend": None,
                "effective_bits": 8,
            },
            "*input_quantizer": {"num_bits": (4, 3), "axis": None, "use_constant_amax": True},
        },
        "algorithm": "max",
    }
    m = mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 3)), cfg, lambda mm: mm(torch.randn(2, 4) * 1000))
    wq, iq = m[0].weight_quantizer, m[0].input_quantizer
    assert wq.trt_high_precision_dtype == "Half" and wq.effective_bits == 8.0 and not wq.pass_through_bwd
    assert torch.equal(iq.amax, torch.tensor(448.0))  # pinned: calibration on inputs up to ~3000 left it


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"rotate": True}, "rotate=True cannot be honoured: input rotation"),
        ({"bias": {"enable": True}}, r"bias \{'enable': True\} names no axis to reduce over"),  # ModelOpt's too
        ({"backend": "my_backend"}, "backend='my_backend' cannot be honoured"),
        ({"block_size": 16}, r"'block_size' is not a quantizer attribute.*block_sizes=\{-1: N\}"),
        ({"trt_high_precision_dtype": "Double"}, "trt_high_precision_dtype must be one of"),
        ({"constant_amax": -1.0}, "constant_amax must be a positive number"),
        ({"effective_bits": 20}, r"effective_bits must be None or a number in \(0, 16\]"),
    ],
)
def test_peer_attributes_that_cannot_be_honoured_are_clear_errors(attrs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        TensorQuantizer().set_from_attribute_config(attrs)
    with pytest.raises(ValueError, match=match):
        mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 3)), {"quant_cfg": {"*weight_quantizer": attrs}})
