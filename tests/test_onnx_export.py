"""export_onnx on small modules: functional ops, quantized layers, every Q/DQ form, bad cases, model untouched."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, numpy_helper

import modelopt_lite as mtq
import modelopt_lite.tensor_quant as tq
from modelopt_lite.conversion.utils import named_quantizers
from modelopt_lite.onnx_export import export_onnx, inspect_onnx
from modelopt_lite.onnx_export.ort_runner import ort_session
from modelopt_lite.onnx_export.qdq import DEAD_SCALE

EXPORTERS = [pytest.param(False, id="torchscript"), pytest.param(True, id="dynamo")]


def run(path, *inputs, names=None):
    sess = ort_session(path)
    names = names or [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})


def nodes(path):
    return [n for n in onnx.load(str(path)).graph.node]


def op_count(path, op):
    return sum(n.op_type == op for n in nodes(path))


def inits(path):
    return {t.name: t for t in onnx.load(str(path)).graph.initializer}


def cfg(weight=None, act=None):
    quant_cfg = {"default": {"enable": False}}
    if weight is not None:
        quant_cfg["*weight_quantizer"] = dict(weight, enable=True)
    if act is not None:
        quant_cfg["*input_quantizer"] = dict(act, enable=True)
    return {"quant_cfg": quant_cfg, "algorithm": "max"}


INT8_W = {"num_bits": 8, "axis": 0}
INT8_A = {"num_bits": 8, "axis": None}


def quantized(model, config, *batches):
    mtq.quantize(model, config, lambda m: [m(*b) if isinstance(b, tuple) else m(b) for b in batches])
    return model.eval()


class Activations(nn.Module):
    """Only quantizers (no float compute in between): ORT must reproduce every output bit for bit."""

    def __init__(self):
        super().__init__()
        self.register_buffer("amax", torch.tensor(2.0))
        self.register_buffer("amax_c", torch.tensor([0.5, 1.0, 3.0]).reshape(1, 3, 1))
        self.register_buffer("amax_dead", torch.tensor(0.0))

    def forward(self, x):
        a = tq.fake_tensor_quant(x, self.amax, 8, narrow_range=False)
        b = tq.fake_tensor_quant(x, self.amax, 8, narrow_range=True)
        c = tq.fake_tensor_quant(x, self.amax_c, 8, narrow_range=False)
        d = tq.fake_tensor_quant(torch.relu(x), self.amax, 8, unsigned=True)
        e = tq.fake_tensor_quant(x, self.amax, 4, narrow_range=False)
        f = tq.fake_tensor_quant(x, self.amax_dead, 8, narrow_range=False)
        return a, b, c, d, e, f


def act_input(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 50, generator=g) * 2
    x[0, 0, :9] = torch.tensor([2.0, -2.0, 2.5, -2.5, 0.0, -0.0, 1e3, -1e3, 2.0 / 127 * 0.5])
    return x


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_activation_qdq_forms_bit_exact(tmp_path, dynamo):
    m, x = Activations(), act_input()
    rep = export_onnx(m, x, tmp_path / "a.onnx", dynamo=dynamo, opset=18 if dynamo else 17)
    outs = run(tmp_path / "a.onnx", x)
    for got, want in zip(outs, m(x)):
        assert torch.equal(torch.from_numpy(got), want)
    ops = [n.op_type for n in nodes(tmp_path / "a.onnx")]
    assert ops.count("QuantizeLinear") == 6 and ops.count("DequantizeLinear") == 6
    assert ops.count("Clip") == 2  # narrow range and the 4-bit grid
    assert rep.qdq_counts["QuantizeLinear INT8 per-channel(axis=1)"] == 1
    assert rep.qdq_counts["QuantizeLinear UINT8 per-tensor"] == 1
    init = inits(tmp_path / "a.onnx")
    scales = [numpy_helper.to_array(init[n.input[1]]) for n in nodes(tmp_path / "a.onnx") if "Linear" in n.op_type]
    assert all((s > 0).all() and np.isfinite(s).all() for s in scales)
    assert any(np.array_equal(s, DEAD_SCALE) for s in scales)
    assert any("dead activation scale" in n for n in rep.notes)
    assert any("[-8, 7]" in n for n in rep.notes)


def test_e4m3_and_affine_bit_exact(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            return (
                tq.scaled_e4m3(x, torch.tensor(3.0)),
                tq.scaled_e4m3(x, torch.tensor([[[1.0], [4.0], [448.0]]])),
                tq.fake_affine_tensor_quant(x, -0.7, 2.2, 8),
            )

    m, x = M(), act_input(1) * 3
    rep = export_onnx(m, x, tmp_path / "f.onnx", target="onnxruntime")
    assert rep.opset == 19  # chosen automatically for E4M3
    for got, want in zip(run(tmp_path / "f.onnx", x), m(x)):
        assert torch.equal(torch.from_numpy(got), want)
    q = [n for n in nodes(tmp_path / "f.onnx") if n.op_type == "QuantizeLinear"]
    zps = inits(tmp_path / "f.onnx")
    assert [zps[n.input[2]].data_type for n in q].count(TensorProto.FLOAT8E4M3FN) == 2
    assert all(a.i == 1 for n in q[:2] for a in n.attribute if a.name == "saturate")
    with pytest.raises(ValueError, match="affine quantization.*TensorRT"):
        export_onnx(m, x, tmp_path / "g.onnx", target="tensorrt")
    with pytest.raises(ValueError, match="FP8 E4M3 Q/DQ needs opset >= 19"):
        export_onnx(m, x, tmp_path / "h.onnx", opset=17, target="onnxruntime")


def test_fp8_custom_trt_ops(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            return tq.scaled_e4m3(x, torch.tensor(3.0))

    rep = export_onnx(M(), torch.randn(2, 8), tmp_path / "t.onnx", fp8_custom_ops=True)
    model = onnx.load(str(tmp_path / "t.onnx"))
    assert [(n.domain, n.op_type) for n in model.graph.node] == [
        ("trt", "TRT_FP8QuantizeLinear"),
        ("trt", "TRT_FP8DequantizeLinear"),
    ]
    assert {o.domain for o in model.opset_import} >= {"trt"}
    assert rep.qdq_counts == {
        "TRT_FP8QuantizeLinear FLOAT8E4M3FN per-tensor": 1,
        "TRT_FP8DequantizeLinear FLOAT8E4M3FN per-tensor": 1,
    }
    with pytest.raises(ValueError, match="target='tensorrt'"):
        export_onnx(M(), torch.randn(2, 8), tmp_path / "u.onnx", fp8_custom_ops=True, target="onnxruntime")


class FunctionalNet(nn.Module):
    """Linear + Conv calling the functional API (weights per output channel, one dead channel)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.conv = nn.Linear(32, 16), nn.Conv2d(3, 8, 3)
        with torch.no_grad():
            self.lin.weight[5] = 0  # a dead channel: amax 0 after max calibration
        self.register_buffer("amax", torch.tensor(3.0))
        self.register_buffer("wamax", self.lin.weight.detach().abs().amax(1, keepdim=True))
        self.register_buffer("camax", self.conv.weight.detach().abs().amax((1, 2, 3), keepdim=True))

    def forward(self, x, img):
        w = tq.fake_tensor_quant(self.lin.weight, self.wamax, 8, narrow_range=True)
        cw = tq.fake_tensor_quant(self.conv.weight, self.camax, 8, narrow_range=True)
        y = nn.functional.linear(tq.fake_tensor_quant(x, self.amax, 8, narrow_range=False), w, self.lin.bias)
        z = nn.functional.conv2d(tq.fake_tensor_quant(img, self.amax, 8, narrow_range=False), cw, self.conv.bias)
        return y, z


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_weights_folded_into_int8_initializers(tmp_path, dynamo):
    m = FunctionalNet()
    x, img = torch.randn(16, 32), torch.randn(2, 3, 8, 8)
    rep = export_onnx(m, (x, img), tmp_path / "w.onnx", dynamo=dynamo)
    init = inits(tmp_path / "w.onnx")
    floats = [k for k, t in init.items() if t.data_type == TensorProto.FLOAT and t.dims and np.prod(t.dims) > 16]
    assert floats == []  # no float weight left behind
    int8 = {k: numpy_helper.to_array(t) for k, t in init.items() if t.data_type == TensorProto.INT8 and len(t.dims) > 1}
    assert sorted(v.shape for v in int8.values()) == [(8, 3, 3, 3), (16, 32)]
    assert all(v.min() >= -127 for v in int8.values())  # narrow range kept in the codes
    lin_codes = next(v for v in int8.values() if v.shape == (16, 32))
    assert not lin_codes[5].any()
    dq_scales = [
        numpy_helper.to_array(init[n.input[1]])
        for n in nodes(tmp_path / "w.onnx")
        if n.op_type == "DequantizeLinear" and n.input[0] in int8
    ]
    assert all((s > 0).all() for s in dq_scales) and any(s.shape == (16,) and s[5] == 1.0 for s in dq_scales)
    assert rep.qdq_counts["DequantizeLinear INT8 per-channel(axis=0)"] == 2
    y, z = run(tmp_path / "w.onnx", x, img)
    ty, tz = m(x, img)
    assert torch.equal(torch.from_numpy(y)[:, 5], ty[:, 5])  # dead channel: just the bias
    for got, want in ((y, ty), (z, tz)):
        assert np.abs(got - want.detach().numpy()).max() <= 1e-5 * want.abs().max().item()


