"""A plain ``torch.onnx.export`` (dynamo and TorchScript) of modelopt_lite quantizers writes standard
QuantizeLinear/DequantizeLinear that ONNX Runtime runs to the torch output bit for bit (issue 14)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch

from modelopt_lite import quant_modules
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.onnx_export.ort_runner import ort_session
from modelopt_lite.tensor_quant import QuantDescriptor

EXPORTERS = [pytest.param(True, id="dynamo"), pytest.param(False, id="torchscript")]


class Quant(torch.nn.Module):
    def __init__(self, q):
        super().__init__()
        self.q = q

    def forward(self, x):
        return self.q(x)


def _quantizer(amax, **desc):
    q = TensorQuantizer(QuantDescriptor(**desc), amax=amax)
    return Quant(q).eval()


def _export(model, x, path, dynamo, opset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=dynamo, opset_version=opset)
    return onnx.load(str(path))


def _run(path, x):
    sess = ort_session(str(path))
    return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])


def _ops(proto):
    return [n.op_type for n in proto.graph.node]


def _x(shape=(4, 6, 5)):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * 3
    x.view(-1)[:4] = torch.tensor([0.5, -0.5, 1e4, -1e4])  # ties and values far past amax
    return x


CASES = {
    "int8_tensor": (torch.tensor(2.5), {"num_bits": 8}),
    "int8_narrow": (torch.tensor(2.5), {"num_bits": 8, "narrow_range": True}),
    "uint8": (torch.tensor(2.5), {"num_bits": 8, "unsigned": True}),
    "int4": (torch.tensor(2.5), {"num_bits": 4}),
    "int8_channel": (torch.linspace(0.5, 3.0, 6).reshape(1, 6, 1), {"num_bits": 8, "axis": (1,)}),
    "int8_channel_narrow": (
        torch.linspace(0.5, 3.0, 6).reshape(1, 6, 1),
        {"num_bits": 8, "axis": (1,), "narrow_range": True},
    ),
}


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_plain_export_is_bit_exact_in_ort(tmp_path, case, dynamo):
    amax, desc = CASES[case]
    model = _quantizer(amax, **desc)
    x = _x().abs() if desc.get("unsigned") else _x()
    with torch.no_grad():
        ref = model(x)
    proto = _export(model, x, tmp_path / "m.onnx", dynamo, 18 if dynamo else 13)
    ops = _ops(proto)
    assert ops.count("QuantizeLinear") == 1 and ops.count("DequantizeLinear") == 1
    assert not [n for n in proto.graph.node if n.domain not in ("", "ai.onnx")]
    q = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear")
    axis = [a.i for a in q.attribute if a.name == "axis"]
    assert axis == ([1] if "channel" in case else [])
    out = _run(tmp_path / "m.onnx", x)
    assert out.dtype == torch.float32
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_plain_export_fp8_at_opset_19(tmp_path, dynamo):
    model = _quantizer(torch.tensor(2.0), num_bits=(4, 3))
    x = _x()
    with torch.no_grad():
        ref = model(x)
    proto = _export(model, x, tmp_path / "m.onnx", dynamo, 19)
    zps = [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN]
    consts = [n for n in proto.graph.node if n.op_type == "Constant"]
    assert zps or consts
    assert _ops(proto).count("QuantizeLinear") == 1
    assert torch.equal(_run(tmp_path / "m.onnx", x), ref)


def test_plain_torchscript_fp8_below_opset_19_is_a_clear_error(tmp_path):
    model = _quantizer(torch.tensor(2.0), num_bits=(4, 3))
    with pytest.raises(Exception, match="FP8 E4M3 QuantizeLinear needs opset >= 19, got opset 17"):
        _export(model, _x(), tmp_path / "m.onnx", False, 17)


def test_plain_torchscript_dead_scale_is_a_clear_error(tmp_path):
    model = _quantizer(torch.tensor(0.0), num_bits=8)
    with pytest.raises(ValueError, match="dead scale .*modelopt_lite.export_onnx"):
        _export(model, _x(), tmp_path / "m.onnx", False, 13)


def test_plain_export_16_bit_grid_is_a_clear_error(tmp_path):
    model = _quantizer(torch.tensor(2.0), num_bits=16)
    with pytest.raises(Exception, match=r"grid \[-32768, 32767\] needs a 16-bit QuantizeLinear"):
        _export(model, _x(), tmp_path / "m.onnx", False, 13)


def test_plain_dynamo_export_16_bit_grid_warns_with_the_reason(tmp_path):
    """torch's dynamo exporter retries other capture strategies and reports its own error: our reason is a warning."""
    model = _quantizer(torch.tensor(2.0), num_bits=16)
    with (
        pytest.warns(UserWarning, match=r"grid \[-32768, 32767\] needs a 16-bit QuantizeLinear.*export_onnx"),
        pytest.raises(Exception, match="modelopt_lite"),
    ):
        torch.onnx.export(model, (_x(),), str(tmp_path / "m.onnx"), opset_version=18)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_plain_export_half_input_casts_around_the_pair(tmp_path, dynamo):
    model = _quantizer(torch.tensor(2.5), num_bits=8)
    x = _x().half()
    with torch.no_grad():
        ref = model(x)
    proto = _export(model, x, tmp_path / "m.onnx", dynamo, 18 if dynamo else 13)
    assert "Cast" in _ops(proto)
    sess = ort_session(str(tmp_path / "m.onnx"))
    out = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    assert out.dtype == torch.float16
    assert torch.equal(out, ref)


