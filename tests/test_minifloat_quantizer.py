"""Per-tensor / per-channel FP8 E5M2 and FP4 E2M1 (float32 scales) through TensorQuantizer, calibration,
save/restore, export (ONNX Runtime for E5M2, onnx's ReferenceEvaluator for E2M1) and the error paths.

The expected values are built from first principles: each format's grid is enumerated from its bit layout (E5M2:
bias 15, 2 mantissa bits, subnormals below 2**-14; E2M1: bias 1, 1 mantissa bit), and every tie between two
neighbours rounds to the one with the even code (round half to even), every value past the top saturates.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.formats import element_format, float_levels
from modelopt_lite.functional import backend, library_minifloat
from modelopt_lite.nn import TensorQuantizer

E5M2, E2M1 = (5, 2), (2, 1)
FORMATS = [pytest.param(E5M2, id="e5m2"), pytest.param(E2M1, id="e2m1")]


def grid(nb) -> list[float]:
    """The non-negative finite values of an (E, M) format with IEEE-style bias, ascending (index == code)."""
    e_bits, m_bits = nb
    bias = 2 ** (e_bits - 1) - 1
    top_e = 2**e_bits - 1 if nb == E2M1 else 2**e_bits - 2  # E5M2 reserves its top exponent (Inf/NaN)
    out = [m / 2**m_bits * 2.0 ** (1 - bias) for m in range(2**m_bits)]  # subnormals (and 0)
    for e in range(1, top_e + 1):
        out += [(1 + m / 2**m_bits) * 2.0 ** (e - bias) for m in range(2**m_bits)]
    return out


def quantizer(nb, amax, **kw) -> TensorQuantizer:
    return TensorQuantizer(QuantDescriptor(num_bits=nb, amax=amax, **kw))


def test_grids_from_first_principles_match_the_formats():
    g5, g2 = grid(E5M2), grid(E2M1)
    assert (len(g5), g5[1], g5[4], g5[-1]) == (124, 2.0**-16, 2.0**-14, 57344.0)
    assert g2 == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for nb, g in ((E5M2, g5), (E2M1, g2)):
        assert float_levels(element_format(nb)).tolist() == g
        assert element_format(nb).bound == g[-1]


def _expected_cases(nb, step: float):
    """(x, y) pairs, in units of the scale ``step``: every tie, both sides of it, every level, saturation."""
    g = grid(nb)
    xs, ys = [], []
    for i in range(len(g) - 1):
        lo, hi = g[i], g[i + 1]
        mid = (lo + hi) / 2
        even = lo if i % 2 == 0 else hi
        eps = (hi - lo) / 8
        xs += [lo, mid, mid - eps, mid + eps]
        ys += [lo, even, lo, hi]
    top = g[-1]
    xs += [top, top * 1.25, top * 4, 1e30 / step]
    ys += [top, top, top, top]
    x = torch.tensor(xs, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    x, y = torch.cat([x, -x]), torch.cat([y, -y])
    return (x * step).float(), (y * step).float()


@pytest.mark.parametrize("nb", FORMATS)
@pytest.mark.parametrize("step_exp", [0, -10, 7])
def test_every_tie_level_and_saturation_through_the_quantizer(nb, step_exp):
    """Per tensor with a power-of-two scale (``amax = max * 2**k``: every x / scale below is exact)."""
    step = 2.0**step_exp
    x, want = _expected_cases(nb, step)
    q = quantizer(nb, element_format(nb).bound * step)
    assert torch.equal(q.scale, torch.tensor(step))
    got = q(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    neg_zero = (x < 0) & (want == 0)  # a negative value rounding to 0 keeps its sign (the float code -0)
    assert bool(torch.signbit(got[neg_zero]).all())


@pytest.mark.parametrize("nb", FORMATS)
def test_per_channel_and_dead_channel(nb):
    fmt = element_format(nb)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 7, generator=g) * 4
    amax = torch.tensor([1.0, 0.0, 30.0]).reshape(1, 3, 1)  # channel 1 dead
    q = quantizer(nb, amax.flatten().tolist(), axis=1)
    s = amax.float() / fmt.bound
    want = torch.tensor([[[0.0]]]).expand_as(x).clone()
    for c in (0, 2):
        v = (x[:, c : c + 1] / s[:, c : c + 1]).flatten().tolist()
        levels = _round_list(nb, v)
        want[:, c : c + 1] = torch.tensor(levels).reshape(x[:, c : c + 1].shape) * s[:, c : c + 1]
    got = q(x)
    assert torch.equal(got, want)
    assert torch.equal(got[:, 1], torch.zeros(5, 7))
    xi = x.clone()
    xi[:, 1] = float("inf")
    assert torch.equal(q(xi)[:, 1], torch.zeros(5, 7))  # dead slices are zeros whatever they hold
    assert torch.equal(q.scale.flatten(), torch.tensor([1.0 / fmt.bound, 1.0, 30.0 / fmt.bound]))


def _round_list(nb, values):
    """Round-half-to-even onto the grid of ``nb``, saturating (pure Python, from :func:`grid`)."""
    g = grid(nb)
    out = []
    for v in values:
        m = min(abs(v), g[-1])
        i = max(k for k in range(len(g)) if g[k] <= m)
        if i + 1 < len(g):
            lo, hi = g[i], g[i + 1]
            d_lo, d_hi = m - lo, hi - m
            if d_hi < d_lo or (d_hi == d_lo and i % 2 == 1):
                i += 1
        r = g[i]
        out.append(-r if v < 0 else r)
    return out


@pytest.mark.parametrize("nb", FORMATS)
def test_dtypes_and_dead_tensor(nb):
    fmt = element_format(nb)
    x = torch.tensor([0.3, -7.0, 2.5, 100.0])
    for dtype in (torch.float16, torch.bfloat16):
        q = quantizer(nb, 2.0)
        got = q(x.to(dtype))
        s = torch.tensor(2.0 / fmt.bound)
        want = (torch.tensor(_round_list(nb, (x.to(dtype).float() / s).tolist())) * s).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(quantizer(nb, 0.0)(x), torch.zeros(4))
    assert torch.equal(quantizer(nb, 2.0**-25)(x), torch.zeros(4))


@pytest.mark.parametrize("nb", FORMATS)
def test_native_matches_the_reference_bit_for_bit(nb, impl, native):
    name = {E5M2: "fake_e5m2", E2M1: "fake_e2m1"}[nb]
    ref = getattr(library_minifloat, f"{name}_reference")
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(4, 6, 33, generator=g) * 10.0 ** torch.randint(-6, 6, (4, 6, 1), generator=g)])
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e38, -1e38])
    scales = [
        torch.tensor(0.37),
        torch.rand(1, 6, 1, generator=g) + 0.01,
        torch.tensor([0.5, 0.0, 2.0, 1e-3]).reshape(4, 1, 1),
    ]
    for s in scales:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            xd = x.to(dtype)
            assert torch.equal(getattr(native, name)(xd, s), ref(xd, s)), (impl, dtype, s.shape)
    q = quantizer(nb, None, axis=1)
    with backend.use_backend("native"):
        a = q(x)
    with backend.use_backend("reference"):
        b = q(x)
    assert torch.equal(a, b)


@pytest.mark.parametrize("nb", FORMATS)
def test_ste_and_learned_amax_gradient(nb):
    fmt = element_format(nb)
    x = torch.tensor([-9.0, -3.0, -0.2, 0.0, 0.7, 2.9, 3.0, 3.1, 50.0], requires_grad=True)
    q = quantizer(nb, 3.0)
    q(x).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # |x| <= amax (ends included)
    ql = quantizer(nb, 3.0, learn_amax=True)
    amax = ql._amax
    assert isinstance(amax, nn.Parameter)
    xd = x.detach()
    ql(xd).sum().backward()
    s = 3.0 / fmt.bound
    v = (xd.double() / s).tolist()
    r = _round_list(nb, v)
    top = fmt.bound
    term = [(-top if vi < -top else top if vi > top else ri - vi) for vi, ri in zip(v, r)]
    assert amax.grad.item() == pytest.approx(sum(term) / fmt.bound, rel=1e-5)


@pytest.mark.parametrize("nb", FORMATS)
def test_torch_compile_fullgraph(nb):
    model = nn.Sequential(nn.Linear(16, 8))
    x = torch.randn(4, 16)
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": nb, "axis": 0}, "*input_quantizer": {"num_bits": nb}},
           "algorithm": "max"}  # fmt: skip
    mtq.quantize(model, cfg, lambda m: m(x))
    want = model(x)
    f = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert torch.equal(f(x), want)


@pytest.mark.parametrize("nb", FORMATS)
@pytest.mark.parametrize("method", ["max", "mse", "percentile"])
def test_calibration_and_repr(nb, method):
    fmt = element_format(nb)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, 8, generator=g) * (i + 1) for i in range(3)]
    q = TensorQuantizer(QuantDescriptor(num_bits=nb, axis=None if method != "max" else 1,
                                        calib_method="max" if method == "max" else "histogram"))  # fmt: skip
    q.enable_calib()
    q.disable_quant()
    for x in xs:
        assert torch.equal(q(x), x)
    q.load_calib_amax(
        *(() if method == "max" else (method,)), **({"percentile": 99.9} if method == "percentile" else {})
    )
    q.disable_calib()
    q.enable_quant()
    if method == "max":
        want = torch.stack([x.abs().amax(0) for x in xs]).amax(0).reshape(1, 8)
        assert torch.equal(q.amax, want)
    assert 0 < float(q.amax.max()) <= 1.01 * float(torch.cat(xs).abs().max())  # histogram: up to a bin edge
    name = f"fp{sum(nb) + 1} {fmt.name}"
    assert name in repr(q)
    assert q.export_info()["kind"] == fmt.name and q.maxbound == fmt.bound
    with pytest.raises(ValueError, match=rf"not defined for num_bits=\({nb[0]}, {nb[1]}\)"):
        h = TensorQuantizer(QuantDescriptor(num_bits=nb, calib_method="histogram"))
        h.enable_calib()
        h(xs[0])
        h.load_calib_amax("entropy")


@pytest.mark.parametrize("nb", FORMATS)
def test_save_restore_and_summary(tmp_path, nb):
    torch.manual_seed(0)
    float_model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(32, 16)
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": nb, "axis": 0}, "*input_quantizer": {"num_bits": nb}},
           "algorithm": "max"}  # fmt: skip
    model = mtq.quantize(copy.deepcopy(float_model), cfg, lambda m: m(x))
    mtq.save(model, tmp_path / "q")
    fresh = mtq.restore(copy.deepcopy(float_model), tmp_path / "q")
    assert fresh[0].weight_quantizer.num_bits == nb
    assert torch.equal(fresh[0].input_quantizer.amax, model[0].input_quantizer.amax)
    assert torch.equal(fresh(x), model(x))
    state = model[2].weight_quantizer.state_dict()
    q2 = TensorQuantizer(QuantDescriptor(num_bits=nb, axis=0))
    q2.load_state_dict(state)
    assert torch.equal(q2(model[2].weight), model[2].weight_quantizer(model[2].weight))
    text = mtq.summary(model) if hasattr(mtq, "summary") else ""
    assert f"{element_format(nb).name}" in str(text)


def test_real_codes():
    w = torch.tensor([[0.1, -3.0, 100.0], [2.0, 0.0, -0.3]])
    q5 = quantizer(E5M2, 4.0)
    codes, scale = q5.quantize_weight_codes(w)
    assert codes.dtype == torch.float8_e5m2 and torch.equal(scale, torch.tensor(4.0 / 57344))
    assert torch.equal(codes.float() * scale, q5(w))
    q2 = quantizer(E2M1, 3.0, fake_quant=False)
    assert torch.equal(q2(w), torch.tensor(_round_list(E2M1, (w / 0.5).flatten().tolist())).reshape(2, 3))
    codes, scale = quantizer(E2M1, 3.0).quantize_weight_codes(w)
    assert codes.dtype == torch.float32 and torch.equal(codes * scale, quantizer(E2M1, 3.0)(w))


# --- export -------------------------------------------------------------------------------------------------------
onnx = pytest.importorskip("onnx")


class QuantPair(nn.Module):
    """An activation quantizer on the input and a weight quantizer on a constant (folded into codes)."""

    def __init__(self, nb, amax_in, w, amax_w):
        super().__init__()
        self.input_quantizer = quantizer(nb, amax_in, axis=None if np.size(amax_in) == 1 else 1)
        self.weight_quantizer = quantizer(nb, amax_w, axis=0)
        self.register_buffer("w", w)

    def forward(self, x):
        return self.input_quantizer(x), self.weight_quantizer(self.w)


def _pair_model(nb, per_channel_input: bool):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 6, generator=g) * 3
    w[1, 2] = -100.0
    amax_in = [0.5, 0.0, 7.0] if per_channel_input else 2.0
    model = QuantPair(nb, amax_in, w, [1.0, 2.0, 0.0, 5.0])
    x = torch.randn(2, 3, 9, generator=g) * 3
    x[0, 0, :4] = torch.tensor([1e30, -1e30, 0.0, -1e-30])
    model(x)  # a flat fixed per-channel amax learns the input's rank from a forward
    return model, x


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("per_channel_input", [False, True])
def test_export_e5m2_bit_exact_in_onnxruntime(tmp_path, per_channel_input, dynamo):
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto

    from modelopt_lite.onnx_export.ort_runner import ort_session

    model, x = _pair_model(E5M2, per_channel_input)
    path = tmp_path / "e5m2.onnx"
    rep = mtq.export_onnx(model, x, path, dynamo=dynamo)
    assert rep.opset == 19
    m = onnx.load(str(path))
    inits = {t.name: t for t in m.graph.initializer}
    q_nodes = [n for n in m.graph.node if n.op_type == "QuantizeLinear"]
    assert len(q_nodes) == 1 and inits[q_nodes[0].input[2]].data_type == TensorProto.FLOAT8E5M2
    dq_w = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert len(dq_w) == 1 and inits[dq_w[0].input[0]].data_type == TensorProto.FLOAT8E5M2  # folded weight codes
    got = ort_session(path).run(None, {m.graph.input[0].name: x.numpy()})
    for g_, w_ in zip(got, model(x)):
        assert torch.equal(torch.from_numpy(g_), w_)
    with pytest.raises(ValueError, match=r"FP8 E5M2 needs opset >= 19"):
        mtq.export_onnx(model, x, tmp_path / "low.onnx", opset=17)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("per_channel_input", [False, True])
def test_export_e2m1_bit_exact_in_reference_evaluator(tmp_path, per_channel_input, dynamo):
    from onnx import TensorProto
    from onnx.reference import ReferenceEvaluator

    from modelopt_lite.onnx_export.ort_runner import ort_session

    model, x = _pair_model(E2M1, per_channel_input)
    path = tmp_path / "e2m1.onnx"
    rep = mtq.export_onnx(model, x, path, dynamo=dynamo)
    assert rep.opset == 23
    assert any("FLOAT4E2M1" in n and "ReferenceEvaluator" in n for n in rep.notes)
    m = onnx.load(str(path))
    assert {t.data_type for t in m.graph.initializer} >= {TensorProto.FLOAT4E2M1}
    got = ReferenceEvaluator(m).run(None, {m.graph.input[0].name: x.numpy()})
    for g_, w_ in zip(got, model(x)):
        assert torch.equal(torch.from_numpy(g_), w_)
    with pytest.raises(ValueError, match=r"FP4 E2M1 needs opset >= 23"):
        mtq.export_onnx(model, x, tmp_path / "low.onnx", opset=21)
    pytest.importorskip("onnxruntime")
    with pytest.raises(
        ValueError, match=r"no QuantizeLinear/DequantizeLinear kernels for FLOAT4E2M1.*ReferenceEvaluator"
    ):
        ort_session(path)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_plain_torch_onnx_export(tmp_path, dynamo):
    pytest.importorskip("onnxruntime")
    import warnings

    from modelopt_lite.onnx_export.ort_runner import ort_session

    q = quantizer(E5M2, [1.0, 300.0, 5e4], axis=1)
    x = torch.randn(4, 3, 5) * 100
    path = tmp_path / "p.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(q, (x,), str(path), opset_version=19, dynamo=dynamo)
    m = onnx.load(str(path))
    assert [n.op_type for n in m.graph.node].count("QuantizeLinear") == 1
    got = ort_session(m).run(None, {m.graph.input[0].name: x.numpy()})[0]
    assert torch.equal(torch.from_numpy(got), q(x))
    q2 = quantizer(E2M1, 2.0)
    with warnings.catch_warnings(), pytest.raises(Exception) as err:
        warnings.simplefilter("ignore")
        torch.onnx.export(q2, (x,), str(tmp_path / "p2.onnx"), opset_version=19, dynamo=dynamo)
    if not dynamo:  # the dynamo exporter wraps it in its own error (and warns with this message)
        assert err.type is ValueError and "FLOAT4E2M1" in str(err.value) and "export_onnx" in str(err.value)


# --- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nb", FORMATS)
def test_errors(nb):
    name = element_format(nb).name.upper()
    q = quantizer(nb, None)
    with pytest.raises(ValueError, match="TensorQuantizer .*NaN or Inf"):
        q(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="TensorQuantizer .*NaN or Inf"):
        q(torch.tensor([1.0, float("inf")]))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="amax must be finite and >= 0"):
            quantizer(nb, bad)
    with pytest.raises(ValueError, match=f"unsigned=True is meaningless for {name}"):
        QuantDescriptor(num_bits=nb, unsigned=True)
    with pytest.raises(ValueError, match=f"narrow_range=True applies to integer formats only, not {name}"):
        QuantDescriptor(num_bits=nb, narrow_range=True)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        quantizer(nb, 1.0)(torch.ones(3, dtype=torch.int32))
    from modelopt_lite.tensor_quant import block_quant

    with pytest.raises(ValueError, match=f"use fake_block_quant for {name} blocks"):
        block_quant(torch.ones(4, 8), {-1: 4}, num_bits=nb)


def test_e8m0_stays_a_scale_format_only():
    with pytest.raises(ValueError, match=r"E8M0\) is a scale format only"):
        QuantDescriptor(num_bits=(8, 0))
    from modelopt_lite.formats import scaled_format

    with pytest.raises(ValueError, match=r"E8M0\) has no float32-scaled"):
        scaled_format((8, 0))


@pytest.mark.parametrize("nb", FORMATS)
def test_fake2real_names_module_and_format(nb):
    model = nn.Sequential(nn.Linear(8, 4))
    x = torch.randn(4, 8)
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": nb, "axis": 0}, "*input_quantizer": {"enable": False}},
           "algorithm": "max"}  # fmt: skip
    mtq.quantize(model, cfg, lambda m: m(x))
    fmt = element_format(nb).name
    with pytest.raises(ValueError, match=rf"fake2real: module '0': weight_quantizer is {fmt}; only integer weights"):
        mtq.fake2real(model)


@pytest.mark.parametrize("nb", FORMATS)
def test_gptq_refuses_them_clearly(nb):
    from modelopt_lite.algorithms.gptq_solver import grid_for

    with pytest.raises(ValueError, match=rf"gptq: lin: num_bits=\({nb[0]}, {nb[1]}\) is not supported by GPTQ"):
        grid_for(QuantDescriptor(num_bits=nb, axis=0, amax=[1.0] * 4), (4, 8), "lin")
