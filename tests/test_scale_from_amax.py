"""scales.scale_from_amax against its definition spelled out, over random float32 bit patterns and the edges, and
the number of ops it and the amax check issue (each one a kernel launch on a GPU, paid on every quantizer call)."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames as _Ops

import modelopt_lite.tensor_quant as tq
from modelopt_lite.functional import amax_scale, backend
from modelopt_lite.functional.checks import check_amax_values
from modelopt_lite.functional.scales import _overflow_threshold, scale_from_amax

FLT_MAX = 3.4028234663852886e38


def definition(amax: torch.Tensor, bound: float) -> torch.Tensor:
    """float32(amax) / float32(bound); the float32 just below it where the grid end bound * scale overflows a
    finite amax; +0.0 where amax <= 2**-24."""
    a = amax.float()
    b = torch.tensor(float(bound))
    s = a / b
    s = torch.where(torch.isinf(s * b) & torch.isfinite(a), s * (1.0 - 2.0**-24), s)
    return torch.where(a <= 2.0**-24, torch.zeros_like(a), s)


def _amaxes() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    top = torch.arange(0x7F7FFFFF - 4096, 0x7F800002, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edges = torch.tensor([0.0, -0.0, 2.0**-24, 2.0**-25, 1e-30, FLT_MAX, float("inf"), float("nan"), -1.0, 1.0])
    return torch.cat([a, -a, top, edges])


@pytest.mark.parametrize("bound", [0.5, 1.0, 3.0, 6.0, 7.0, 15.0, 127.0, 255.0, 448.0, 2688.0, 57344.0, 65535.0])
def test_scale_from_amax_is_its_definition_bit_for_bit(bound):
    a = _amaxes()
    got, want = scale_from_amax(a, bound), definition(a, bound)
    assert got.dtype == torch.float32
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), a[~same][:5]


def test_overflow_thresholds():
    assert _overflow_threshold(448.0) is None and _overflow_threshold(6.0) is None
    assert _overflow_threshold(127.0) == FLT_MAX  # only the largest float32 amax overflows 127 * scale
    assert _overflow_threshold(0.5) == 2.0**127  # from here amax / 0.5 is Inf itself
    s = scale_from_amax(torch.tensor([FLT_MAX]), 127.0)
    assert bool(torch.isfinite(s * torch.tensor(127.0)).all()) and s.item() < FLT_MAX / 127.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0, -1e-3])
def test_amax_check_rejects_nonfinite_and_negative(dtype, value):
    with pytest.raises(ValueError, match=r"^amax must be finite and >= 0, got "):
        check_amax_values(torch.tensor([1.0, value], dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_amax_check_accepts_zero_signed_zero_and_the_largest_value(dtype):
    check_amax_values(torch.tensor([0.0, -0.0, torch.finfo(dtype).max, 1.0], dtype=dtype))


def test_per_tensor_fake_quant_issues_two_ops_on_the_cpu(native):
    """The amax check and the scale in one native call (amax_scale.checked_scale: its output is the one op seen),
    then the kernel: 2 ops, where the torch ops took 12 (clamp, ne, any, the host read; the scalar, div, the 127
    overflow guard ge, mul, where; the dead-slice fill le, masked_fill) and 23 before them."""
    x = torch.randn(8, 16)
    amax = x.abs().amax()
    tq.fake_tensor_quant(x, amax, 8)
    with _Ops() as c:
        tq.fake_tensor_quant(x, amax, 8)
    assert c.ops == ["empty", "fake_quant_int"]
    with backend.use_backend("reference"), _Ops() as c:  # the torch expression (the reference has no native call)
        tq.fake_tensor_quant(x, amax, 8)
    assert c.ops == [
        "clamp",
        "ne",
        "any",
        "_local_scalar_dense",
        "lift_fresh",
        "div",
        "ge",
        "mul",
        "where",
        "le",
        "masked_fill",
        "fake_quant_int",
    ]


@pytest.mark.parametrize("bound", [0.5, 1.0, 6.0, 7.0, 127.0, 255.0, 448.0, 57344.0])
def test_native_checked_scale_is_the_definition_bit_for_bit(native, bound):
    a = _amaxes()
    ok = (a >= 0) & (a <= FLT_MAX)
    scale, bad = native.checked_scale(a[ok], bound)
    want = definition(a[ok], bound)
    assert bad == -1 and scale.dtype == torch.float32 and scale.shape == want.shape
    assert torch.equal(scale.view(torch.int32), want.view(torch.int32))
    good = a[ok]
    view = good[: good.numel() // 7 * 7].reshape(-1, 7)[:, ::2]  # not contiguous
    got, after = amax_scale.checked_scale(view, bound)  # the public path
    assert after() is None and torch.equal(got, scale_from_amax(view, bound))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0, -1e-30])
def test_native_checked_scale_raises_the_torch_check_message(native, value):
    """The first bad amax in the flattened order (of a non-contiguous amax too), quoted as check_amax_values does."""
    base = torch.tensor([[1.0, 2.0, 3.0], [4.0, value, -5.0]])
    for amax in (base, base.t(), base[:, 1:]):
        with pytest.raises(ValueError) as native_err:
            amax_scale.checked_scale(amax, 127.0, what="amax of q")
        with pytest.raises(ValueError) as torch_err:
            check_amax_values(amax, "amax of q")
        assert str(native_err.value) == str(torch_err.value)
        assert str(native_err.value).startswith("amax of q must be finite and >= 0, got ")
    _, bad = native.checked_scale(base, 127.0)
    assert bad == 4


def test_native_checked_scale_is_not_taken_where_the_expression_is_needed(native):
    """A learnable amax keeps the differentiable torch expression; a float16 amax and other devices never reach it."""
    amax = torch.tensor([2.0, 3.0], requires_grad=True)
    scale, _ = amax_scale.checked_scale(amax, 127.0)
    assert scale.requires_grad
    scale.sum().backward()
    assert torch.equal(amax.grad, torch.full((2,), 1.0 / 127.0))
    with pytest.raises(TypeError, match="amax must be float32, got Half"):
        native.checked_scale(torch.ones(2, dtype=torch.float16), 127.0)
    with pytest.raises(ValueError, match="amax must be on the CPU, got meta"):
        native.checked_scale(torch.ones(2, device="meta"), 127.0)