def test_int4_block_weights(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.lin = nn.Linear(200, 8)  # 200 = one full block of 128 + a partial block
            self.register_buffer("bamax", tq.blocks.block_amax(self.lin.weight.detach(), {-1: 128}))

        def forward(self, x):
            w = tq.fake_block_quant(self.lin.weight, {-1: 128}, self.bamax, num_bits=4)
            return nn.functional.linear(x, w, self.lin.bias)

    m, x = M(), torch.randn(5, 200)
    rep = export_onnx(m, x, tmp_path / "b.onnx")
    assert rep.opset == 21
    dq = [n for n in nodes(tmp_path / "b.onnx") if n.op_type == "DequantizeLinear"]
    assert len(dq) == 1 and {a.name: a.i for a in dq[0].attribute} == {"axis": 1, "block_size": 128}
    init = inits(tmp_path / "b.onnx")
    codes = init[dq[0].input[0]]
    assert codes.data_type == TensorProto.INT4 and list(codes.dims) == [8, 200] and len(codes.raw_data) == 800
    assert list(init[dq[0].input[1]].dims) == [8, 2]
    q, _ = tq.block_quant(m.lin.weight.detach(), {-1: 128}, m.bamax, num_bits=4)
    np.testing.assert_array_equal(numpy_helper.to_array(codes).astype(np.int64), q.numpy().astype(np.int64))
    (y,) = run(tmp_path / "b.onnx", x)
    want = m(x).detach().numpy()
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(ValueError, match="opset >= 21"):
        export_onnx(m, x, tmp_path / "c.onnx", opset=19)


def test_16bit_activation_grid_needs_opset21(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            return tq.fake_tensor_quant(x, torch.tensor(2.0), 12, narrow_range=False)

    x = act_input(2)
    export_onnx(M(), x, tmp_path / "a.onnx", opset=21)
    (y,) = run(tmp_path / "a.onnx", x)
    assert torch.equal(torch.from_numpy(y), M()(x))
    q = next(n for n in nodes(tmp_path / "a.onnx") if n.op_type == "QuantizeLinear")
    assert inits(tmp_path / "a.onnx")[q.input[2]].data_type == TensorProto.INT16
    with pytest.raises(ValueError, match=r"12-bit activation grid \[-2048, 2047\] needs a 16-bit.*opset 17"):
        export_onnx(M(), x, tmp_path / "b.onnx", opset=17)


# --- quantized layers ----------------------------------------------------------------------------------------------
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(12, 6), nn.Linear(12, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def test_shared_input_gets_one_qdq_pair(tmp_path):
    x = torch.randn(32, 12)
    m = quantized(TwoHeads(), cfg(INT8_W, INT8_A), x)
    rep = export_onnx(m, x, tmp_path / "s.onnx")
    assert op_count(tmp_path / "s.onnx", "QuantizeLinear") == 1 and rep.merged == 1
    assert op_count(tmp_path / "s.onnx", "DequantizeLinear") == 3  # one activation pair + two weights
    for got, want in zip(run(tmp_path / "s.onnx", x), m(x)):
        assert np.abs(got - want.detach().numpy()).max() <= 1e-5 * want.abs().max().item()


def test_fp16_model_casts_only_around_qdq(tmp_path):
    x = torch.randn(32, 12)
    m = quantized(TwoHeads(), cfg(INT8_W, INT8_A), x).half()
    xh = x.half()
    rep = export_onnx(m, xh, tmp_path / "h.onnx")
    assert rep.node_counts["Cast"] == 4  # input to float32 and back, and each dequantized weight to float16
    outs = run(tmp_path / "h.onnx", xh)
    for got, want in zip(outs, m(xh)):
        assert got.dtype == np.float16
        assert np.abs(got.astype(np.float32) - want.float().detach().numpy()).max() <= 2e-3 * want.abs().max().item()


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_dynamic_batch(tmp_path, dynamo):
    x = torch.randn(8, 12)
    m = quantized(TwoHeads(), cfg(INT8_W, INT8_A), x)
    export_onnx(
        m,
        x,
        tmp_path / "d.onnx",
        dynamo=dynamo,
        input_names=["x"],
        output_names=["ya", "yb"],
        dynamic_axes={"x": {0: "batch"}, "ya": {0: "batch"}, "yb": {0: "batch"}},
    )
    big = torch.randn(37, 12)
    ya, yb = run(tmp_path / "d.onnx", big)
    assert ya.shape == (37, 6) and yb.shape == (37, 4)
    assert np.abs(ya - m(big)[0].detach().numpy()).max() <= 1e-5 * m(big)[0].abs().max().item()


def test_model_left_exactly_as_it_was(tmp_path):
    x = torch.randn(16, 12)
    m = quantized(TwoHeads(), cfg(INT8_W, INT8_A), x)
    m.train()
    m.b.eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    flags = [(q.is_enabled, q.is_quant_enabled, q.is_calib_enabled) for _, q in named_quantizers(m)]
    export_onnx(m, x, tmp_path / "m.onnx")
    export_onnx(m, x, tmp_path / "n.onnx", dynamo=True)
    assert m.training and m.a.training and not m.b.training
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert flags == [(q.is_enabled, q.is_quant_enabled, q.is_calib_enabled) for _, q in named_quantizers(m)]


# --- bad cases -----------------------------------------------------------------------------------------------------
def test_uncalibrated_quantizers_all_named(tmp_path):
    # quantize without a loop calibrates the weights from themselves (ModelOpt's weight-only calibration); the
    # activation quantizers stay uncalibrated, and the export names every one of them
    m = mtq.quantize(TwoHeads(), cfg(INT8_W, INT8_A))
    with pytest.raises(ValueError) as e:
        export_onnx(m, torch.randn(2, 12), tmp_path / "u.onnx")
    msg = str(e.value)
    assert "2 enabled quantizer(s) not calibrated" in msg
    assert "a.input_quantizer, b.input_quantizer" in msg and "weight_quantizer" not in msg
    assert not (tmp_path / "u.onnx").exists()


def test_calibrating_quantizer_refused(tmp_path):
    x = torch.randn(8, 12)
    m = quantized(TwoHeads(), cfg(INT8_W, INT8_A), x)
    m.a.input_quantizer.enable_calib()
    with pytest.raises(ValueError, match=r"calibration mode.*a\.input_quantizer"):
        export_onnx(m, x, tmp_path / "c.onnx")


def test_activation_bits_without_onnx_type_named(tmp_path):
    x = torch.randn(8, 12)
    m = mtq.quantize(TwoHeads(), cfg(INT8_W, INT8_A))
    m.b.input_quantizer.set_from_attribute_config({"num_bits": 12})
    with mtq.calibrate(m):
        m(x)
    with pytest.raises(ValueError, match=r"b\.input_quantizer: num_bits=12 has no ONNX representation below opset 21"):
        export_onnx(m, x, tmp_path / "n.onnx", opset=17)
    rep = export_onnx(m, x, tmp_path / "n21.onnx")  # opset chosen automatically: exact INT16 Q/DQ
    assert rep.opset == 21 and rep.qdq_counts["QuantizeLinear INT16 per-tensor"] == 1


@pytest.mark.parametrize(
    "config,opset,needed",
    [
        (cfg(INT8_W, INT8_A), 12, "per-channel quantization (axis) needs opset >= 13"),
        (cfg({"num_bits": (4, 3), "axis": None}, {"num_bits": (4, 3), "axis": None}), 17, "FP8 E4M3 needs opset >= 19"),
        (cfg({"num_bits": 4, "block_sizes": {-1: 8}, "axis": None}), 19, "block-quantized weights need opset >= 21"),
    ],
)
def test_opset_too_low(tmp_path, config, opset, needed):
    x = torch.randn(8, 12)
    m = quantized(TwoHeads(), config, x)
    with pytest.raises(ValueError, match=rf"opset {opset} is too low: .*a\.weight_quantizer: {re.escape(needed)}"):
        export_onnx(m, x, tmp_path / "o.onnx", opset=opset)


def test_bad_arguments(tmp_path):
    m = quantized(TwoHeads(), cfg(INT8_W, INT8_A), torch.randn(4, 12))
    with pytest.raises(ValueError, match="target must be one of"):
        export_onnx(m, torch.randn(2, 12), tmp_path / "x.onnx", target="tflite")
    with pytest.raises(ValueError, match="opset must be an int"):
        export_onnx(m, torch.randn(2, 12), tmp_path / "x.onnx", opset=99)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        export_onnx(lambda x: x, torch.randn(2, 12), tmp_path / "x.onnx")


# --- inspect -------------------------------------------------------------------------------------------------------
def test_inspect_finds_float_fallbacks(tmp_path):
    fp = TwoHeads().eval()
    torch.onnx.export(fp, (torch.randn(2, 12),), str(tmp_path / "fp.onnx"), dynamo=False, input_names=["x"])
    info = inspect_onnx(tmp_path / "fp.onnx")
    assert info.qdq == {} and info.compute_ops == 2 and info.quantized_ops == 0
    assert len(info.unquantized) == 4 and all(u.startswith("Gemm") for u in info.unquantized)
    m = quantized(copy.deepcopy(fp), cfg(INT8_W, INT8_A), torch.randn(8, 12))
    export_onnx(m, torch.randn(2, 12), tmp_path / "q.onnx")
    info = inspect_onnx(tmp_path / "q.onnx")
    assert info.quantized_ops == 2 and info.unquantized == []
    assert info.num_quantize == 1 and info.num_dequantize == 3
    text = str(info)
    assert "QuantizeLinear INT8 per-tensor" in text and "DequantizeLinear INT8 per-channel(axis=0)" in text
