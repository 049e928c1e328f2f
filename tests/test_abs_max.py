"""functional/abs_max.py: max |x| in one pass (torch.aminmax) where torch can, equal to max(max(x), -min(x)) bit for
bit (NaN, Inf, signed zeros, every dtype), and the two reductions where a trace must keep ops every exporter knows."""

from __future__ import annotations

import pytest
import torch
from op_names import OpNames as _Ops

from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.functional.abs_max import abs_max
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.utils import reduce_amax

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _two_pass(x, dims, keepdim):
    if dims is None:
        return torch.maximum(x.amax(), -x.amin())
    return torch.maximum(x.amax(dim=dims, keepdim=keepdim), -x.amin(dim=dims, keepdim=keepdim))


def _x(dtype):
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 0, 0] = float("nan")
    x[1, 2, :] = -0.0
    x[2, 1, 3] = -float("inf")
    x[3] = -x[3].abs()  # a slice with no positive value
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [None, [0], [2], [1, 2], [0, 2], []], ids=str)
@pytest.mark.parametrize("keepdim", [False, True])
def test_equals_the_two_reductions(dtype, dims, keepdim):
    x = _x(dtype)
    got, want = abs_max(x, dims, keepdim), _two_pass(x, dims, keepdim)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.signbit(), want.signbit())


def test_one_pass_in_eager_two_reductions_under_tracing():
    x = torch.randn(8, 16)
    for dims, want in ((None, ["aminmax", "neg", "maximum"]), ([1], ["aminmax", "neg", "maximum"])):
        with _Ops() as c:
            abs_max(x, dims, keepdim=True)
        assert c.ops == want, dims
    with _Ops() as c:
        abs_max(x, [0, 1], keepdim=True)
    assert c.ops == ["amax", "amin", "neg", "maximum"]
    traced = torch.jit.trace(lambda t: abs_max(t, [1], keepdim=True), x)
    kinds = {n.kind() for n in traced.graph.nodes()}
    assert "aten::amax" in kinds and "aten::amin" in kinds and "aten::aminmax" not in kinds
    assert torch.equal(traced(x), abs_max(x, [1], keepdim=True))


def test_dynamic_quantizer_reads_its_input_once_for_the_amax():
    x = torch.randn(16, 32)
    q = TensorQuantizer(QuantDescriptor(num_bits=8, axis=0, dynamic=True))
    q(x)
    with _Ops() as c:
        y = q(x)
    assert c.ops.count("aminmax") == 1 and "amax" not in c.ops and "amin" not in c.ops
    a = torch.maximum(x.amax(1, keepdim=True), -x.amin(1, keepdim=True))
    assert torch.equal(y, TensorQuantizer(QuantDescriptor(num_bits=8, axis=0, amax=a.flatten().tolist()))(x))


def test_reduce_amax_keeps_its_values():
    x = _x(torch.float32).nan_to_num(nan=1.0)
    assert torch.equal(reduce_amax(x), x.abs().amax())
    assert torch.equal(reduce_amax(x, axis=1), x.abs().amax(1, keepdim=True))
    assert torch.equal(reduce_amax(x, axis=(0, 2), keepdims=False), x.abs().amax((0, 2)))
    assert torch.equal(reduce_amax(x, axis=[]), x.abs().amax().reshape(()))
