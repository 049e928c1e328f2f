"""fake2real asks QuantModuleRegistry which quantized classes convert (issue 14): the class registered for a float
class with a real counterpart converts, whatever it is; a class the registry no longer names does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.nn import QuantLinear, QuantModuleRegistry
from modelopt_lite.real import QuantizedLinear, fake2real
from modelopt_lite.real.convert import convertible_classes, real_kind


class MyQuantLinear(QuantLinear):
    """A user's quantized Linear (same numerics), registered in place of QuantLinear."""


@pytest.fixture
def my_linear():
    old = QuantModuleRegistry.get(nn.Linear)
    QuantModuleRegistry.add(nn.Linear, MyQuantLinear)
    try:
        yield
    finally:
        QuantModuleRegistry.add(nn.Linear, old)


def _x():
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(4))


def _quantized():
    torch.manual_seed(0)
    return mtq.quantize(nn.Sequential(nn.Linear(8, 4)), mtq.INT8_DEFAULT_CFG, lambda m: m(_x()))


def test_default_registry_decides_the_real_types():
    m = _quantized()
    assert real_kind(m[0]) == "QuantizedLinear"
    names = {c.__name__ for c in convertible_classes()}
    assert names == {"QuantLinear", "QuantConv2d", "QuantMaxPool1d", "QuantMaxPool2d", "QuantMaxPool3d"}


def test_a_registered_user_class_converts_bit_exactly(my_linear):
    torch.manual_seed(0)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    m = mtq.quantize(nn.Sequential(nn.Linear(64, 16)), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, lambda mm: mm(x))
    assert type(m[0]) is MyQuantLinear and real_kind(m[0]) == "QuantizedLinear"
    real = fake2real(m, inplace=False)
    assert isinstance(real[0], QuantizedLinear) and real[0].compute == "dequant"
    with torch.no_grad():
        assert torch.equal(real(x), m(x))


def test_a_class_the_registry_no_longer_names_does_not_convert():
    m = _quantized()  # QuantLinear
    old = QuantModuleRegistry.get(nn.Linear)
    QuantModuleRegistry.add(nn.Linear, MyQuantLinear)
    try:
        assert real_kind(m[0]) is None
        with pytest.raises(
            ValueError, match=r"'0' \(QuantLinear\) has enabled quantizers but no real INT8 .*MyQuantLinear"
        ):
            fake2real(m, inplace=False)
    finally:
        QuantModuleRegistry.add(nn.Linear, old)
    assert isinstance(fake2real(m, inplace=False)[0], QuantizedLinear)
