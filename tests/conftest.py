"""Shared fixtures. ``pytest -m "not slow" tests`` is the quick developer loop: it skips the tests marked
``@pytest.mark.slow`` (over ~3 s each: real-model MiniLM exports, demo runs, multi-process calibration); CI and
the README's command run them all."""

import os

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
