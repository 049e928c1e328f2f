"""First-principles tests of the E2M1/E4M3/E5M2 element grids, NVFP4 and OCP MX (functional/microscaling.py).

The expected values are computed independently: element grids enumerated from their codes, the nearest value
chosen with ties going to the even code, scalar float32 arithmetic in numpy, exponents from Python's math.frexp.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from modelopt_lite.functional import microscaling as mx

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _levels(dtype, ncodes):
    return torch.arange(ncodes, dtype=torch.uint8).view(dtype).double().tolist()


E4M3 = _levels(torch.float8_e4m3fn, 0x7F)  # 0x7F is NaN
E5M2 = _levels(torch.float8_e5m2, 0x7C)  # 0x7C is +Inf


def _nearest_even(levels, v):
    """Nearest of the ascending non-negative ``levels`` to |v| (ties to the even index = even code), saturating."""
    m = min(abs(v), levels[-1])
    i = min(range(len(levels)), key=lambda j: (abs(levels[j] - m), j % 2))
    return -levels[i] if v < 0 else levels[i]


def _ties(levels):
    return [(a + b) / 2 for a, b in zip(levels, levels[1:])]


# --- element grids -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "v, want", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0), (6.0, 6.0)]
)
def test_e2m1_named_ties(v, want):
    got = mx.e2m1_round(torch.tensor([v, -v]))
    assert got.dtype == torch.float32
    assert got.tolist() == [want, -want]


@pytest.mark.parametrize("name, levels, fn", [("e2m1", E2M1, mx.e2m1_round), ("e4m3", E4M3, mx.e4m3_round),
                                              ("e5m2", E5M2, mx.e5m2_round)])  # fmt: skip
def test_every_tie_and_level(name, levels, fn):
    vals = levels + _ties(levels)
    vals += [np.nextafter(np.float32(t), np.float32(0)).item() for t in _ties(levels)]
    vals += [np.nextafter(np.float32(t), np.float32(np.inf)).item() for t in _ties(levels)]
    vals = [v for v in vals if v != 0] + [0.0]
    x = torch.tensor(vals + [-v for v in vals], dtype=torch.float32)
    want = torch.tensor([_nearest_even(levels, v) for v in x.tolist()], dtype=torch.float32)
    got = fn(x)
    assert torch.equal(got, want), name
    assert torch.equal(torch.signbit(got[x != 0]), x[x != 0] < 0), name  # a negative value that rounds to 0 is -0


@pytest.mark.parametrize("fn, top", [(mx.e2m1_round, 6.0), (mx.e4m3_round, 448.0), (mx.e5m2_round, 57344.0)])
def test_saturation(fn, top):
    x = torch.tensor([top, top * 1.01, top * 1.2, 3e38, -top * 1.2, -3e38], dtype=torch.float32)
    assert fn(x).tolist() == [top, top, top, top, -top, -top]


def test_subnormals():
    # E4M3: smallest subnormal 2**-9; 2**-10 is the tie to 0 (even); 1.5 * 2**-9 ties to 2**-8 (code 2, even)
    got = mx.e4m3_round(torch.tensor([2.0**-10, 2.0**-10 * 1.01, 1.5 * 2**-9, 2.0**-9 * 0.75]))
    assert got.tolist() == [0.0, 2.0**-9, 2.0**-8, 2.0**-9]
    # E5M2: smallest subnormal 2**-16
    got = mx.e5m2_round(torch.tensor([2.0**-17, 2.0**-17 * 1.01, 3 * 2**-17, 2.0**-16]))
    assert got.tolist() == [0.0, 2.0**-16, 2.0**-15, 2.0**-16]
    # E2M1's only subnormal is 0.5
    assert mx.e2m1_round(torch.tensor([0.26, 0.24, 0.5])).tolist() == [0.5, 0.0, 0.5]


def test_e2m1_codes_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = mx.e2m1_decode(codes)
    assert vals.tolist() == E2M1 + [-v for v in E2M1]
    assert torch.signbit(vals[8]).item()  # code 8 is -0.0
    back = mx.e2m1_codes(vals)
    assert back.dtype == torch.uint8
    assert back.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15]  # -0.0 is not < 0: code 0
    assert mx.e2m1_codes(torch.tensor([-0.1, 0.1, -100.0])).tolist() == [8, 0, 15]


# --- NVFP4 ---------------------------------------------------------------------------------------------------------
def _np_nvfp4(x: np.ndarray, amax: float, block: int):
    """Scalar float32 NVFP4 written from the spec (numerics.md), independent of the module."""
    f = np.float32
    gs = f(amax) / f(2688.0) if amax > 2.0**-24 else f(0)
    d = f(6.0) * gs
    y = np.zeros_like(x)
    for r in range(x.shape[0]):
        for b0 in range(0, x.shape[1], block):
            blk = x[r, b0 : b0 + block]
            if d == 0:
                continue
            ratio = min(float(f(np.abs(blk).max()) / d), 448.0)
            s = f(_nearest_even(E4M3, ratio))
            ds = f(s * gs)
            if ds == 0:
                continue
            for i, v in enumerate(blk):
                y[r, b0 + i] = f(_nearest_even(E2M1, float(f(v) / ds))) * ds
    return y


@pytest.mark.parametrize("block", [16, 32])
def test_nvfp4_from_first_principles(block):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * block + 5, generator=g) * torch.tensor([[1.0], [1e-3], [300.0]])
    x[1, :block] = 0  # an all-zero block
    amax = float(x.abs().max())
    gs = mx.nvfp4_global_scale(torch.tensor(amax))
    assert gs.dtype == torch.float32 and gs.item() == np.float32(amax) / np.float32(2688.0)
    y = mx.fake_nvfp4(x, gs, block)
    want = _np_nvfp4(x.numpy(), amax, block)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.array_equal(y.numpy(), want)
    codes, scales = mx.quantize_nvfp4(x, gs, block)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and int(codes.max()) <= 15
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (3, 3)
    assert torch.equal(mx.dequantize_nvfp4(codes, scales, gs, block), y)
    assert torch.equal(mx.nvfp4_block_scales(x, gs, block), scales.float())


def test_nvfp4_static_global_amax_saturates():
    x = torch.tensor([[10.0] * 8 + [-1.0] * 8])
    gs = mx.nvfp4_global_scale(torch.tensor(1.0))  # calibrated amax 1, data reaches 10
    s = mx.nvfp4_block_scales(x, gs)
    assert s.tolist() == [[448.0]]  # block scale saturates
    y = mx.fake_nvfp4(x, gs)
    ds = np.float32(448.0) * gs.numpy()
    assert y[0, 0].item() == np.float32(6.0) * ds  # saturates at 6 * 448 * gs = the calibrated amax (rounded)
    assert y[0, 8].item() == -(np.float32(6.0) * ds)  # -1 / ds rounds to -6 as well


def test_nvfp4_dead_blocks_give_zeros():
    x = torch.zeros(2, 32)
    x[0, 16:] = 1.0
    x[1, :16] = 1e-9  # its scale rounds to 0 next to amax 1 (ratio below 2**-10 / 448)
    gs = mx.nvfp4_global_scale(torch.tensor(1.0))
    y = mx.fake_nvfp4(x, gs)
    assert not torch.isnan(y).any()
    assert torch.equal(y[:, :16], torch.zeros(2, 16)) and not torch.signbit(y[:, :16]).any()
    assert torch.equal(y[0, 16:], torch.ones(16))
    codes, scales = mx.quantize_nvfp4(x, gs)
    assert codes[:, :16].eq(0).all() and scales.float()[:, 0].eq(0).all()
    # a dead tensor: global amax 0 (or <= 2**-24)
    for amax in (0.0, 2.0**-25):
        gz = mx.nvfp4_global_scale(torch.tensor(amax))
        assert gz.item() == 0.0
        assert torch.equal(mx.fake_nvfp4(x, gz), torch.zeros_like(x))


def test_nvfp4_partial_last_block_is_zero_padded():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 21, generator=g)
    gs = mx.nvfp4_global_scale(x.abs().amax())
    padded = torch.cat([x, torch.zeros(4, 11)], dim=1)
    assert torch.equal(mx.fake_nvfp4(x, gs), mx.fake_nvfp4(padded, gs)[:, :21])
    assert mx.quantize_nvfp4(x, gs)[1].shape == (4, 2)


def test_nvfp4_half_dtypes_keep_dtype():
    x = torch.randn(2, 16).to(torch.bfloat16)
    gs = mx.nvfp4_global_scale(x.float().abs().amax())
    y = mx.fake_nvfp4(x, gs)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, mx.fake_nvfp4(x.float(), gs).to(torch.bfloat16))


# --- MX ------------------------------------------------------------------------------------------------------------
_EMAX = {"e4m3": (8, 448.0), "e5m2": (15, 57344.0), "e2m1": (2, 6.0), "int8": (0, 127 / 64)}


def _py_exponent(a: float, elem: str, rounding: str) -> int:
    emax, top = _EMAX[elem]
    if a == 0:
        return -127
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    k = (e - 1) - emax
    if rounding == "rceil":  # smallest k with a / 2**k <= top
        k = next(j for j in range(k - 2, k + 3) if a / 2.0**j <= top)
    return max(-127, min(127, k))


@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1", "int8"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_e8m0_exponent_rule(elem, rounding):
    emax, top = _EMAX[elem]
    sig = top / 2.0**emax
    amaxes = [1.0, 1.5, 1.75, 1.9999, sig, float(np.nextafter(np.float32(sig), np.float32(2)))]
    amaxes = [a * 2.0**e for a in amaxes for e in (-3, 0, 7, 20)]
    amaxes += [0.0, 2.0**-149, 2.0**-130, 1.5 * 2**-126, 3e38, 2.0**127]
    x = torch.zeros(len(amaxes), 32)
    x[:, 5] = torch.tensor(amaxes)
    x[:, 6] = -x[:, 5] / 2
    k = mx.mx_scale_exponents(x, elem, rounding=rounding)
    assert k.dtype == torch.int32 and k.shape == (len(amaxes), 1)
    want = [_py_exponent(float(np.float32(a)), elem, rounding) for a in amaxes]
    assert k[:, 0].tolist() == want
    codes, scales = mx.quantize_mx(x, elem, rounding=rounding)
    assert scales.dtype == torch.uint8 and (scales[:, 0].to(torch.int32) - 127).tolist() == want


def _np_mx(x: np.ndarray, elem: str, rounding: str) -> np.ndarray:
    f = np.float32
    levels = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}.get(elem)
    y = np.zeros_like(x)
    for r in range(x.shape[0]):
        for b0 in range(0, x.shape[1], 32):
            blk = x[r, b0 : b0 + 32]
            k = _py_exponent(float(np.abs(blk).max()), elem, rounding)
            X = f(2.0**k)
            for i, v in enumerate(blk):
                q = float(f(v) / X)
                if levels is None:
                    e = f(min(max(np.round(q * 64), -127), 127) / 64)
                else:
                    e = f(_nearest_even(levels, q))
                y[r, b0 + i] = f(e * X)
    return y


@pytest.mark.parametrize("elem", ["e4m3", "e5m2", "e2m1", "int8"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mx_from_first_principles(elem, rounding):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 70, generator=g) * torch.tensor([[1.0], [2.0**-100], [1e30]])
    x[0, 32:64] = 0  # a dead block
    y = mx.fake_mx(x, elem, rounding=rounding)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert np.array_equal(y.numpy(), _np_mx(x.numpy(), elem, rounding))
    codes, scales = mx.quantize_mx(x, elem, rounding=rounding)
    assert codes.dtype == mx.MX_ELEMENTS[elem].code_dtype and codes.shape == x.shape
    assert scales.shape == (3, 3)
    assert torch.equal(mx.dequantize_mx(codes, scales, elem), y)
    # partial last block = zero padded
    assert torch.equal(y, mx.fake_mx(torch.cat([x, torch.zeros(3, 26)], 1), elem, rounding=rounding)[:, :70])


def test_mx_floor_saturates_rceil_does_not():
    x = torch.zeros(1, 32)
    x[0, 0] = 1.9 * 2**8  # E4M3 floor: k = 0, 486.4 saturates to 448; rceil: k = 1, 243.2 -> 240 * 2
    assert mx.fake_mx(x, "e4m3")[0, 0].item() == 448.0
    assert mx.fake_mx(x, "e4m3", rounding="rceil")[0, 0].item() == 480.0


def test_mxint8_grid():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([1.0, 1.0 / 128, 3.0 / 128, -1.99])  # amax 1.99: k = 0, elements q / 64
    y = mx.fake_mx(x, "int8")
    assert y[0, :4].tolist() == [1.0, 0.0, 2.0 / 64, -127 / 64]
    codes, scales = mx.quantize_mx(x, "int8")
    assert codes.dtype == torch.int8 and codes[0, :4].tolist() == [64, 0, 2, -127] and scales.tolist() == [[127]]


# --- errors --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_raises(bad):
    x = torch.ones(1, 32)
    x[0, 3] = bad
    gs = mx.nvfp4_global_scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match="NVFP4 input contains NaN or Inf"):
        mx.fake_nvfp4(x, gs)
    with pytest.raises(ValueError, match=r"MX \(e2m1\) input contains NaN or Inf"):
        mx.fake_mx(x, "e2m1")
    with pytest.raises(ValueError, match="NVFP4 global amax must be finite"):
        mx.nvfp4_global_scale(torch.tensor(bad))


def test_bad_arguments_raise():
    x = torch.ones(2, 32)
    gs = mx.nvfp4_global_scale(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"NVFP4 block size must be one of \(16, 32\).*got 8"):
        mx.fake_nvfp4(x, gs, 8)
    with pytest.raises(ValueError, match=r"MX block size must be one of \(32,\).*got 16"):
        mx.fake_mx(x, "e4m3", 16)
    with pytest.raises(ValueError, match="MX element format must be one of.*'e3m2'"):
        mx.fake_mx(x, "e3m2")
    with pytest.raises(ValueError, match="MX scale rounding must be one of.*'ceil'"):
        mx.fake_mx(x, "e4m3", rounding="ceil")
    with pytest.raises(ValueError, match="NVFP4 global amax must be finite and >= 0, got -1.0"):
        mx.nvfp4_global_scale(torch.tensor(-1.0))
    with pytest.raises(ValueError, match="global_scale must be a single"):
        mx.fake_nvfp4(x, torch.ones(2), 16)
    with pytest.raises(TypeError, match="must be float32, float16 or bfloat16"):
        mx.fake_mx(x.to(torch.int32), "e4m3")
    with pytest.raises(ValueError, match="at least one dimension"):
        mx.fake_mx(torch.tensor(1.0), "e4m3")


@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 37), (0,)])
def test_empty_inputs_give_empty_codes_and_scales(shape):
    """An empty tensor quantizes to empty codes of its shape and empty scales of (..., blocks), both ways."""
    x = torch.randn(shape)
    nb = -(-shape[-1] // 32)
    codes, scales = mx.quantize_mx(x, "e2m1")
    assert codes.shape == shape and codes.dtype == torch.uint8
    assert scales.shape == (*shape[:-1], nb) and scales.dtype == torch.uint8
    assert mx.dequantize_mx(codes, scales, "e2m1").shape == shape
    codes, scales = mx.quantize_nvfp4(x, torch.tensor(0.01))
    assert codes.shape == shape and scales.shape == (*shape[:-1], -(-shape[-1] // 16))
    assert scales.dtype == torch.float8_e4m3fn
    assert mx.dequantize_nvfp4(codes, scales, torch.tensor(0.01)).shape == shape
    assert mx.fake_mx(x, "e4m3").shape == shape and mx.fake_nvfp4(x, torch.tensor(0.01)).shape == shape
