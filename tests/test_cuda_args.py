"""The ops check the CUDA extension's arguments in Python before calling it (functional/cuda_args.py).

No GPU: a stub registered as the loaded CUDA extension records every call and answers with the CPU reference. Every
bad-argument case of tests/gpu/cuda_cases.py and tests/gpu/mx_cases.py, made through the library ops (the callers
of the binding, same signatures), raises the binding's exception type and message without the stub being called;
valid calls do reach it; value checks (NaN/Inf) stay with the kernels (no extra pass over the data).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from modelopt_lite.functional import backend, library, library_minifloat, library_mx, reference
from modelopt_lite.functional import microscaling as ms

GPU = Path(__file__).resolve().parent / "gpu"
QUANT_OPS = (
    "fake_quant_int",
    "quantize_int",
    "int_backward",
    "fake_e4m3",
    "e4m3_backward",
    "fake_affine",
    "quantize_affine",
    "affine_backward",
)
REFERENCE = {name: getattr(reference, name) for name in QUANT_OPS} | {
    "fake_nvfp4": ms.fake_nvfp4,
    "fake_mx": ms.fake_mx,
    "nvfp4_backward": ms.nvfp4_backward,
    "mx_backward": ms.mx_backward,
    "fake_e5m2": library_minifloat.fake_e5m2_reference,
    "fake_e2m1": library_minifloat.fake_e2m1_reference,
}
#: the binding's functions as the library exposes them (same names and signatures; histograms have no caller)
OPS = SimpleNamespace(
    **{name: getattr(library, name) for name in QUANT_OPS},
    fake_nvfp4=library_mx.fake_nvfp4,
    fake_mx=library_mx.fake_mx,
    nvfp4_backward=library_mx.nvfp4_backward,
    mx_backward=library_mx.mx_backward,
    fake_e5m2=library_minifloat.fake_e5m2,
    fake_e2m1=library_minifloat.fake_e2m1,
)


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GPU / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


class StubKernels:
    """Stands in for the CUDA extension: records the calls, computes with the CPU reference."""

    def __init__(self):
        self.calls: list[str] = []

    def __getattr__(self, name):
        if name not in REFERENCE:
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            return REFERENCE[name](*args)

        return call


@pytest.fixture
def stub(monkeypatch):
    s = StubKernels()
    monkeypatch.setitem(backend._loaded, "cuda", s)  # what backend.is_native_cuda recognizes
    for lib in (library, library_mx, library_minifloat):
        monkeypatch.setattr(lib, "kernels_for", lambda device_type: s)
    return s


def _bad_cases():
    cuda_cases = _load("cuda_cases")
    _load("mx_cases")  # imported by name by mx_error_cases
    mx_error_cases = _load("mx_error_cases")
    return cuda_cases.error_cases("cpu"), mx_error_cases.error_cases("cpu")


def test_bad_arguments_never_reach_the_extension(stub):
    quant, mx = _bad_cases()
    no_caller = 0
    for call, exc, msg in quant + mx:
        try:
            with pytest.raises(exc, match=msg):
                call(OPS)
        except AttributeError as e:  # histogram_rows / histogram: no library op calls them
            assert "histogram" in str(e)
            no_caller += 1
        assert stub.calls == [], (msg, stub.calls)
    assert no_caller == 2 and len(quant) + len(mx) == 22


def test_messages_are_the_bindings():
    x = torch.randn(4, 5)
    s = torch.full((1,), 0.1)
    cases = [
        (
            lambda: library.fake_quant_int(x, s, 8, 7),
            "modelopt_lite CUDA kernels, fake_quant_int: qmin must be <= qmax, got qmin=8, qmax=7",
        ),
        (
            lambda: library.quantize_int(x, s, -(2**25), 7),
            "modelopt_lite CUDA kernels, quantize_int: qmin/qmax must be in [-2**24, 2**24], got -33554432, 7",
        ),
        (
            lambda: library.fake_quant_int(x, torch.ones(3, 1), -8, 7),
            "modelopt_lite CUDA kernels, fake_quant_int: scale of shape [3, 1] does not broadcast to x of shape "
            "[4, 5] (dim 0)",
        ),
        (
            lambda: library.fake_affine(x, s, torch.zeros(1, 1, 5), -8, 7),
            "modelopt_lite CUDA kernels, fake_affine: zero_point of shape [1, 1, 5] does not broadcast to x of "
            "shape [4, 5]",
        ),
        (
            lambda: library.fake_e4m3(x, torch.empty(0)),
            "modelopt_lite CUDA kernels, fake_e4m3: scale is empty",
        ),
        (
            lambda: library.e4m3_backward(torch.ones(5, 4), x, s, False),
            "modelopt_lite CUDA kernels, e4m3_backward: grad of shape [5, 4] does not match x of shape [4, 5]",
        ),
        (
            lambda: library_minifloat.fake_e2m1(x, torch.ones(1, 1, 1)),
            "modelopt_lite CUDA kernels, fake_e2m1: scale of shape [1, 1, 1] does not broadcast to x of shape [4, 5]",
        ),
    ]
    stub_kernels = StubKernels()
    with pytest.MonkeyPatch.context() as m:
        m.setitem(backend._loaded, "cuda", stub_kernels)
        for lib in (library, library_mx, library_minifloat):
            m.setattr(lib, "kernels_for", lambda device_type: stub_kernels)
        for call, text in cases:
            with pytest.raises(ValueError) as info:
                call()
            assert str(info.value) == text
    assert stub_kernels.calls == []


def test_type_errors_name_the_argument(stub):
    x = torch.randn(4, 5)
    with pytest.raises(TypeError, match=r"int_backward: grad must be float32, float16 or bfloat16, got torch.int64"):
        library.int_backward(torch.ones(4, 5, dtype=torch.int64), x, torch.ones(1), -8, 7, False)
    with pytest.raises(TypeError, match=r"fake_affine: zero_point must be a floating-point tensor, got torch.int32"):
        library.fake_affine(x, torch.ones(1), torch.zeros(1, dtype=torch.int32), -8, 7)
    assert stub.calls == []


def test_valid_arguments_reach_the_extension(stub):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 40, generator=g)
    s = x.abs().amax(dim=1, keepdim=True) / 127
    zp = torch.zeros(4, 1)
    calls = [
        ("fake_quant_int", lambda: library.fake_quant_int(x, s, -128, 127)),
        ("fake_quant_int", lambda: library.fake_quant_int(x, s.reshape(-1, 1), 0, 0)),  # qmin == qmax is valid
        ("int_backward", lambda: library.int_backward(x, x, s, -128, 127, True)),
        ("fake_affine", lambda: library.fake_affine(x, s, zp, -128, 127)),
        ("fake_e4m3", lambda: library.fake_e4m3(x, torch.tensor(0.01))),
        ("fake_e4m3", lambda: library.fake_e4m3(x[0, 0], torch.ones(1, 1, 1))),  # one element: any rank
        ("fake_nvfp4", lambda: library_mx.fake_nvfp4(x, torch.tensor(0.001), 16)),
        ("fake_mx", lambda: library_mx.fake_mx(x, "e2m1", 32, "rceil")),
        ("fake_e5m2", lambda: library_minifloat.fake_e5m2(x, s.reshape(4, 1))),
        ("fake_e2m1", lambda: library_minifloat.fake_e2m1(x, torch.ones(40))),  # lower rank: aligned to the last dim
    ]
    for name, call in calls:
        stub.calls.clear()
        call()
        assert stub.calls == [name]


def test_value_checks_stay_with_the_kernels(stub):
    """NaN/Inf inputs are found by the kernels (in their block-max pass), not by a Python pass over the data."""
    x = torch.randn(2, 32)
    x[1, 3] = math.nan
    with pytest.raises(ValueError, match=r"MX \(e4m3\) input contains NaN or Inf \(nan\)"):
        library_mx.fake_mx(x, "e4m3", 32, "floor")
    assert stub.calls == ["fake_mx"]


def test_other_kernels_are_not_checked_here(monkeypatch):
    """Only the CUDA extension gets the Python checks: the CPU extension validates (and raises) on its own."""
    s = StubKernels()
    monkeypatch.setattr(library, "kernels_for", lambda device_type: s)  # not registered as the CUDA extension
    library.fake_quant_int(torch.randn(3), torch.ones(1), 8, 7)
    assert s.calls == ["fake_quant_int"]
