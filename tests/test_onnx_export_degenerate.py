"""export_onnx on degenerate quantizers and the graphs ORT likes to rewrite: dead (amax 0) activations for extreme
inputs, INT4/INT8 blocked weights that ORT would fuse into MatMulNBits, double-quantized block scales, empty inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, numpy_helper
from onnx_helpers import make_model

import modelopt_lite as mtq
import modelopt_lite.tensor_quant as tq
from modelopt_lite.onnx_export import export_onnx
from modelopt_lite.onnx_export.ort_runner import has_blocked_weights, ort_session

EXPORTERS = [pytest.param(False, id="torchscript"), pytest.param(True, id="dynamo")]
F32_MAX = float(np.finfo(np.float32).max)


def run(path, *inputs, **kw):
    sess = ort_session(path, **kw)
    return sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)})


def graph(path):
    m = onnx.load(str(path))
    return list(m.graph.node), {t.name: t for t in m.graph.initializer}


def assert_same_bits(got: np.ndarray, want: torch.Tensor) -> None:
    got_t = torch.from_numpy(np.ascontiguousarray(got))
    assert got_t.dtype == want.dtype and got_t.shape == want.shape
    assert torch.equal(got_t, want)


def assert_plus_zeros(got: np.ndarray) -> None:
    """Dead slices give +0 (never -0), as torch's dead slices do."""
    assert not got.any() and not np.signbit(got).any()


