"""The functional contract with hand-computed values, errors, properties, gradients, QAT, compile and export.

Value tests run under every available backend (the pure-torch reference and the native kernels).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import modelopt_lite.tensor_quant as tq
from modelopt_lite.formats import int_range
from modelopt_lite.functional import backend
from modelopt_lite.functional.lowlevel import code_dtype, dequantize, quantize


@pytest.fixture(params=["reference", "native"])
def bk(request):
    if request.param == "native" and backend._load("cpu") is None:
        pytest.skip(f"native kernels unavailable: {backend.native_error('cpu')}")
    with backend.use_backend(request.param):
        yield request.param


def t(*v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


# --- hand-computed values --------------------------------------------------------------------------------------------
def test_rint_ties_to_even(bk):
    x = t(0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 0.49999997)
    y = tq.fake_tensor_quant(x, 127.0, 8)  # scale exactly 1
    assert torch.equal(y, t(0.0, 2.0, 2.0, 4.0, 0.0, -2.0, -2.0, 0.0))


def test_narrow_vs_full_range_on_clipped_negatives(bk):
    x = t(-200.0, -127.6, 300.0)
    q_narrow, s = tq.tensor_quant(x, 127.0, 8, narrow_range=True)
    q_full, _ = tq.tensor_quant(x, 127.0, 8, narrow_range=False)
    assert torch.equal(q_narrow, t(-127.0, -127.0, 127.0)) and torch.equal(q_full, t(-128.0, -128.0, 127.0))
    assert torch.equal(s, torch.tensor(1.0))
    q8, _ = tq.tensor_quant(x, 127.0, 8, narrow_range=False, dtype=torch.int8)
    assert q8.dtype == torch.int8 and q8.tolist() == [-128, -128, 127]


def test_true_division_not_reciprocal(bk):
    x = torch.tensor([-1116609593], dtype=torch.int32).view(torch.float32)  # -0.059055116
    s = torch.tensor(1.0) / 127
    assert (x / s).item() == -7.5 and torch.round(x * (1 / s)).item() == -7.0  # the two formulas disagree here
    q, _ = tq.tensor_quant(x, 1.0, 8)
    assert q.item() == -8.0  # rint(x / s) = rint(-7.5) = -8 (ONNX Runtime's answer)
    assert torch.equal(tq.fake_tensor_quant(x, 1.0, 8), -8 * s.reshape(1))


def test_unsigned_and_bits(bk):
    x = t(0.0, 0.26, 1.0, 5.0)
    assert torch.equal(tq.tensor_quant(x, 1.0, 4, unsigned=True)[0], t(0.0, 4.0, 15.0, 15.0))
    assert torch.equal(tq.tensor_quant(x, 1.0, 1, unsigned=True)[0], t(0.0, 0.0, 1.0, 1.0))
    assert torch.equal(tq.tensor_quant(-x, 1.0, 4, narrow_range=False)[0], t(0.0, -2.0, -7.0, -8.0))


def test_per_channel_and_dead_channel(bk):
    x = t(1.0, -2.0, 3.0, 1.0, -2.0, 3.0).reshape(2, 3)
    amax = t(3.0, 0.0).reshape(2, 1)
    y = tq.fake_tensor_quant(x, amax, 2, narrow_range=True)  # bound 1: scale 3 / dead
    assert torch.equal(y, t(0.0, -3.0, 3.0, 0.0, 0.0, 0.0).reshape(2, 3))


def test_e4m3_values(bk):
    x = t(1.0, 1.0625, 1.1875, 500.0, -1000.0, 2.0**-9, 2.0**-10 * 3, float("nan"))
    y = tq.scaled_e4m3(x)  # scale 1
    assert torch.equal(y[:7], t(1.0, 1.0, 1.25, 448.0, -448.0, 2.0**-9, 2.0**-8)) and torch.isnan(y[7])
    assert torch.equal(tq.scaled_e4m3(t(-5.0), 0.0), t(0.0))


def test_affine_values(bk):
    x = t(-1.0, 0.0, 0.3, 3.0, 10.0)
    q, s, zp = tq.affine_tensor_quant(x, -1.0, 3.0, 8)  # scale 4/255, zp = rint(-128 + 63.75) = -64
    assert s.item() == pytest.approx(4 / 255) and zp.item() == -64.0
    assert torch.equal(q, torch.clamp(torch.round(x / s) + zp, -128, 127))
    y = tq.fake_affine_tensor_quant(x, -1.0, 3.0, 8)
    assert y[1].item() == 0.0 and torch.equal(y, (q - zp) * s)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_return_dtype(bk, dtype):
    x = torch.randn(4, 8).to(dtype)
    for y in (
        tq.fake_tensor_quant(x, 2.0),
        tq.scaled_e4m3(x, 2.0),
        tq.fake_affine_tensor_quant(x, -1.0, 1.0),
        tq.fake_block_quant(x, {-1: 4}),
        quantize(x, 0.1),
    ):
        assert y.dtype == dtype and y.shape == x.shape
    assert tq.tensor_quant(x, 2.0)[0].dtype == torch.float32


# --- errors ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda x: tq.fake_tensor_quant(x, -1.0), ValueError, r"amax must be finite and >= 0, got -1\.0"),
        (lambda x: tq.fake_tensor_quant(x, t(1.0, float("nan")).reshape(2, 1)), ValueError, "got nan"),
        (lambda x: tq.fake_tensor_quant(x, float("inf")), ValueError, "got inf"),
        (lambda x: tq.fake_tensor_quant(x.int(), 1.0), TypeError, "inputs must be .* got torch.int32"),
        (lambda x: tq.fake_tensor_quant(x.to(torch.complex64), 1.0), TypeError, "got torch.complex64"),
        (lambda x: tq.fake_tensor_quant(x, torch.ones(2, 1, dtype=torch.int64)), TypeError, "amax must be .*int64"),
        (lambda x: tq.fake_tensor_quant(x - 3, 1.0, unsigned=True), ValueError, r"minimum -2\.0"),
        (lambda x: tq.fake_tensor_quant(x, torch.ones(3, 1)), ValueError, r"amax of shape \(3, 1\) does not broadcast"),
        (lambda x: tq.fake_tensor_quant(x, torch.ones(3)), ValueError, "must keep the input's rank 2"),
        (lambda x: tq.fake_tensor_quant(x, 1.0, 17), ValueError, "1..16, got 17"),
        (
            lambda x: tq.fake_block_quant(x, {-1: 0}),
            ValueError,
            r"block size for axis -1 must be positive \(an int, or None for the whole axis\), got 0",
        ),
        (lambda x: tq.fake_block_quant(x, {2: 4}), ValueError, "axis=.*out of range for a tensor of rank 2"),
        (lambda x: tq.fake_block_quant(x, {-1: 2}, torch.ones(2, 3)), ValueError, r"expected \(2, 2\)"),
        (lambda x: quantize(x, 0.1, axis=2), ValueError, "axis=2 is out of range for a tensor of rank 2"),
        (lambda x: quantize(x, 0.0), ValueError, r"scale must be finite and > 0, got 0\.0"),
        (lambda x: quantize(x, t(0.1, float("nan")), axis=0), ValueError, "scale must be finite and > 0, got nan"),
        (lambda x: quantize(x, 0.1, qmin=5, qmax=5), ValueError, "qmin must be < qmax, got qmin=5, qmax=5"),
        (lambda x: quantize(x, 0.1, zero_point=1.5), ValueError, r"zero_point must hold integers, got 1\.5"),
        (lambda x: quantize(x, 0.1, zero_point=300, qmax=255, qmin=0), ValueError, r"\[0, 255\], got 300\.0"),
        (lambda x: quantize(x, torch.ones(3), axis=1), ValueError, r"scale of shape \(3,\) does not match axis=1"),
        (lambda x: quantize(x, torch.ones(4)), ValueError, "axis is None"),
        (lambda x: quantize(x, 0.1, mode="int8"), ValueError, "mode must be one of"),
        (lambda x: quantize(x * float("nan"), 0.1, mode="hardware"), ValueError, "NaN"),
        (lambda x: dequantize(x, -1.0), ValueError, r"scale must be finite and > 0, got -1\.0"),
    ],
)
def test_errors(call, exc, msg):
    x = torch.ones(2, 4)
    with pytest.raises(exc, match=msg):
        call(x)


# --- properties ------------------------------------------------------------------------------------------------------
_floats = st.floats(-1e3, 1e3, width=32, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(_floats, min_size=1, max_size=40),
    st.floats(2.0**-10, 1024.0, width=32),
    st.sampled_from([2, 4, 8, 16]),
    st.booleans(),
)
def test_properties(values, amax, bits, narrow):
    x = torch.tensor(values, dtype=torch.float32)
    y = tq.fake_tensor_quant(x, amax, bits, narrow_range=narrow)
    assert torch.equal(tq.fake_tensor_quant(y, amax, bits, narrow_range=narrow), y)  # idempotent
    _, qmin, qmax = int_range(bits, False, narrow)
    s = torch.tensor(amax, dtype=torch.float32) / int_range(bits, False, narrow).bound
    inside = (x >= qmin * s) & (x <= qmax * s)
    err = (y - x).abs()[inside]
    assert bool((err <= s / 2 + 2.0**-22 * (x.abs() + y.abs())[inside]).all())  # half a step, up to rounding
    xs = torch.sort(x).values
    ys = tq.fake_tensor_quant(xs, amax, bits, narrow_range=narrow)
    assert bool((ys[1:] >= ys[:-1]).all())  # monotone


# --- gradients -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("narrow", [False, True])
def test_ste_mask_includes_the_boundary(bk, narrow):
    _, qmin, qmax = int_range(8, False, narrow)
    s = torch.tensor(2.0) / 127
    lo, hi = (qmin * s).reshape(1), (qmax * s).reshape(1)
    x = torch.cat([lo, hi, torch.nextafter(lo, lo - 1), torch.nextafter(hi, hi + 1), t(0.0)]).requires_grad_(True)
    tq.fake_tensor_quant(x, 2.0, 8, narrow_range=narrow).sum().backward()
    assert torch.equal(x.grad, t(1.0, 1.0, 0.0, 0.0, 1.0))


def _lsq_expected(x, amax, bound, qmin, qmax, g):
    """dL/damax per element by hand: ((q - v) inside, qmin below, qmax above) * g / bound, v = x / scale."""
    s = (amax / bound).double()
    v = x.double() / s
    q = torch.clamp(torch.round(v), qmin, qmax)
    term = torch.where(v < qmin, float(qmin), torch.where(v > qmax, float(qmax), q - v))
    return term * g.double() / bound


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_lsq_amax_gradient(bk, kind):
    gen = torch.Generator().manual_seed(5)
    bound, qmin, qmax = int_range(4, False, False)
    x = torch.randn(6, 8, generator=gen) * 2
    g = torch.randn(6, 8, generator=gen)
    if kind == "tensor":
        amax = torch.tensor(2.5, requires_grad=True)
        y = tq.fake_tensor_quant(x, amax, 4, narrow_range=False)
        expected = _lsq_expected(x, amax.detach(), bound, qmin, qmax, g).sum()
    elif kind == "channel":
        amax = (torch.rand(6, 1, generator=gen) * 3 + 0.5).requires_grad_(True)
        y = tq.fake_tensor_quant(x, amax, 4, narrow_range=False)
        expected = _lsq_expected(x, amax.detach(), bound, qmin, qmax, g).sum(1, keepdim=True)
    else:
        amax = (torch.rand(6, 2, generator=gen) * 3 + 0.5).requires_grad_(True)
        y = tq.fake_block_quant(x, {-1: 4}, amax, 4)
        a = amax.detach().repeat_interleave(4, dim=1)
        expected = _lsq_expected(x, a, bound, qmin, qmax, g).reshape(6, 2, 4).sum(-1)
    y.backward(g)
    assert amax.grad.shape == amax.shape
    torch.testing.assert_close(amax.grad.double(), expected, rtol=1e-5, atol=1e-6)


def test_qat_learned_amax_beats_fixed_amax(bk):
    def run(learn: bool) -> float:
        gen = torch.Generator().manual_seed(0)
        X = torch.randn(256, 16, generator=gen)
        w_true = torch.randn(16, 1, generator=gen)
        Y = X @ w_true
        w = torch.nn.Parameter(w_true + 0.1 * torch.randn(16, 1, generator=gen))
        amax = torch.nn.Parameter(10 * w_true.abs().max(), requires_grad=learn)  # badly initialized: 10x too wide
        groups = [{"params": [w], "lr": 0.05}] + ([{"params": [amax], "lr": 0.3}] if learn else [])
        opt = torch.optim.Adam(groups)
        for _ in range(80):
            loss = ((X @ tq.fake_tensor_quant(w, amax, 4, narrow_range=False) - Y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    learned, fixed = run(True), run(False)
    assert learned < 0.1 * fixed, (learned, fixed)


# --- low-level quantize / dequantize ---------------------------------------------------------------------------------
def test_lowlevel_symmetric_and_asymmetric(bk):
    x = t(0.0, 1.0, 2.5, -1.0, 200.0)
    assert torch.equal(
        quantize(x, 0.5, qmin=-8, qmax=7, mode="hardware"), torch.tensor([0, 2, 5, -2, 7], dtype=torch.int8)
    )
    q = quantize(x, 0.5, zero_point=10, qmin=0, qmax=255, mode="hardware")
    assert q.dtype == torch.uint8 and q.tolist() == [10, 12, 15, 8, 255]
    assert torch.equal(quantize(x, 0.5, zero_point=10, qmin=0, qmax=255), t(0.0, 1.0, 2.5, -1.0, 122.5))
    assert torch.equal(dequantize(q, 0.5, zero_point=10), t(0.0, 1.0, 2.5, -1.0, 122.5))
    assert [code_dtype(*r) for r in ((-128, 127), (0, 255), (0, 1000), (-40000, 40000))] == [
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
    ]


@pytest.mark.parametrize("axis", [0, -1, (0, 2), (2, 0)])
def test_lowlevel_per_axis_round_trip(bk, axis):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 5, generator=gen)
    axes = (axis,) if isinstance(axis, int) else axis
    shape = [x.shape[a] for a in axes]
    s = torch.rand(shape, generator=gen) * 0.05 + 0.01
    zp = torch.randint(-5, 5, shape, generator=gen)
    for z in (None, zp):
        q = quantize(x, s, z, axis=axis, mode="hardware")
        y = quantize(x, s, z, axis=axis)
        assert q.dtype == torch.int8 and torch.equal(dequantize(q, s, z, axis=axis), y)
    keep = [x.shape[d] if d in [a % 3 for a in axes] else 1 for d in range(3)]
    s_full = s.permute(*sorted(range(len(axes)), key=lambda i: axes[i] % 3)).reshape(keep)
    assert torch.equal(quantize(x, s, axis=axis), torch.clamp(torch.round(x / s_full), -128, 127) * s_full)


def test_lowlevel_scale_gradient_flows(bk):
    s = torch.tensor(0.1, requires_grad=True)
    quantize(torch.linspace(-1, 1, 9), s, qmin=-4, qmax=3).sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad)


# --- compile / export ------------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_matches_eager(bk):
    def f(x, amax):
        return tq.fake_tensor_quant(x, amax, 4) * 2 + tq.scaled_e4m3(x, amax)

    x, amax = torch.randn(8, 16), torch.tensor(1.5)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, amax), f(x, amax))


def test_export_shows_one_op_node(bk):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("amax", torch.tensor(2.0))

        def forward(self, x):
            return tq.fake_tensor_quant(x, self.amax, 8)

    ep = torch.export.export(M(), (torch.randn(4, 8),))
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "modelopt_lite" in str(n.target)]
    assert ops == ["modelopt_lite.fake_quant_int.default"]
    x = torch.randn(4, 8)
    assert torch.equal(ep.module()(x), M()(x))