def test_enable_onnx_export_block_with_torchscript_export(tmp_path):
    """pytorch-quantization's export lines, unchanged."""
    model = _quantizer(torch.linspace(0.5, 3.0, 6).reshape(1, 6, 1), num_bits=8, axis=(1,))
    x = _x()
    with torch.no_grad():
        ref = model(x)
    with quant_modules.enable_onnx_export():
        torch.onnx.export(model, x, str(tmp_path / "m.onnx"), dynamo=False, opset_version=13)
    assert torch.equal(_run(tmp_path / "m.onnx", x), ref)


def test_export_onnx_still_writes_folded_weights(tmp_path):
    """The plain-export path is off inside modelopt_lite.export_onnx (weights stay folded int8 initializers)."""
    import modelopt_lite as mtl

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 4))
    x = torch.randn(3, 6)
    mtl.quantize(m, mtl.INT8_DEFAULT_CFG, lambda mm: mm(x))
    mtl.export_onnx(m, x, tmp_path / "e.onnx")
    proto = onnx.load(str(tmp_path / "e.onnx"))
    assert any(i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2 for i in proto.graph.initializer)
    assert _ops(proto).count("QuantizeLinear") == 1


def test_plain_export_of_a_quantized_model_matches_torch(tmp_path):
    """Conv/Linear between the quantizers run in float in ORT (summation order may differ from torch's)."""
    import modelopt_lite as mtl

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10)
    )
    x = torch.randn(4, 3, 8, 8)
    mtl.quantize(m, mtl.INT8_DEFAULT_CFG, lambda mm: mm(x))
    m.eval()
    _export(m, x, tmp_path / "p.onnx", True, 18)
    with torch.no_grad():
        ref = m(x)
    plain = _run(tmp_path / "p.onnx", x)
    assert plain.shape == (4, 10)
    assert _ops(_export(m, x, tmp_path / "p.onnx", True, 18)).count("QuantizeLinear") == 4
    # an input of the Linear's quantizer may land one step apart (Conv summation order): bound by a few steps
    step = float(m[3].input_quantizer.amax.max()) / 127
    bound = 4 * step * float(m[3].weight.abs().max())
    np.testing.assert_allclose(plain.numpy(), ref.numpy(), rtol=0, atol=bound)


def test_plain_dynamo_export_of_a_dead_scale_runs_to_zeros_in_ort(tmp_path):
    """Under dynamo the scale's value is unknown at trace time: the file holds scale 0, and ORT's Q/DQ gives zeros
    (the torch output) for every input, Inf and NaN included (TensorRT rejects such a scale: use export_onnx)."""
    model = _quantizer(torch.tensor(0.0), num_bits=8)
    x = torch.tensor([[0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-30]])
    with torch.no_grad():
        ref = model(x)
    _export(model, x, tmp_path / "m.onnx", True, 18)
    out = _run(tmp_path / "m.onnx", x)
    assert torch.equal(ref, torch.zeros_like(x)) and torch.equal(out, ref)  # -0.0 == 0.0
