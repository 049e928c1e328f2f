"""NVFP4 / OCP MX through the stack: formats as data, descriptor validation, TensorQuantizer, ops, presets."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.conversion import PRESETS, summary
from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.formats import BLOCK_SCHEMES, block_scheme, element_format, format_range, scaled_is_e4m3
from modelopt_lite.functional import library_mx
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.nn import TensorQuantizer

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _mx(nb):
    return {"num_bits": nb, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}


# --- formats as data -----------------------------------------------------------------------------------------------
def test_element_formats_are_data():
    e4m3, e5m2, e2m1 = (element_format(nb) for nb in ((4, 3), (5, 2), (2, 1)))
    assert (e4m3.qmax, e4m3.onnx_type, e4m3.onnx_opset, e4m3.code_dtype) == (448.0, "FLOAT8E4M3FN", 19,
                                                                             torch.float8_e4m3fn)  # fmt: skip
    assert (e5m2.qmax, e5m2.onnx_type, e5m2.emax, e5m2.code_dtype) == (57344.0, "FLOAT8E5M2", 15, torch.float8_e5m2)
    assert (e2m1.qmax, e2m1.onnx_type, e2m1.onnx_opset, e2m1.emax) == (6.0, "FLOAT4E2M1", 23, 2)
    assert element_format((8, 0)).onnx_opset == 24
    i4 = element_format(4, unsigned=True)
    assert (i4.name, i4.qmin, i4.qmax, i4.onnx_type, i4.onnx_opset, i4.is_float) == ("uint4", 0, 15, "UINT4", 21, False)
    assert element_format(8, narrow_range=True).qmin == -127
    assert format_range((2, 1)) == (6.0, -6.0, 6.0)
    assert e4m3.round(torch.tensor([500.0, 0.3])).tolist() == [448.0, 0.3125]
    with pytest.raises(ValueError, match=r"num_bits=\(3, 2\) is not a supported floating-point format"):
        element_format((3, 2))
    with pytest.raises(ValueError, match=r"E8M0\) has no float32-scaled"):
        scaled_is_e4m3((8, 0))
    assert scaled_is_e4m3((4, 3)) and not scaled_is_e4m3(8) and not scaled_is_e4m3((2, 1))


def test_block_schemes():
    assert {s.name for s in BLOCK_SCHEMES.values()} == {"nvfp4", "mxfp8", "mxfp8_e5m2", "mxfp4", "mxint8"}
    s = block_scheme((2, 1), NVFP4["block_sizes"])
    assert (s.name, s.kind, s.calibrates_amax, s.scale.name) == ("nvfp4", "nvfp4", True, "e4m3")
    s = block_scheme(8, _mx(8)["block_sizes"])
    assert (s.name, s.elem, s.calibrates_amax, s.scale.power_of_two) == ("mxint8", "int8", False, True)
    assert block_scheme(4, {-1: 128}) is None and block_scheme(4, None) is None


# --- descriptor ----------------------------------------------------------------------------------------------------
def test_descriptor_accepts_and_validates():
    d = QuantDescriptor(**NVFP4)
    assert d.block_scheme.name == "nvfp4" and not d.dynamic  # the global amax is calibrated
    assert QuantDescriptor(**_mx((4, 3))).dynamic
    assert QuantDescriptor(**NVFP4, amax=2.0).amax.tolist() == 2.0
    bad = [
        ({**NVFP4, "block_sizes": {-1: 8, "scale_bits": (4, 3)}}, r"NVFP4 blocks run along the last axis.*got \{-1: 8\}"),
        ({**NVFP4, "block_sizes": {0: 16, "scale_bits": (4, 3)}}, r"last axis"),
        ({**_mx((2, 1)), "block_sizes": {-1: 16, "scale_bits": (8, 0)}}, r"MXFP4 blocks .* \(32,\)"),
        ({**_mx((4, 3)), "block_sizes": {-1: 32, "type": "static", "scale_bits": (8, 0)}}, "must be 'dynamic'"),
        ({**NVFP4, "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}, "amax": 1.0}, "one amax per block"),
        ({**_mx(8), "unsigned": True}, "MXINT8 is signed"),
        ({**_mx((4, 3)), "amax": 1.0}, "MXFP8 takes no amax"),
        ({**NVFP4, "learn_amax": True}, "learn_amax=True is not supported for NVFP4"),
        ({"num_bits": (8, 0)}, r"E8M0\) is a scale format only"),
        ({"num_bits": 4, "block_sizes": {-1: 32, "scale_bits": (8, 0)}}, r"scale_bits=\(8, 0\).*needs num_bits"),
    ]  # fmt: skip
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            QuantDescriptor(**kw)


# --- quantizer -----------------------------------------------------------------------------------------------------
def test_nvfp4_quantizer_uses_its_calibrated_global_amax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    q = TensorQuantizer(QuantDescriptor(**NVFP4))
    assert torch.equal(q(x), mx.fake_nvfp4(x, mx.nvfp4_global_scale(x.abs().amax())))  # uncalibrated: own amax
    q.enable_calib()
    q.disable_quant()
    q(x)
    q(x * 0.5)
    q.load_calib_amax()
    q.disable_calib()
    q.enable_quant()
    assert q.amax.item() == x.abs().amax().item()
    assert q.scale.item() == mx.nvfp4_global_scale(q.amax).item()
    big = x * 3  # activations beyond the calibrated amax: the static global scale is kept, blocks saturate
    assert torch.equal(q(big), mx.fake_nvfp4(big, mx.nvfp4_global_scale(q.amax)))
    assert "nvfp4" in repr(q)
    with pytest.raises(ValueError, match="NVFP4 real codes"):
        q.quantize_weight_codes(x)


@pytest.mark.parametrize("nb, elem, rounding", [((4, 3), "e4m3", "rceil"), ((5, 2), "e5m2", "rceil"),
                                                ((2, 1), "e2m1", "rceil"), (8, "int8", "floor")])  # fmt: skip
def test_mx_quantizer_is_dynamic(nb, elem, rounding):
    x = torch.randn(4, 70, dtype=torch.bfloat16)
    q = TensorQuantizer(QuantDescriptor(**_mx(nb)))
    y = q(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, mx.fake_mx(x, elem, rounding=rounding))
    assert q.calibrator is None and q.dynamic


def test_nan_input_names_the_quantizer():
    q = TensorQuantizer(QuantDescriptor(**_mx((4, 3))), name="l1.input_quantizer")
    with pytest.raises(ValueError, match=r"l1.input_quantizer.*NaN or Inf"):
        q(torch.tensor([[float("nan")] * 32]))


# --- ops: gradients, compile, export -------------------------------------------------------------------------------
def test_ste_gradients():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.9 * 2**8  # MXFP8 "floor": k = 0, saturates at 448 -> outside the range
    x[0, 1] = 3.0
    x.requires_grad_(True)
    library_mx.mx_fake_quant(x, "e4m3", rounding="floor").sum().backward()
    assert x.grad[0, :3].tolist() == [0.0, 1.0, 1.0]
    x = torch.tensor([[10.0] * 8 + [-1.0] * 8], requires_grad=True)
    library_mx.nvfp4_fake_quant(x, 1.0).sum().backward()  # static amax 1: |x| = 10 is out of range
    assert x.grad[0].tolist() == [0.0] * 8 + [1.0] * 8


@pytest.mark.parametrize("preset, op", [("MXFP8_DEFAULT_CFG", "fake_mx"), ("NVFP4_DEFAULT_CFG", "fake_nvfp4")])
def test_compile_and_export_keep_the_ops(preset, op):
    model = nn.Sequential(nn.Linear(64, 32))
    x = torch.randn(4, 64)
    cfg = getattr(mtq, preset)
    mtq.quantize(model, cfg, (lambda m: m(x)) if cfg["algorithm"] else None)
    want = model(x)
    f = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(f(x), want)
    ep = torch.export.export(model, (x,))
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert f"modelopt_lite.{op}.default" in names
    assert torch.equal(ep.module()(x), want)


def test_presets_run_and_summaries_name_the_format():
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16))
    x = torch.randn(8, 32)
    for name in ("NVFP4_DEFAULT_CFG", "W4A16_NVFP4_CFG", "W4A8_NVFP4_FP8_CFG", "MXFP8_DEFAULT_CFG",
                 "MXFP4_DEFAULT_CFG", "MXINT8_DEFAULT_CFG"):  # fmt: skip
        cfg = getattr(mtq, name)
        assert PRESETS[name] is cfg
        q = copy.deepcopy(model)
        loop = (lambda m: m(x)) if cfg["algorithm"] is not None else None
        mtq.quantize(q, cfg, loop)
        y = q(x)
        assert y.shape == (8, 16) and torch.isfinite(y).all()
        assert not torch.equal(y, model(x)), name
    q = copy.deepcopy(model)
    mtq.quantize(q, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    assert "nvfp4" in str(summary(q)) and "nvfp4" in repr(q)


def test_export_fake2real_and_save_restore(tmp_path):
    x = torch.randn(4, 32)
    model = nn.Sequential(nn.Linear(32, 16))
    mtq.quantize(model, mtq.W4A16_NVFP4_CFG, lambda m: m(x))
    rep = mtq.export_onnx(model, (x,), str(tmp_path / "m.onnx"))  # FLOAT4E2M1 weights (tests/test_onnx_microscaling)
    assert rep.opset == 23 and rep.weights[0]["dtype"] == "FLOAT4E2M1"
    real = mtq.fake2real(copy.deepcopy(model))  # packed E2M1 codes (tests/test_real_microscaling)
    assert torch.equal(real(x), model(x))
    mtq.save(model, str(tmp_path / "q.pt"))
    other = nn.Sequential(nn.Linear(32, 16))
    other.load_state_dict(model.state_dict(), strict=False)
    mtq.restore(other, str(tmp_path / "q.pt"))
    assert other[0].weight_quantizer.amax.shape == () and torch.equal(other(x), model(x))
