"""Shared fixtures. ``pytest -m "not slow" tests`` is the quick developer loop: it skips the tests marked
``@pytest.mark.slow`` (over ~3 s each: real-model MiniLM exports, demo runs, multi-process calibration); CI and
the README's command run them all."""

import os
from pathlib import Path

import pytest
import torch
from onnx_marker import uses_onnx

torch.manual_seed(0)


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


def native_available() -> bool:
    from modelopt_lite.functional import backend

    if os.environ.get("MODELOPT_LITE_BACKEND", "auto") == "reference":
        return False
    return backend._load("cpu") is not None


# --- trained example models, trained once per test session (lazily, per kind) ---------------------------------------
@pytest.fixture(scope="session")
def digits_data():
    """The digits split of ``modelopt_lite.examples`` (train / calibration / test)."""
    from modelopt_lite.examples import load_digits_data

    return load_digits_data()


@pytest.fixture(scope="session")
def _trained_digits_cache():
    return {}


@pytest.fixture
def digits_model(digits_data, _trained_digits_cache):
    """``digits_model("cnn" | "mlp")``: a fresh float copy of a digits model trained once per session."""
    import copy

    from modelopt_lite.examples import trained_digits_model

    def make(kind: str = "cnn"):
        if kind not in _trained_digits_cache:
            _trained_digits_cache[kind] = trained_digits_model(kind, data=digits_data)
        return copy.deepcopy(_trained_digits_cache[kind]).eval()

    return make


@pytest.fixture(scope="module")
def native():
    """The native CPU kernel module (skip without a C++ toolchain; fail if the build fails)."""
    import shutil

    from modelopt_lite.functional import backend

    mod = backend._load("cpu")
    if mod is None:
        if shutil.which("c++") is None or shutil.which("ninja") is None:
            pytest.skip(f"no C++ toolchain to build the native kernels: {backend.native_error('cpu')}")
        pytest.fail(f"the native CPU kernels failed to build: {backend.native_error('cpu')}")
    return mod


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def impl(request, native):
    """Each CPU kernel path forced in turn (one the CPU lacks is skipped, naming it), then back to "auto".

    The AVX-512 set runs the MX kernels of the AVX2 one (mx_avx2.cpp has no 16-lane form)."""
    try:
        native.set_kernel_impl(request.param)
    except ValueError as e:
        pytest.skip(f"{request.param} kernels unavailable on this CPU: {e}")
    assert native.kernel_impl() == request.param
    assert native.mx_kernel_impl() == ("avx2" if request.param == "avx512" else request.param)
    yield request.param
    native.set_kernel_impl("auto")


# --- the "onnx" marker (tests/onnx_marker.py): .ci/run reruns ``pytest -m onnx`` with the oldest onnx/onnxruntime --
def pytest_collection_modifyitems(config, items):
    for item in items:
        if uses_onnx(Path(str(item.fspath))):
            item.add_marker(pytest.mark.onnx)
