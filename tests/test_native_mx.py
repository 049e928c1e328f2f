"""The native CPU kernels of E5M2, E2M1, NVFP4 and OCP MX equal the pure-torch reference
(:mod:`modelopt_lite.functional.microscaling`) bit for bit, for both kernel implementations (AVX2 and scalar).

Data: every float16 bit pattern, random float32 bit patterns (subnormals, huge values), exact ties of every element
grid, values beyond the range, per-row scales spanning 2**-140..2**100 (subnormal block amaxes, E8M0 clamps), dead
blocks and dead tensors, partial last blocks, float16/bfloat16 inputs, non-contiguous inputs. Small tensors: fast.
"""

from __future__ import annotations

import pytest
import torch

from modelopt_lite.functional import backend
from modelopt_lite.functional import microscaling as MS

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ELEMS = ("e4m3", "e5m2", "e2m1", "int8")
ROUNDINGS = ("floor", "rceil")


def same(a, b, what=""):
    """dtype, shape, NaN positions, values and the sign of zero all agree."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    na, nb = torch.isnan(a), torch.isnan(b)
    assert torch.equal(na, nb), f"{what}: NaN positions differ"
    av, bv = a[~na], b[~nb]
    assert torch.equal(av, bv), f"{what}: values differ at {(av != bv).nonzero()[:5].flatten().tolist()}"
    if a.is_floating_point():
        sa, sb = torch.signbit(av), torch.signbit(bv)
        assert torch.equal(sa, sb), f"{what}: the sign of zero differs at {(sa != sb).nonzero()[:5].tolist()}"


def special_values() -> torch.Tensor:
    """Every float16 value, random float32 bit patterns, and the ties/edges of every element grid (float32)."""
    g = torch.Generator().manual_seed(15)
    f16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    rnd = (
        torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    )
    grid = torch.arange(-1024, 1025, dtype=torch.float32) / 128  # every E2M1 tie and 1.6 fixed-point tie
    edges = torch.tensor(
        [0.0, -0.0, 0.25, -0.25, 0.75, 5.0, -5.0, 5.5, 6.0, 7.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0,
         2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-16, 2.0**-17, 3 * 2.0**-18, 2.0**-126, 2.0**-149, 1.984375, 1.9921875,
         127 / 64, 1.99, 2.0, 3.4e38, -3.4e38]
    )  # fmt: skip
    return torch.cat([f16, rnd, grid, edges, -edges])


def blocked_data(dtype, cols, seed=0) -> torch.Tensor:
    """Finite rows of `cols` (partial last blocks), each row at its own power-of-two scale; a zero row."""
    g = torch.Generator().manual_seed(seed)
    v = special_values()
    v = v[torch.isfinite(v)]
    rows = 24
    n = rows * cols
    x = v[torch.randint(0, v.numel(), (n,), generator=g)].reshape(rows, cols)
    x[::3] = torch.randn(x[::3].shape, generator=g) * 3
    x[1::3] = (torch.randint(-64, 65, x[1::3].shape, generator=g).float() / 8) * 0.5  # ties of every grid
    row_scale = 2.0 ** torch.randint(-140, 100, (rows, 1), generator=g).float()
    x = x * row_scale
    x[5] = 0.0
    x[6, : cols // 2] = -0.0
    x = x.to(dtype)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


# --- elementwise: E5M2 and E2M1 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_e5m2_e2m1_elementwise_exact(dtype, impl, native):
    x = special_values().to(dtype)
    one = torch.ones((), dtype=torch.float32)
    same(native.fake_e5m2(x, one), MS.e5m2_round(x).to(dtype), f"e5m2 {impl}")
    same(native.fake_e2m1(x, one), MS.e2m1_round(x).to(dtype), f"e2m1 {impl}")
    # per-element scales with dead entries, and a per-channel scale broadcast along rows
    g = torch.Generator().manual_seed(1)
    s = (torch.rand(x.shape, generator=g) * 3 + 0.01) * 2.0 ** torch.randint(-20, 20, x.shape, generator=g)
    s[::5] = 0.0
    for fn, rnd in ((native.fake_e5m2, MS.e5m2_round), (native.fake_e2m1, MS.e2m1_round)):
        ref = torch.where(s == 0, 0.0, rnd(x.float() / torch.where(s == 0, 1.0, s)) * s).to(dtype)
        same(fn(x, s), ref, f"{fn.__name__} per element {impl}")
        x2 = x[: (x.numel() // 37) * 37].reshape(-1, 37)
        s2 = torch.rand(x2.shape[0], 1, generator=g) + 0.1
        ref2 = (rnd(x2.float() / s2) * s2).to(dtype)
        same(fn(x2.t().contiguous().t(), s2), ref2, f"{fn.__name__} per channel, strided {impl}")


def test_elementwise_dead_scale_gives_zeros(native, impl):
    x = torch.tensor([-1.0, -0.0, 3.0, float("nan")])
    for fn in (native.fake_e5m2, native.fake_e2m1):
        y = fn(x, torch.zeros(()))
        assert torch.equal(y, torch.zeros(4)) and not torch.signbit(y).any()


# --- NVFP4 --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", (16, 32))
@pytest.mark.parametrize("cols", (5, 64, 16 * 7 + 9))
def test_nvfp4_exact(dtype, block, cols, impl, native):
    x = blocked_data(dtype, cols, seed=cols)
    amax = x.float().abs().amax()
    for gs in (MS.nvfp4_global_scale(amax), MS.nvfp4_global_scale(amax / 1000), torch.tensor(0.0)):
        what = f"nvfp4 {impl} {dtype} block {block} cols {cols} gs {gs.item()}"
        same(native.fake_nvfp4(x, gs, block), MS.fake_nvfp4(x, gs, block), what)
        y, s = native.nvfp4_fake_with_scales(x, gs, block)
        same(y, MS.fake_nvfp4(x, gs, block), what)
        same(s, MS.nvfp4_block_scales(x, gs, block), what + " scales")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", (16, 32))
def test_nvfp4_eight_block_groups(dtype, block, impl, native):
    """Rows of many whole blocks (the AVX2 kernel computes 8 block scales at once): per-lane dead blocks (amax 0),
    scales that round to 0 or saturate at 448 in some lanes, subnormal blocks, a partial tail; and a NaN or Inf
    in the middle of a group raises like the reference."""
    cols = block * 8 * 3 + 5
    x = blocked_data(dtype, cols, seed=block).float()
    x[0, block : 2 * block] = 0.0  # a dead lane in the first group
    x[1, 3 * block : 4 * block] = torch.linspace(-1e-12, 1e-12, block)  # a lane whose E4M3 scale rounds to 0
    x[2, 5 * block : 6 * block] = torch.linspace(-2e4, 6e4, block)  # above the global amax: the scale saturates
    x[3] = x[3].abs() * 2.0**-140  # subnormal blocks
    x = x.to(dtype)
    gs = MS.nvfp4_global_scale(torch.tensor(1.0))
    what = f"nvfp4 groups {impl} {dtype} block {block}"
    y, s = native.nvfp4_fake_with_scales(x, gs, block)
    same(y, MS.fake_nvfp4(x, gs, block), what)
    same(s, MS.nvfp4_block_scales(x, gs, block), what + " scales")
    assert float(s[1, 3]) == 0.0 and float(s[2, 5]) == 448.0 and float(s[0, 1]) == 0.0
    for bad in (float("nan"), float("inf")):
        xb = x.clone()
        xb[7, 8 * block + 3 * block + 1] = bad
        for fn in (MS.fake_nvfp4, native.fake_nvfp4):
            with pytest.raises(ValueError, match=r"NVFP4 input contains NaN or Inf"):
                fn(xb, gs, block)


def test_nvfp4_dead_blocks_and_strides(native, impl):
    x = torch.randn(3, 8, 48)
    x[0, 0, :16] = 1e-30  # scale rounds to 0: a dead block, +0.0 outputs
    x[1, :, 16:32] = -0.0
    gs = MS.nvfp4_global_scale(x.abs().amax())
    y = native.fake_nvfp4(x, gs, 16)
    same(y, MS.fake_nvfp4(x, gs, 16), "dead blocks")
    assert not torch.signbit(y[0, 0, :16]).any() and not torch.signbit(y[1, :, 16:32]).any()
    xt = x.transpose(0, 1)  # non-contiguous input: the output is contiguous with the same values
    same(native.fake_nvfp4(xt, gs, 16), MS.fake_nvfp4(xt, gs, 16), "strided")
    same(native.fake_nvfp4(x[:, :, :0], gs, 16), MS.fake_nvfp4(x[:, :, :0], gs, 16), "empty")


# --- MX ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("cols", (7, 96, 32 * 3 + 17))
def test_mx_exact(dtype, elem, cols, impl, native):
    x = blocked_data(dtype, cols, seed=cols + 1)
    for rounding in ROUNDINGS:
        what = f"mx {elem} {rounding} {impl} {dtype} cols {cols}"
        same(native.fake_mx(x, elem, 32, rounding), MS.fake_mx(x, elem, 32, rounding), what)
        y, k = native.mx_fake_with_exponents(x, elem, 32, rounding)
        same(y, MS.fake_mx(x, elem, 32, rounding), what)
        same(k, MS.mx_scale_exponents(x, elem, 32, rounding), what + " exponents")


@pytest.mark.parametrize("elem", ELEMS)
def test_mx_scale_edges(elem, native, impl):
    """Block amaxes on both sides of every rceil threshold, at the E8M0 clamps and subnormal."""
    sig = torch.tensor([1.0, 1.5, 1.5 + 2**-23, 1.75, 1.75 + 2**-23, 1.984375, 1.984375 + 2**-23, 2 - 2**-23])
    exps = torch.tensor([-149.0, -140.0, -127.0, -126.0, -1.0, 0.0, 20.0, 126.0, 127.0])
    amax = (sig[:, None] * 2.0 ** exps[None, :]).flatten()
    amax = amax[torch.isfinite(amax) & (amax > 0)]
    x = torch.randn(amax.numel(), 32, generator=torch.Generator().manual_seed(2)).clamp(-1, 1) * amax[:, None]
    x[:, 7] = amax
    for rounding in ROUNDINGS:
        same(native.fake_mx(x, elem, 32, rounding), MS.fake_mx(x, elem, 32, rounding), f"{elem} {rounding}")
        same(native.mx_fake_with_exponents(x, elem, 32, rounding)[1], MS.mx_scale_exponents(x, elem, 32, rounding))


# --- errors: the reference's messages ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_inputs_raise_like_the_reference(bad, native, impl):
    x = torch.randn(2, 40)
    x[1, 37] = bad
    gs = torch.tensor(0.01)
    for fn, args in ((MS.fake_nvfp4, (gs, 16)), (native.fake_nvfp4, (gs, 16))):
        with pytest.raises(ValueError, match=r"NVFP4 input contains NaN or Inf \((nan|inf|-inf)\)"):
            fn(x, *args)
    for fn in (MS.fake_mx, native.fake_mx):
        with pytest.raises(ValueError, match=r"MX \(e2m1\) input contains NaN or Inf"):
            fn(x, "e2m1", 32, "floor")
    with pytest.raises(ValueError, match="NVFP4 input contains NaN or Inf"):  # a dead tensor still checks
        native.fake_nvfp4(x, torch.tensor(0.0), 16)


def test_bad_arguments_raise_like_the_reference(native):
    x = torch.randn(4, 32)
    cases = [
        ((x, torch.tensor(0.1), 8), "NVFP4 block size must be one of \\(16, 32\\) along the last axis, got 8"),
        ((x, torch.tensor([0.1, 0.2]), 16), "NVFP4 global_scale must be a single"),
        ((x, torch.tensor(-1.0), 16), "NVFP4 global_scale must be finite and >= 0"),
        ((x, torch.tensor(float("nan")), 16), "NVFP4 global_scale must be finite and >= 0"),
        ((torch.tensor(1.0), torch.tensor(0.1), 16), "must have at least one dimension"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            native.fake_nvfp4(*args)
        with pytest.raises(ValueError, match=msg):
            MS.fake_nvfp4(*args)
    for args, msg in [
        ((x, "e3m2", 32, "floor"), "MX element format must be one of"),
        ((x, "e4m3", 16, "floor"), "MX block size must be one of \\(32,\\) along the last axis, got 16"),
        ((x, "e4m3", 32, "nearest"), "MX scale rounding must be one of"),
    ]:
        with pytest.raises(ValueError, match=msg):
            native.fake_mx(*args)
        with pytest.raises(ValueError, match=msg):
            MS.fake_mx(*args)
    with pytest.raises(TypeError, match="must be float32, float16 or bfloat16, got torch.float64"):
        native.fake_mx(x.double(), "e4m3", 32, "floor")


def test_parallel_split_inside_rows(native, impl):
    """Rows longer than a parallel chunk and many rows: the block walk over chunk and row boundaries is exact."""
    x = blocked_data(torch.float32, 4099, seed=3)[:3]
    gs = MS.nvfp4_global_scale(x.abs().amax())
    same(native.fake_nvfp4(x, gs, 16), MS.fake_nvfp4(x, gs, 16), "long rows nvfp4")
    same(native.fake_mx(x, "e4m3", 32, "floor"), MS.fake_mx(x, "e4m3", 32, "floor"), "long rows mx")
    x = torch.randn(3000, 20)
    same(native.fake_mx(x, "int8", 32, "rceil"), MS.fake_mx(x, "int8", 32, "rceil"), "many rows mx")


# --- dispatch: the torch.library ops and the quantizer run the native kernels ------------------------------------
def test_library_ops_dispatch_to_native(native, monkeypatch):
    """library_mx's NVFP4/MX ops and library_minifloat's E5M2/E2M1 ops call the native functions under the native
    backend (a spy on the module) and equal the reference backend bit for bit."""
    from modelopt_lite.functional import library_minifloat as LF
    from modelopt_lite.functional import library_mx as LM

    x = blocked_data(torch.bfloat16, 96, seed=7)
    amax = x.float().abs().amax()
    s = torch.rand(24, 1) + 0.1
    calls = []
    for name in ("fake_nvfp4", "fake_mx", "fake_e5m2", "fake_e2m1"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    runs = {
        "nvfp4": lambda: LM.nvfp4_fake_quant(x, amax, 16),
        "mx": lambda: LM.mx_fake_quant(x, "e2m1", 32, "rceil"),
        "e5m2": lambda: LF.fake_e5m2(x, s),
        "e2m1": lambda: LF.fake_e2m1(x, s),
    }
    for what, fn in runs.items():
        with backend.use_backend("reference"):
            ref = fn()
        with backend.use_backend("native"):
            got = fn()
        same(got, ref, what)
    assert calls == ["fake_nvfp4", "fake_mx", "fake_e5m2", "fake_e2m1"]
    same(LF.fake_e5m2_reference(x, s), (MS.e5m2_round(x.float() / s) * s).to(x.dtype), "e5m2 reference")


def test_tensor_quantizer_nvfp4_and_mx_native_equals_reference(native):
    from modelopt_lite.descriptor import QuantDescriptor
    from modelopt_lite.nn import TensorQuantizer

    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(5))
    cfgs = {
        "nvfp4": dict(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}),
        "mxfp8": dict(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
    }
    for what, cfg in cfgs.items():
        outs = {}
        for name in ("reference", "native"):
            with backend.use_backend(name):
                amax = x.abs().amax() if what == "nvfp4" else None
                outs[name] = TensorQuantizer(QuantDescriptor(**cfg), amax=amax)(x)
        same(outs["native"], outs["reference"], what)


def test_minifloat_ops_gradient_and_fake_impl(native):
    from modelopt_lite.functional import library_minifloat as LF

    x = torch.tensor([-70000.0, -3.0, 0.2, 6.5, 57344.0], requires_grad=True)
    with backend.use_backend("native"):
        LF.fake_e2m1(x, torch.tensor(1.0)).sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0]))
    x.grad = None
    with backend.use_backend("native"):
        LF.fake_e5m2(x, torch.tensor(1.0)).sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]))
    with torch.device("meta"):
        y = torch.ops.modelopt_lite.fake_e5m2(torch.empty(3, 4, dtype=torch.float16), torch.empty(3, 1))
    assert y.shape == (3, 4) and y.dtype == torch.float16


def test_preallocated_out(native, impl):
    x = blocked_data(torch.float16, 64, seed=9)
    gs = MS.nvfp4_global_scale(x.float().abs().amax())
    y = torch.full_like(x, float("nan"))
    assert native.fake_nvfp4(x, gs, 16, y) is not None
    same(y, MS.fake_nvfp4(x, gs, 16), "nvfp4 out=")
    native.fake_mx(x, "e5m2", 32, "rceil", y)
    same(y, MS.fake_mx(x, "e5m2", 32, "rceil"), "mx out=")
    for bad in (torch.empty(3, 64, dtype=torch.float16), torch.empty_like(x, dtype=torch.float32), x):
        with pytest.raises(ValueError, match="out must be a contiguous CPU tensor of x's shape and dtype"):
            native.fake_mx(x, "e4m3", 32, "floor", bad)
