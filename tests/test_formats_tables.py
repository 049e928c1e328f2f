"""formats.py owns every numeric table: integer ranges, code containers (torch / numpy / ONNX), E4M3.

The tables are checked against first principles (two's complement, torch.iinfo, numpy.iinfo, onnx's own type
mapping), and the layers that used to keep their own copies are checked to ask formats.py (or the one bias-code
function) instead: same objects, and the same answers for every format.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from modelopt_lite import formats
from modelopt_lite.descriptor import ScaledQuantDescriptor
from modelopt_lite.formats import (
    CODE_TYPES,
    E4M3_MAX,
    INT32,
    ONNX_ACTIVATION_TYPES,
    ONNX_WEIGHT_TYPES,
    TORCH_CODE_TYPES,
    format_range,
    int_range,
    smallest_code_type,
    torch_code_dtype,
)
from modelopt_lite.functional import lowlevel, requant
from modelopt_lite.nn import TensorQuantizer

FORMATS = [(b, u, n) for b in range(1, 17) for u in (False, True) for n in (False, True) if u or b > 1]


@pytest.mark.parametrize("bits", range(1, 17))
def test_int_ranges_from_first_principles(bits):
    assert int_range(bits, unsigned=True) == (2**bits - 1, 0, 2**bits - 1)
    assert int_range(bits, unsigned=True, narrow_range=True) == (2**bits - 1, 0, 2**bits - 1)  # no effect
    if bits == 1:
        with pytest.raises(ValueError, match="num_bits=1 needs unsigned=True"):
            int_range(1)
        return
    half = 2 ** (bits - 1)
    assert int_range(bits) == (half - 1, -half, half - 1)  # two's complement
    assert int_range(bits, narrow_range=True) == (half - 1, -(half - 1), half - 1)  # symmetric
    assert format_range(bits, False, True) == int_range(bits, False, True)


@pytest.mark.parametrize("bad", [0, 17, -8])
def test_int_range_rejects_bad_widths(bad):
    with pytest.raises(ValueError, match=f"num_bits must be in 1..16, got {bad}"):
        int_range(bad)


@pytest.mark.parametrize("bad", [True, 8.0, "8", (4, 3)])
def test_int_range_rejects_non_ints(bad):
    with pytest.raises(TypeError, match="num_bits must be an int"):
        int_range(bad)


def test_code_types_match_torch_numpy_and_onnx():
    onnx = pytest.importorskip("onnx")
    assert set(CODE_TYPES) == {"int4", "uint4", "int8", "uint8", "int16", "uint16", "int32"}
    for name, c in CODE_TYPES.items():
        signed = name.startswith("int")
        bits = int(name.lstrip("uint"))
        assert (c.lo, c.hi) == ((-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)), name
        assert c.onnx_type == name.upper()
        elem = getattr(onnx.TensorProto, c.onnx_type)
        if bits == 4:
            assert c.torch_dtype is None and c.numpy_dtype is None and c.onnx_opset == 21
            continue
        assert (torch.iinfo(c.torch_dtype).min, torch.iinfo(c.torch_dtype).max) == (c.lo, c.hi), name
        assert (np.iinfo(c.numpy_dtype).min, np.iinfo(c.numpy_dtype).max) == (c.lo, c.hi), name
        assert onnx.helper.tensor_dtype_to_np_dtype(elem) == np.dtype(c.numpy_dtype), name
    # QuantizeLinear/DequantizeLinear: 8-bit (and the int32 DQ input) since opset 10; 4/16-bit since opset 21
    assert {n: c.onnx_opset for n, c in CODE_TYPES.items()} == {
        "int4": 21,
        "uint4": 21,
        "int8": 10,
        "uint8": 10,
        "int16": 21,
        "uint16": 21,
        "int32": 10,
    }
    assert (INT32.lo, INT32.hi) == (torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max)
    assert getattr(onnx.TensorProto, formats.E4M3_ONNX_TYPE) == onnx.TensorProto.FLOAT8E4M3FN


def test_search_orders_are_smallest_first():
    for names in (TORCH_CODE_TYPES, ONNX_ACTIVATION_TYPES, ONNX_WEIGHT_TYPES):
        sizes = [CODE_TYPES[n].hi - CODE_TYPES[n].lo for n in names]
        assert sizes == sorted(sizes), names
    assert smallest_code_type(0, 15) is CODE_TYPES["int8"]
    assert smallest_code_type(0, 15, ONNX_WEIGHT_TYPES) is CODE_TYPES["uint4"]
    assert smallest_code_type(-8, 7, ONNX_WEIGHT_TYPES) is CODE_TYPES["int4"]
    assert smallest_code_type(0, 255) is CODE_TYPES["uint8"]
    assert smallest_code_type(-1, 255) is CODE_TYPES["int16"]
    assert smallest_code_type(0, 2**16 - 1) is CODE_TYPES["int32"]
    assert smallest_code_type(0, 2**16 - 1, ONNX_ACTIVATION_TYPES) is CODE_TYPES["uint16"]
    assert smallest_code_type(-1, 2**16 - 1, ONNX_ACTIVATION_TYPES) is None


@pytest.mark.parametrize("bits,unsigned,narrow", FORMATS)
def test_torch_code_dtype_holds_the_format_and_keeps_its_sign(bits, unsigned, narrow):
    _, qmin, qmax = int_range(bits, unsigned, narrow)
    dt = torch_code_dtype(bits, unsigned)
    assert torch.iinfo(dt).min <= qmin and qmax <= torch.iinfo(dt).max
    assert dt == {(True, False): torch.int8, (True, True): torch.uint8, (False, False): torch.int16}.get(
        (bits <= 8, unsigned), torch.int32
    )


def test_e4m3_constants_and_cast():
    f8 = torch.float8_e4m3fn
    assert formats.E4M3_DTYPE is f8
    assert E4M3_MAX == torch.finfo(f8).max == 448.0
    assert format_range((4, 3)) == (448.0, -448.0, 448.0)
    lv = formats.e4m3_levels()
    assert lv.dtype == torch.float64 and lv.numel() == 127 and bool(torch.isfinite(lv).all())
    assert bool((lv[1:] > lv[:-1]).all()) and lv[0].item() == 0.0 and lv[-1].item() == E4M3_MAX
    assert lv[1].item() == 2.0**-9  # the smallest subnormal
    v = torch.tensor([1e6, -1e6, 449.0, 0.3, float("nan"), -0.0])
    got = formats.to_e4m3(v)
    assert got.dtype == f8
    assert got.float()[:4].tolist() == [448.0, -448.0, 448.0, v[3:4].to(f8).float().item()]
    assert torch.isnan(got.float()[4]) and torch.signbit(got.float()[5])
    codes = formats.e4m3_codes(torch.tensor([[3.0, -1000.0], [5.0, 7.0]]), torch.tensor([[0.5], [0.0]]))
    assert codes.dtype == f8 and codes.float().tolist() == [[6.0, -448.0], [0.0, 0.0]]  # dead row -> 0


def test_bias_codes_saturate_to_the_int32_table():
    big = torch.tensor([1e30, -1e30, 3.0])
    q = requant.bias_codes(big, torch.tensor([1e-10, 1e-10, 2.0]))
    assert q.dtype == torch.float64 and q.tolist() == [INT32.hi, INT32.lo, 2.0]  # 1.5 -> 2 (half to even)


# --- the layers ask formats.py -----------------------------------------------------------------------------------
def test_layers_use_the_formats_functions():
    """The modules that used to keep their own tables now hold formats.py's functions (same objects)."""
    mods = {
        n: importlib.import_module(f"modelopt_lite.{n}")
        for n in (
            "tensor_quant",
            "nn.tensor_quantizer",
            "nn._scale_report",  # TensorQuantizer.maxbound
            "nn._quantizer_export",
            "functional.lowlevel",
            "functional.scales",
            "functional.reference",
            "calib.quant_error",
            "analysis.int8_quantizer",
            "real.convert",
            "real.modules",
        )
    }
    assert mods["tensor_quant"].float_codes is formats.float_codes  # E4M3, E5M2, E2M1 codes
    assert mods["tensor_quant"].torch_dtype_range is formats.torch_dtype_range
    assert mods["nn._quantizer_export"].torch_code_dtype is formats.torch_code_dtype  # TensorQuantizer's code export
    assert mods["nn._quantizer_export"].format_range is formats.format_range
    assert mods["nn._scale_report"].format_range is formats.format_range
    assert mods["functional.lowlevel"].smallest_code_type is formats.smallest_code_type
    assert mods["functional.scales"].format_range is formats.format_range
    assert mods["functional.reference"].to_e4m3 is formats.to_e4m3
    assert mods["calib.quant_error"].float_levels is formats.float_levels
    for n in ("analysis.int8_quantizer", "real.convert", "real.modules"):
        assert mods[n].int_range is formats.int_range, n
    assert requant.INT32 is formats.INT32
    for mod, old in (
        ("tensor_quant", "_INT_DTYPES"),
        ("nn.tensor_quantizer", "_CODE_DTYPES"),
        ("nn._quantizer_export", "_CODE_DTYPES"),
        ("functional.lowlevel", "_CODE_DTYPES"),
    ):
        assert not hasattr(mods[mod], old), f"{mod} keeps its own table {old}"


