"""The native CPU kernels' huge-page advice on large fresh outputs: opt-in, and the same bits either way."""

from __future__ import annotations

import pytest
import torch

from modelopt_lite.functional import backend, reference


@pytest.fixture
def native():
    n = backend._load("cpu")
    if n is None or not hasattr(n, "set_huge_page_advice"):
        pytest.skip(f"native CPU kernels unavailable: {backend.native_error('cpu')}")
    yield n
    n.set_huge_page_advice(None)


def test_advice_is_opt_in(native, monkeypatch):
    monkeypatch.delenv("MODELOPT_LITE_HUGEPAGES", raising=False)
    native.set_huge_page_advice(None)
    assert native.huge_page_advice() is False  # off by default: it can stall (compaction, VM page reporting)
    monkeypatch.setenv("MODELOPT_LITE_HUGEPAGES", "1")
    native.set_huge_page_advice(None)
    assert native.huge_page_advice() is True
    monkeypatch.setenv("MODELOPT_LITE_HUGEPAGES", "0")
    native.set_huge_page_advice(None)
    assert native.huge_page_advice() is False
    native.set_huge_page_advice(True)
    assert native.huge_page_advice() is True


@pytest.mark.parametrize("advice", [True, False])
def test_large_outputs_identical_with_and_without_advice(native, advice):
    native.set_huge_page_advice(advice)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1024, 1024, generator=g) * 3  # 12 MiB: above the 4 MiB threshold of the huge-page path
    scale = torch.tensor(3.0 / 127)
    y = native.fake_quant_int(x, scale, -128, 127)
    assert y.shape == x.shape and y.dtype == torch.float32 and y.is_contiguous()
    assert torch.equal(y, reference.fake_quant_int(x, scale, -128, 127))
    assert torch.equal(native.quantize_int(x, scale, -128, 127), reference.quantize_int(x, scale, -128, 127))