# --- dead activation quantizers ------------------------------------------------------------------------------------
class DeadActivations(nn.Module):
    """Dead (amax 0) quantizers of every activation form, one after a live quantizer (its DQ feeds the dead one)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("zero", torch.tensor(0.0))
        self.register_buffer("two", torch.tensor(2.0))
        self.register_buffer("chan", torch.tensor([0.0, 1.0, 0.0]).reshape(1, 3, 1))  # channels 0 and 2 dead

    def forward(self, x):
        return (
            tq.fake_tensor_quant(x, self.zero, 8, narrow_range=False),
            tq.fake_tensor_quant(x, self.chan, 8, narrow_range=True),  # narrow range: a Clip as well
            tq.fake_tensor_quant(x.abs(), self.zero, 8, unsigned=True),
            tq.fake_tensor_quant(x, self.zero, 4),
            tq.fake_tensor_quant(tq.fake_tensor_quant(x, self.two, 8), self.zero, 8),
        )


def extreme_input() -> torch.Tensor:
    vals = [
        3e38,
        -3e38,
        F32_MAX,
        -F32_MAX,
        1e37,
        -1e37,
        2.0**126,
        2.0**125 * 1.5,
        0.75,
        -0.0,
        float("inf"),
        -float("inf"),
    ]
    row = torch.tensor(vals, dtype=torch.float32)
    return torch.stack([row, row * 0.5, -row]).unsqueeze(0).repeat(2, 1, 1)  # (2, 3, 12)


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_dead_activations_give_zeros_for_any_input(tmp_path, dynamo):
    """torch gives exact +0 in dead slices for every input; so must ORT (it gave 3e38-sized values before)."""
    m, x = DeadActivations(), extreme_input()
    rep = export_onnx(m, x, tmp_path / "d.onnx", dynamo=dynamo, opset=18 if dynamo else 17)
    outs = run(tmp_path / "d.onnx", x)
    wants = m(x)
    assert not wants[0].any() and wants[1][:, 1].abs().max() == 1.0  # the live channel saturates at +-1
    for got, want in zip(outs, wants):
        assert_same_bits(got, want)
    for got in (outs[0], outs[1][:, 0], outs[1][:, 2], outs[2], outs[3], outs[4]):
        assert_plus_zeros(got)
    nodes, inits = graph(tmp_path / "d.onnx")
    where = [n for n in nodes if n.op_type == "Where"]
    assert len(where) == 5
    masks = sorted(numpy_helper.to_array(inits[n.input[0]]).reshape(-1).tolist() for n in where)
    assert masks == [[False]] * 4 + [[False, True, False]]
    assert sum("dead activation scale" in n for n in rep.notes) == 5


def test_dead_e4m3_activation_gives_zeros(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            return tq.scaled_e4m3(x, torch.tensor(0.0)), tq.scaled_e4m3(x, torch.tensor([[[0.0], [448.0], [0.0]]]))

    m, x = M(), extreme_input()
    export_onnx(m, x, tmp_path / "e.onnx")
    outs = run(tmp_path / "e.onnx", x)
    for got, want in zip(outs, m(x)):
        assert_same_bits(got, want)
    for got in (outs[0], outs[1][:, 0], outs[1][:, 2]):
        assert_plus_zeros(got)


# --- blocked weights and ORT's MatMulNBits fusion ------------------------------------------------------------------
def exact_sum_linear(k: int, n: int, bits: int) -> nn.Module:
    """A Linear whose blocked fake-quant weights are multiples of 1/16 with power-of-two block scales (1/8 or 1/16,
    alternating between blocks of 128), for integer inputs: every product and partial sum is a float32 multiple of
    1/16, so ANY summation order gives the same bits. A kernel that quantizes the activations (MatMulNBits at its
    default accuracy level 4) does not."""
    g = torch.Generator().manual_seed(3)
    bound = 2 ** (bits - 1) - 1
    codes = torch.randint(-bound, bound + 1, (n, k), generator=g).float()
    codes[:, ::32] = bound  # every block holds +bound: block amax = bound * step, scale = step exactly
    step = torch.where((torch.arange(k) // 128 + torch.arange(n)[:, None]) % 2 == 0, 1 / 8, 1 / 16)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(codes * step)
        lin.bias.copy_(torch.randint(-16, 17, (n,), generator=g).float() / 8)
    return nn.Sequential(lin).eval()


@pytest.mark.parametrize("bits", [4, 8])
def test_blocked_weights_not_fused_into_matmulnbits(tmp_path, bits):
    m = exact_sum_linear(256, 64, bits)
    x = torch.randint(-8, 9, (2, 8, 256), generator=torch.Generator().manual_seed(4)).float()  # 3-D: MatMul
    config = {
        "quant_cfg": {
            "default": {"enable": False},
            "*weight_quantizer": {"num_bits": bits, "block_sizes": {-1: 32}, "enable": True},
        },
        "algorithm": "max",
    }
    if bits == 4:
        config = mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG  # blocks of 128: still multiples of 32
    mtq.quantize(m, config, lambda mm: mm(x))
    want = m(x).detach()
    assert torch.equal(want, x @ m[0].weight.detach().T + m[0].bias.detach())  # the weights are already on the grid
    export_onnx(m, x, tmp_path / "w.onnx")
    model = onnx.load(str(tmp_path / "w.onnx"))
    assert has_blocked_weights(model)
    (got,) = run(tmp_path / "w.onnx", x, optimized_model_path=str(tmp_path / "opt.onnx"))
    assert_same_bits(got, want)
    assert "MatMulNBits" not in {n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node}
    (fast,) = run(tmp_path / "w.onnx", x, exact=False, optimized_model_path=str(tmp_path / "fast.onnx"))
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(tmp_path / "fast.onnx")).graph.node}
    assert fast.shape == got.shape


# --- double-quantized block scales ---------------------------------------------------------------------------------
def dq_model(k=200, n=12, seed=5):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(k, n)).eval()
    with torch.no_grad():
        m[0].weight[3] = 0  # a dead row: every block scale 0
        m[0].weight[4, :16] = 1e-7  # a tiny block: its scale code rounds to 0 (dead after double quantization)
    return m


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize(
    "scale_bits,scale_blocks,scale_dtype",
    [(8, None, "UINT8"), ((4, 3), None, "FLOAT8E4M3FN"), (8, {0: 4}, "UINT8")],
    ids=["uint8", "e4m3", "uint8-grouped"],
)
def test_double_quantized_block_scales(tmp_path, dynamo, scale_bits, scale_blocks, scale_dtype):
    block_sizes = {-1: 16, "scale_bits": scale_bits}
    if scale_blocks is not None:
        block_sizes["scale_block_sizes"] = scale_blocks
    m, x = dq_model(), torch.randn(6, 200)
    config = {
        "quant_cfg": {
            "default": {"enable": False},
            "*weight_quantizer": {"num_bits": 4, "block_sizes": block_sizes, "enable": True},
        },
        "algorithm": "max",
    }
    mtq.quantize(m, config, lambda mm: mm(x))
    rep = export_onnx(m, x, tmp_path / "q.onnx", dynamo=dynamo)
    assert rep.opset == 21
    nodes, inits = graph(tmp_path / "q.onnx")
    dqs = {n.output[0]: n for n in nodes if n.op_type == "DequantizeLinear"}
    weight_dq = next(n for n in dqs.values() if inits[n.input[0]].data_type == TensorProto.INT4)
    scale_dq = dqs[weight_dq.input[1]]  # the block scales: a DequantizeLinear of their quantized codes
    assert TensorProto.DataType.Name(inits[scale_dq.input[0]].data_type) == scale_dtype
    assert {a.name: a.i for a in weight_dq.attribute} == {"axis": 1, "block_size": 16}
    assert all(numpy_helper.to_array(inits[s]).min() > 0 for s in scale_dq.input[1:2])
    # the exported scale codes dequantize to positive scales equal to the quantizer's double-quantized ones
    from onnx.reference import ReferenceEvaluator

    sub = make_model(
        onnx.helper.make_graph(
            [scale_dq],
            "s",
            [],
            [onnx.helper.make_value_info(scale_dq.output[0], onnx.TypeProto())],
            [inits[i] for i in scale_dq.input if i],
        ),
        21,
        ort=False,
    )
    (scales,) = ReferenceEvaluator(sub).run(None, {})
    wq_ = m[0].weight_quantizer
    raw, _ = tq.block_scales(m[0].weight.detach(), block_sizes, wq_.amax, 4, wq_.unsigned, wq_.narrow_range)
    raw = raw.numpy()  # torch's double-quantized block scales (0 where a block is dead)
    assert scales.dtype == np.float32 and scales.shape == raw.shape == (12, 13) and (scales > 0).all()
    live = raw > 0
    assert np.array_equal(scales[live], raw[live]) and (~live).sum() == 14  # row 3 and the tiny block
    (got,) = run(tmp_path / "q.onnx", x)  # the float Gemm after the DQs may round differently from torch's
    want = m(x).detach()
    assert np.abs(got - want.numpy()).max() <= 1e-5 * want.abs().max().item()
    # bit for bit: the weight the graph dequantizes equals the torch fake-quant weight
    wq = m[0].weight_quantizer(m[0].weight).detach()
    assert_same_bits(dequantized_weight(tmp_path / "q.onnx", weight_dq, scale_dq), wq)
    assert not wq[3].any() and not wq[4, :16].any()


def dequantized_weight(path, weight_dq, scale_dq) -> np.ndarray:
    """Run the two DequantizeLinear nodes alone in ONNX Runtime (the weight the graph multiplies by)."""
    _, inits = graph(path)
    g = onnx.helper.make_graph(
        [scale_dq, weight_dq],
        "w",
        [],
        [onnx.helper.make_tensor_value_info(weight_dq.output[0], TensorProto.FLOAT, None)],
        [inits[i] for n in (scale_dq, weight_dq) for i in n.input if i in inits],
    )
    model = make_model(g, 21)
    return ort_session(model, optimize=False).run(None, {})[0]


# --- empty example inputs ------------------------------------------------------------------------------------------
def test_empty_example_input_refused(tmp_path):
    """Quantizers skip empty tensors, so tracing an empty example would silently drop their Q/DQ."""
    x = torch.randn(8, 12)
    m = nn.Sequential(nn.Linear(12, 4)).eval()
    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            "*weight_quantizer": {"num_bits": 8, "axis": 0, "enable": True},
            "*input_quantizer": {"num_bits": 8, "enable": True},
        },
        "algorithm": "max",
    }
    mtq.quantize(m, cfg, lambda mm: mm(x))
    with pytest.raises(ValueError, match=r"example input 0 .*shape \(0, 12\).*0\.input_quantizer"):
        export_onnx(m, torch.randn(0, 12), tmp_path / "e.onnx")
    assert not (tmp_path / "e.onnx").exists()
    rep = export_onnx(m, x, tmp_path / "f.onnx", dynamic_axes={"input": {0: "batch"}})  # the way to do it
    assert rep.qdq_counts["QuantizeLinear INT8 per-tensor"] == 1


# --- non-finite amax -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_amax_named(tmp_path, bad):
    class F(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("act_amax", torch.tensor(bad))

        def forward(self, x):
            return tq.fake_tensor_quant(x, self.act_amax, 8)

    with pytest.raises(ValueError, match=r"amax must be finite.*non-finite values in act_amax"):
        export_onnx(F(), torch.randn(3, 4), tmp_path / "f.onnx")
    x = torch.randn(8, 12)
    m = nn.Sequential(nn.Linear(12, 4)).eval()
    cfg = {"quant_cfg": {"default": {"enable": False}, "*input_quantizer": {"num_bits": 8, "enable": True}}}
    mtq.quantize(m, dict(cfg, algorithm="max"), lambda mm: mm(x))
    m[0].input_quantizer.amax = torch.tensor(1.0)
    with torch.no_grad():
        m[0].input_quantizer._amax.fill_(bad)
    with pytest.raises(ValueError, match=r"0\.input_quantizer.*amax must be finite"):
        export_onnx(m, x, tmp_path / "m.onnx")
