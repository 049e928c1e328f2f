"""scales.scale_from_amax against its definition spelled out, over random float32 bit patterns and the edges, and
the number of ops it and the amax check issue (each one a kernel launch on a GPU, paid on every quantizer call)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import modelopt_lite.tensor_quant as tq
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


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_per_tensor_fake_quant_issues_twelve_ops_on_the_cpu():
    """The amax check (clamp, ne, any, the host read), the scale (scalar, div, the 127 overflow guard: ge, mul,
    where; the dead-slice fill: le, masked_fill) and the kernel: 12 ops, 23 before."""
    x = torch.randn(8, 16)
    amax = x.abs().amax()
    tq.fake_tensor_quant(x, amax, 8)  # the threshold of 127 computed outside the count
    with _Ops() as c:
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