def test_onnx_export_uses_the_formats_tables():
    pytest.importorskip("onnx")
    from onnx import TensorProto

    from modelopt_lite.onnx_export import ort_layout, qdq, weights

    assert qdq.smallest_code_type is weights.smallest_code_type is formats.smallest_code_type
    assert weights.float_codes is formats.float_codes
    assert ort_layout.requant is requant  # int32 bias codes: the function the torch layers use
    assert not hasattr(qdq, "_CONTAINERS") and not hasattr(weights, "_INT_TYPES")
    for bits, unsigned, narrow in FORMATS:
        _, qmin, qmax = int_range(bits, unsigned, narrow)
        c = smallest_code_type(qmin, qmax, ONNX_ACTIVATION_TYPES)
        elem, np_t, lo, hi = qdq.container(qmin, qmax, 21, "x")
        assert (elem, np_t, lo, hi) == (getattr(TensorProto, c.onnx_type), c.numpy_dtype, c.lo, c.hi)
        want_w = "INT4" if -8 <= qmin and qmax <= 7 else "UINT4" if bits <= 4 else None  # unsigned 1..3 bits fit INT4
        if want_w:
            assert weights.storage_type("FakeQuantInt", qmin, qmax, 21, "w") == getattr(TensorProto, want_w)
        assert weights.storage_type("FakeQuantInt", qmin, qmax, 21, "w") == getattr(
            TensorProto, smallest_code_type(qmin, qmax, ONNX_WEIGHT_TYPES).onnx_type
        )
        if bits <= 8:  # opset 13: 8-bit containers only
            want = "UINT8" if unsigned and qmax > 127 else "INT8"
            assert weights.storage_type("FakeQuantInt", qmin, qmax, 13, "w") == getattr(TensorProto, want)
            assert qdq.container(qmin, qmax, 13, "x")[0] == getattr(TensorProto, want)


