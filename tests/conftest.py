"""Shared fixtures. ``pytest -m "not slow" tests`` is the quick developer loop: it skips the tests marked
``@pytest.mark.slow`` (over ~3 s each: real-model MiniLM exports, demo runs, multi-process calibration); CI and
the README's command run them all."""

import ast
import functools
import os
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(params=["avx2", "scalar"])
def impl(request, native):
    """Each CPU kernel path forced in turn (the AVX2 one skipped on a CPU without AVX2), then back to "auto"."""
    try:
        native.set_kernel_impl(request.param)
    except ValueError:
        pytest.skip("AVX2 kernels unavailable on this CPU")
    assert native.kernel_impl() == request.param and native.mx_kernel_impl() == request.param
    yield request.param
    native.set_kernel_impl("auto")


# --- the "onnx" marker: every test of a module that uses onnx or onnxruntime (.ci/run runs them again with the
# oldest supported onnx and onnxruntime: ``pytest -m onnx``) -------------------------------------------------------
ONNX_MODULES = ("onnx", "onnxruntime", "onnx_helpers", "modelopt_lite.onnx_export")
ONNX_CALLS = {"export_onnx", "inspect_onnx", "compare_with_onnxruntime", "ort_session"}


@functools.cache
def uses_onnx(path: Path) -> bool:
    """True when a test module imports onnx, onnxruntime or the ONNX export (anywhere in it, importorskip
    included) or calls the export by attribute (``mtq.export_onnx``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args:
            names += [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.Attribute) and node.attr in ONNX_CALLS:
            return True
    return any(n == m or n.startswith(m + ".") for n in names for m in ONNX_MODULES)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if uses_onnx(Path(str(item.fspath))):
            item.add_marker(pytest.mark.onnx)
