"""The numerics contract with ONNX Runtime: one-node Q -> DQ graphs reproduce fake quantization bit for bit.

Each graph is built by hand with ``onnx.helper`` and run by ONNX Runtime's CPU provider; the torch side is the
public functional API (``fake_tensor_quant``, ``scaled_e4m3``, ``fake_affine_tensor_quant``, ``fake_block_quant``).
Also proven here: the exactness rules the exporter relies on (Clip before Q for narrow/sub-8-bit grids, uint8 with
zero point +128 instead of int8, the positive dead-channel scale, INT4 nibble packing).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper
from onnx_helpers import make_model

import modelopt_lite.tensor_quant as tq
from modelopt_lite.onnx_export import qdq, weights


def run_graph(nodes, inits, x: np.ndarray, opset: int, out_type=TensorProto.FLOAT) -> np.ndarray:
    graph = helper.make_graph(
        nodes,
        "contract",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", out_type, x.shape)],
        inits,
    )
    model = make_model(graph, opset)
    onnx.checker.check_model(model, full_check=True)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def qdq_graph(scale, zp, axis=None, q_attrs=None, clip=None):
    """x -> [Clip] -> Q -> DQ -> y with the given scale / zero point initializers."""
    inits = [numpy_helper.from_array(np.asarray(scale, np.float32), "s"), zp]
    attrs = {} if axis is None else {"axis": axis}
    nodes = []
    src = "x"
    if clip is not None:
        inits += [
            numpy_helper.from_array(np.float32(clip[0]), "lo"),
            numpy_helper.from_array(np.float32(clip[1]), "hi"),
        ]
        nodes.append(helper.make_node("Clip", ["x", "lo", "hi"], ["xc"]))
        src = "xc"
    nodes += [
        helper.make_node("QuantizeLinear", [src, "s", "zp"], ["q"], **attrs, **(q_attrs or {})),
        helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], **attrs),
    ]
    return nodes, inits


def zp_tensor(values, dtype):
    return numpy_helper.from_array(np.asarray(values).astype(dtype), "zp")


def hard_inputs(scale: float, n: int = 20000, seed: int = 0) -> torch.Tensor:
    """Random values, exact .5 ties, grid points, values far beyond the range, zeros and signed zeros."""
    g = torch.Generator().manual_seed(seed)
    k = torch.arange(-140, 141, dtype=torch.float32)
    ties = (k + 0.5) * scale
    return torch.cat(
        [
            torch.randn(n, generator=g) * 60 * scale,
            ties,
            k * scale,
            torch.tensor([0.0, -0.0]),
            torch.tensor([1e6, -1e6]) * scale,
            torch.rand(2000, generator=g) * 1e-3 * scale,
        ]
    )


def assert_bits_equal(ort_out: np.ndarray, torch_out: torch.Tensor):
    assert ort_out.dtype == np.float32
    assert torch.equal(torch.from_numpy(ort_out), torch_out), f"max diff {np.abs(ort_out - torch_out.numpy()).max()}"


# --- INT8 ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("amax", [1.0, 2.5, 0.0137, 3.3e-3])
def test_int8_per_tensor(amax):
    scale = np.float32(amax) / np.float32(127)
    x = hard_inputs(float(scale))
    ref = tq.fake_tensor_quant(x, torch.tensor(amax), 8, unsigned=False, narrow_range=False)
    nodes, inits = qdq_graph(scale, zp_tensor(0, np.int8))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


def test_int8_true_division_not_reciprocal():
    """ORT divides by the scale; a reciprocal multiply would differ on some of these values."""
    scale = np.float32(0.0137) / np.float32(127)
    ties = ((np.arange(-130, 130).astype(np.float32) + np.float32(0.5)) * scale).astype(np.float32)
    near = np.concatenate([ties.view(np.int32) + d for d in range(-3, 4)]).view(np.float32)  # ulps around ties
    x = torch.cat(
        [torch.from_numpy(near), torch.randn(20000, generator=torch.Generator().manual_seed(1)) * 50 * float(scale)]
    )
    by_mul = torch.clamp(torch.round(x * (1 / torch.tensor(scale))), -128, 127) * torch.tensor(scale)
    ref = tq.fake_tensor_quant(x, torch.tensor(0.0137), 8, narrow_range=False)
    assert not torch.equal(by_mul, ref)  # the check below can fail
    nodes, inits = qdq_graph(scale, zp_tensor(0, np.int8))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


@pytest.mark.parametrize("axis", [0, 1, 3])
def test_int8_per_channel(axis):
    g = torch.Generator().manual_seed(axis)
    x = torch.randn(6, 5, 2, 7, generator=g) * 3
    shape = [1] * 4
    shape[axis] = x.shape[axis]
    amax = torch.rand(shape, generator=g) * 2 + 0.1
    ref = tq.fake_tensor_quant(x, amax, 8, narrow_range=False)
    scale = (amax.reshape(-1) / 127).numpy()
    nodes, inits = qdq_graph(scale, zp_tensor(np.zeros(scale.size), np.int8), axis=axis)
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


@pytest.mark.parametrize("amax", [1.0, 0.37])
def test_narrow_range_needs_clip_and_clip_is_exact(amax):
    scale = np.float32(amax) / np.float32(127)
    x = hard_inputs(float(scale), seed=2)
    ref = tq.fake_tensor_quant(x, torch.tensor(amax), 8, narrow_range=True)
    plain, inits = qdq_graph(scale, zp_tensor(0, np.int8))
    assert not torch.equal(torch.from_numpy(run_graph(plain, inits, x.numpy(), 13)), ref)  # -128 leaks without it
    lo, hi = np.float32(-127) * scale, np.float32(127) * scale
    nodes, inits = qdq_graph(scale, zp_tensor(0, np.int8), clip=(lo, hi))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


@pytest.mark.parametrize("bits", [2, 4, 6, 7])
def test_sub_8bit_grid_via_clip_is_exact(bits):
    amax = 0.9
    bound = 2 ** (bits - 1) - 1
    scale = np.float32(amax) / np.float32(bound)
    x = hard_inputs(float(scale), seed=bits)
    ref = tq.fake_tensor_quant(x, torch.tensor(amax), bits, narrow_range=False)
    lo, hi = np.float32(-bound - 1) * scale, np.float32(bound) * scale
    nodes, inits = qdq_graph(scale, zp_tensor(0, np.int8), clip=(lo, hi))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


def test_unsigned_uint8():
    amax = 4.2
    scale = np.float32(amax) / np.float32(255)
    x = hard_inputs(float(scale), seed=3).abs()
    ref = tq.fake_tensor_quant(x, torch.tensor(amax), 8, unsigned=True)
    nodes, inits = qdq_graph(scale, zp_tensor(0, np.uint8))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


def test_int8_as_uint8_with_zero_point_128_is_identical():
    """The onnxruntime layout stores int8 Q/DQ as uint8 with zero point +128: same values, bit for bit."""
    amax = 1.7
    scale = np.float32(amax) / np.float32(127)
    x = hard_inputs(float(scale), seed=4)
    ref = tq.fake_tensor_quant(x, torch.tensor(amax), 8, narrow_range=False)
    nodes, inits = qdq_graph(scale, zp_tensor(128, np.uint8))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


@pytest.mark.parametrize("lo,hi", [(-0.3, 2.0), (0.5, 3.0), (-4.0, -1.0), (-1.0, 1.0)])
def test_affine(lo, hi):
    x = torch.linspace(-6, 6, 30001)
    ref = tq.fake_affine_tensor_quant(x, lo, hi, 8)
    _, _, zp = tq.affine_tensor_quant(x, lo, hi, 8)
    from modelopt_lite.functional.scales import affine_params

    scale, zp2, _, _ = affine_params(torch.tensor(lo), torch.tensor(hi), 8)
    assert float(zp) == float(zp2)
    nodes, inits = qdq_graph(scale.numpy(), zp_tensor(zp2.numpy(), np.int8))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 13), ref)


def test_dead_scale_exports_positive_and_gives_zeros():
    x = torch.cat([torch.randn(1000) * 1e6, torch.tensor([0.0, -0.0, 3.4e37, -1e30, 2.0**110])])
    ref = tq.fake_tensor_quant(x, torch.tensor(0.0), 8, narrow_range=False)
    assert torch.equal(ref, torch.zeros_like(x))
    nodes, inits = qdq_graph(qdq.DEAD_SCALE, zp_tensor(0, np.int8))
    out = run_graph(nodes, inits, x.numpy(), 13)
    assert qdq.DEAD_SCALE > 0 and np.isfinite(qdq.DEAD_SCALE)
    assert torch.equal(torch.from_numpy(out), ref)  # int8: every finite |x| < 2**125 gives code 0
    x = x[x.abs() < 2.0**115]  # E4M3 keeps 2**-9 as its smallest step: code 0 for |x| < 2**116
    e4m3_nodes, e4m3_inits = qdq_graph(
        qdq.DEAD_SCALE, weights.make_tensor("zp", np.float32(0), TensorProto.FLOAT8E4M3FN)
    )
    assert torch.equal(torch.from_numpy(run_graph(e4m3_nodes, e4m3_inits, x.numpy(), 19)), torch.zeros_like(x))


def test_int16_grid_at_opset21():
    amax = 3.0
    scale = np.float32(amax) / np.float32(2**11 - 1)
    x = hard_inputs(float(scale), seed=5) * 20
    ref = tq.fake_tensor_quant(x, torch.tensor(amax), 12, narrow_range=False)
    nodes, inits = qdq_graph(
        scale, zp_tensor(0, np.int16), clip=(np.float32(-(2**11)) * scale, np.float32(2**11 - 1) * scale)
    )
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 21), ref)
    ref16 = tq.fake_tensor_quant(x, torch.tensor(amax), 16, narrow_range=False)
    s16 = np.float32(amax) / np.float32(2**15 - 1)
    nodes, inits = qdq_graph(s16, zp_tensor(0, np.int16))
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 21), ref16)


# --- FP8 E4M3 ------------------------------------------------------------------------------------------------------
def e4m3_inputs(scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)]
    mids = (codes[:-1] + codes[1:]) / 2  # ties between neighbouring codes (after sorting)
    srt = torch.sort(codes).values
    ties = (srt[:-1] + srt[1:]) / 2
    v = torch.cat(
        [
            codes,
            mids,
            ties,
            torch.randn(20000, generator=g) * 100,
            torch.tensor([500.0, -1e4, 449.0, 464.0, 2.0**-10, -(2.0**-10)]),
        ]
    )
    return v * scale


@pytest.mark.parametrize("amax", [448.0, 1.0, 0.02])
def test_e4m3_opset19_saturating(amax):
    scale = np.float32(amax) / np.float32(448)
    x = e4m3_inputs(float(scale))
    ref = tq.scaled_e4m3(x, torch.tensor(amax))
    assert ref.abs().max().item() == pytest.approx(amax)  # saturates, never NaN from overflow
    zp = weights.make_tensor("zp", np.float32(0), TensorProto.FLOAT8E4M3FN)
    nodes, inits = qdq_graph(scale, zp, q_attrs={"saturate": 1})
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 19), ref)


def test_e4m3_per_channel():
    x = torch.randn(4, 9) * 30
    amax = torch.tensor([[1.0], [10.0], [50.0], [448.0]])
    ref = tq.scaled_e4m3(x, amax)
    scale = (amax.reshape(-1) / 448).numpy()
    zp = weights.make_tensor("zp", np.zeros(4, np.float32), TensorProto.FLOAT8E4M3FN)
    nodes, inits = qdq_graph(scale, zp, axis=0)
    assert_bits_equal(run_graph(nodes, inits, x.numpy(), 19), ref)


# --- stored weights ------------------------------------------------------------------------------------------------
def dq_graph(codes_tensor, scale, zp_tensor_, **attrs):
    inits = [codes_tensor, numpy_helper.from_array(np.asarray(scale, np.float32), "s"), zp_tensor_]
    codes_tensor.name, zp_tensor_.name = "w", "zp"
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["wd"], **attrs),
        helper.make_node("Add", ["x", "wd"], ["y"]),
    ]
    return nodes, inits


def test_int4_packing_low_nibble_first():
    raw = weights.pack_4bit(np.array([1, -2, 7]))
    assert raw == bytes([0x01 | (0xE << 4), 0x07])
    t = weights.make_tensor("w", np.array([[1, -2, 7], [-8, 0, 3]]), TensorProto.INT4)
    np.testing.assert_array_equal(numpy_helper.to_array(t).astype(np.int64), [[1, -2, 7], [-8, 0, 3]])


@pytest.mark.parametrize("k", [256, 200])  # 200: a last partial block
def test_int4_blocked_weight_dequantizes_like_fake_block_quant(k):
    w = torch.randn(6, k, generator=torch.Generator().manual_seed(k))
    w[2, :128] = 0  # a dead block
    blocks = {-1: 128}
    ref = tq.fake_block_quant(w, blocks, None, num_bits=4)
    scale, _ = tq.block_scales(w, blocks, None, num_bits=4)
    q, _ = tq.block_quant(w, blocks, None, num_bits=4)
    s = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = weights.make_tensor("w", q.numpy().astype(np.int64), TensorProto.INT4)
    zp = weights.make_tensor("zp", np.zeros(tuple(s.shape), np.int64), TensorProto.INT4)
    nodes, inits = dq_graph(codes, s.numpy(), zp, axis=1, block_size=128)
    out = run_graph(nodes, inits, np.zeros(w.shape, np.float32), 21)
    assert_bits_equal(out, ref)


def test_fp8_weight_initializer():
    w = torch.randn(5, 7) * 3
    amax = w.abs().amax(1, keepdim=True)
    ref = tq.scaled_e4m3(w, amax)
    fw = weights.fold("FakeE4M3", w.numpy(), (amax / 448).numpy(), None, 0, 0, "w")
    codes = weights.make_tensor("w", fw.codes, TensorProto.FLOAT8E4M3FN)
    zp = weights.make_tensor("zp", np.zeros(5, np.float32), TensorProto.FLOAT8E4M3FN)
    nodes, inits = dq_graph(codes, (amax / 448).reshape(-1).numpy(), zp, axis=0)
    assert_bits_equal(run_graph(nodes, inits, np.zeros(w.shape, np.float32), 19), ref)