@pytest.mark.parametrize("bits,unsigned,narrow", [f for f in FORMATS if f[0] in (2, 4, 7, 8, 9, 12, 16)])
def test_quantizers_report_the_formats_ranges_and_dtypes(bits, unsigned, narrow):
    bound, qmin, qmax = int_range(bits, unsigned, narrow)
    tq = TensorQuantizer(ScaledQuantDescriptor(num_bits=bits, unsigned=unsigned, narrow_range=narrow, axis=0))
    w = torch.linspace(-1.0, 1.0, 24).reshape(3, 8)
    w = w.abs() if unsigned else w
    tq.amax = w.abs().amax(1, keepdim=True)
    assert tq.maxbound == bound
    info = tq.export_info()
    assert (info["qmin"], info["qmax"]) == (qmin, qmax)
    q, _ = tq.quantize_weight_codes(w)
    assert q.dtype == torch_code_dtype(bits, unsigned)
    assert int(q.min()) >= qmin and int(q.max()) <= qmax and int(q.abs().max()) == bound
    assert lowlevel.code_dtype(qmin, qmax) == smallest_code_type(qmin, qmax).torch_dtype


def test_e4m3_quantizer_reports_the_e4m3_range():
    tq = TensorQuantizer(ScaledQuantDescriptor(num_bits=(4, 3), axis=None))
    tq.amax = torch.tensor(2.0)
    info = tq.export_info()
    assert tq.maxbound == E4M3_MAX and (info["qmin"], info["qmax"]) == (-E4M3_MAX, E4M3_MAX)
    q, s = tq.quantize_weight_codes(torch.tensor([2.0, -4.0, 0.5]))
    assert q.dtype == torch.float8_e4m3fn and q.float().tolist() == [448.0, -448.0, 112.0]
    assert s.item() == pytest.approx(2.0 / 448.0)
