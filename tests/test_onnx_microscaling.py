"""NVFP4 and OCP MX in standard ONNX (onnx_export/microscaling.py): the nodes written for weights and activations run
in onnx's ReferenceEvaluator (ONNX Runtime 1.32 has no FLOAT4E2M1/FLOAT8E8M0 kernels) bit for bit to the reference
(functional/microscaling.py), incl. ties, saturation, subnormals, dead and partial blocks."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx_helpers import gemm_weight, make_model

from modelopt_lite.formats import E2M1_VALUES
from modelopt_lite.functional import microscaling as mx
from modelopt_lite.onnx_export import microscaling as M
from modelopt_lite.onnx_export.graph import Graph, OpsetTooLow

ELEMS = ("e4m3", "e5m2", "e2m1", "int8")


def _run(build, x: torch.Tensor, opset: int, weight: bool) -> torch.Tensor:
    shape = list(x.shape)
    inputs = [] if weight else [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    m = make_model(helper.make_graph([], "g", inputs, [out]), opset, ort=False)
    g = Graph(m)
    nodes, _ = build(g)
    g.nodes += nodes
    m = g.commit()
    onnx.checker.check_model(m, full_check=True)
    feeds = {} if weight else {"x": x.numpy()}
    return torch.from_numpy(ReferenceEvaluator(m).run(None, feeds)[0])


def _data(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    x[0, ..., :16] = 0.0  # a dead block
    x.view(-1)[5] = 1e-41  # a subnormal
    return x


def _ties(n_blocks: int = 4) -> torch.Tensor:
    """Every E2M1 tie and saturation (block amax 6 so the block scale maps values onto the grid exactly)."""
    mids = [(a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:])]
    vals = [6.0, *mids, 7.0, 5.5, 0.1] + [-v for v in mids]
    row = torch.tensor((vals * 4)[:32], dtype=torch.float32)
    return torch.stack([row * (2.0**k) for k in range(n_blocks)])


def _assert_same(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype == torch.float32 and y.shape == ref.shape
    assert torch.equal(y, ref), f"{int((y != ref).sum())} of {y.numel()} elements differ"


@pytest.mark.parametrize("shape", [(4, 64), (3, 5, 48), (2, 37), (7, 16)])
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "activation"])
def test_nvfp4_bit_exact(shape, weight):
    x = _data(shape)
    gs = mx.nvfp4_global_scale(x.abs().max())
    ref = mx.fake_nvfp4(x, gs, 16)
    if weight:
        y = _run(lambda g: M.nvfp4_weight(g, x, float(gs), 16, "y", 23, "w"), x, 23, True)
    else:
        y = _run(lambda g: M.nvfp4_activation(g, "x", "y", float(gs), 16, 23, "a"), x, 23, False)
    _assert_same(y, ref)


@pytest.mark.parametrize("weight", [True, False], ids=["weight", "activation"])
def test_nvfp4_ties_and_static_saturation(weight):
    x = _ties()
    gs = mx.nvfp4_global_scale(torch.tensor(6.0 * 448 / 4))  # a static amax below the data's: scales saturate
    ref = mx.fake_nvfp4(x, gs, 16)
    build = (
        (lambda g: M.nvfp4_weight(g, x, float(gs), 16, "y", 23, "w"))
        if weight
        else (lambda g: M.nvfp4_activation(g, "x", "y", float(gs), 16, 23, "a"))
    )
    _assert_same(_run(build, x, 23, weight), ref)


def test_nvfp4_dead_tensor_gives_zeros():
    x = _data((2, 32))
    y = _run(lambda g: M.nvfp4_activation(g, "x", "y", 0.0, 16, 23, "a"), x, 23, False)
    _assert_same(y, torch.zeros_like(x))


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
@pytest.mark.parametrize("shape", [(4, 64), (3, 2, 45)])
def test_mx_bit_exact(elem, rounding, shape):
    x = _data(shape)
    x.view(-1, shape[-1])[1, :32] = _ties(1)[0] * 8.0  # every E2M1 tie and a saturating value in one block
    ref = mx.fake_mx(x, elem, 32, rounding)
    for opset in (23, 24):
        y = _run(lambda g, o=opset: M.mx_weight(g, x, elem, 32, rounding, "y", o, "w"), x, opset, True)
        _assert_same(y, ref)
    y = _run(lambda g: M.mx_activation(g, "x", "y", elem, 32, rounding, 24, "a"), x, 24, False)
    _assert_same(y, ref)


def test_mx_weight_storage_types():
    x = _data((2, 64))
    m = make_model(helper.make_graph([], "g", [], []), 24, ort=False)
    g = Graph(m)
    _, info = M.mx_weight(g, x, "e2m1", 32, "floor", "y", 24, "w")
    types = {t.name: t.data_type for t in g.inits.values()}
    assert info["dtype"] == "FLOAT4E2M1" and info["scales"]["dtype"] == "FLOAT8E8M0"
    assert sorted(types.values()) == sorted([TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E8M0])
    q = next(t for t in g.inits.values() if t.data_type == TensorProto.FLOAT4E2M1)
    assert len(q.raw_data) == 64  # two codes per byte
    g2 = Graph(make_model(helper.make_graph([], "g", [], []), 23, ort=False))
    _, info = M.mx_weight(g2, x, "e4m3", 32, "floor", "y", 23, "w")
    assert info["scales"]["dtype"] == "FLOAT"  # no E8M0 DequantizeLinear scales before opset 24


def test_opset_too_low_names_the_site():
    x = _data((2, 32))
    g = Graph(make_model(helper.make_graph([], "g", [], []), 21, ort=False))
    with pytest.raises(OpsetTooLow, match=r"layer\.w: FP4 \(FLOAT4E2M1\) weights need opset >= 23, got opset 21"):
        M.nvfp4_weight(g, x, 0.01, 16, "y", 21, "layer.w")
    with pytest.raises(OpsetTooLow, match=r"MX \(e4m3\) activations .* need opset >= 24"):
        M.mx_activation(g, "x", "y", "e4m3", 32, "floor", 23, "act")


# --- end to end: export_onnx of NVFP4 / MX models ------------------------------------------------------------------
def _model_quantized(fmt_cfg: dict):
    import modelopt_lite as mtq

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 40)).eval()
    x = torch.randn(8, 64) * torch.logspace(-2, 1, 64)
    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            "*weight_quantizer": dict(fmt_cfg, enable=True),
            "*input_quantizer": dict(fmt_cfg, enable=True),
        },
        "algorithm": "max",
    }
    return mtq.quantize(model, cfg, lambda m: m(x)), x


_NVFP4_CFG = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, "axis": None}


def _mx_cfg(num_bits):
    return {"num_bits": num_bits, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}, "axis": None}


@pytest.mark.parametrize(
    "name,cfg",
    [("nvfp4", _NVFP4_CFG), ("mxfp8", _mx_cfg((4, 3))), ("mxfp4", _mx_cfg((2, 1))), ("mxint8", _mx_cfg(8))],
)
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_export_onnx_runs_to_the_torch_output(tmp_path, name, cfg, dynamo):
    import modelopt_lite as mtq

    q, x = _model_quantized(cfg)
    with torch.no_grad():
        ref = q(x)
    path = tmp_path / f"{name}.onnx"
    rep = mtq.export_onnx(q, x, path, dynamo=dynamo)
    m = onnx.load(path)
    assert rep.opset == (23 if name == "nvfp4" else 24)
    assert not [n for n in m.graph.node if n.domain not in ("", "ai.onnx")]  # standard ONNX only
    types = {t.data_type for t in m.graph.initializer}
    want = {"nvfp4": TensorProto.FLOAT4E2M1, "mxfp8": TensorProto.FLOAT8E4M3FN, "mxfp4": TensorProto.FLOAT4E2M1}
    assert want.get(name, TensorProto.INT8) in types
    assert (TensorProto.FLOAT8E8M0 in types) == (name != "nvfp4")
    assert len(rep.weights) == 2 and len(rep.activations) == 2
    (y,) = ReferenceEvaluator(m).run(None, {rep.path and m.graph.input[0].name: x.numpy()})
    # the float ops between quantizers (GEMM, GELU) run in the evaluator's numpy: re-quantized values may move
    # by one step where the float input already differs; the first layer's output is exact
    yt = torch.from_numpy(y)
    assert yt.shape == ref.shape and yt.dtype == torch.float32
    assert float((yt - ref).abs().max()) <= 0.05 * float(ref.abs().max())


@pytest.mark.parametrize("name,cfg", [("nvfp4", _NVFP4_CFG), ("mxfp4", _mx_cfg((2, 1))), ("mxint8", _mx_cfg(8))])
def test_export_quantized_tensors_bit_exact(tmp_path, name, cfg):
    """The Q/DQ outputs feeding the GEMM equal the torch quantizers' outputs bit for bit (weight and input)."""
    import modelopt_lite as mtq

    q, x = _model_quantized(cfg)
    lin = q[0]
    path = tmp_path / "one.onnx"
    mtq.export_onnx(lin, x, path)
    m = onnx.load(path)
    gemm, w_name, prod = gemm_weight(m)
    assert prod[w_name].op_type == "DequantizeLinear"
    ev = ReferenceEvaluator(m)
    a, w = ev.run([gemm.input[0], w_name], {m.graph.input[0].name: x.numpy()})
    with torch.no_grad():
        ref_a, ref_w = lin.input_quantizer(x), lin.weight_quantizer(lin.weight)
    a, w = torch.from_numpy(a), torch.from_numpy(w)
    if tuple(w.shape) != tuple(ref_w.shape):
        w = w.T
    _assert_same(a, ref_a)
    _assert_same(w, ref_w)


@pytest.mark.parametrize(
    "name,cfg", [("mxfp8", _mx_cfg((4, 3))), ("mxfp8_e5m2", _mx_cfg((5, 2))), ("mxint8", _mx_cfg(8))]
)
def test_onnxruntime_runs_mx_weights_at_opset_23(tmp_path, name, cfg):
    """Where ORT has the types (FP8/INT8 codes with float32 block scales, opset 23) it runs the export too; the
    E8M0 scales of opset 24 and FLOAT4E2M1 have no ORT 1.32 CPU kernels (the ReferenceEvaluator tests above)."""
    import onnxruntime as ort

    import modelopt_lite as mtq
    from modelopt_lite.conversion import named_quantizers

    q, x = _model_quantized(cfg)
    for n, qq in named_quantizers(q):
        if n.endswith("input_quantizer"):
            qq.disable()
    path = tmp_path / f"{name}.onnx"
    rep = mtq.export_onnx(q, x, path, opset=23)
    assert all(w["scales"]["dtype"] == "FLOAT" for w in rep.weights)
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = s.run(None, {s.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        ref = q(x)
    assert torch.allclose(torch.from_numpy(y), ref, rtol=1e-5, atol=1e-6)  # GEMM summation order only
