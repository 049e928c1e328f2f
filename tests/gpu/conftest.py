"""GPU tests: every test in this folder is skipped when torch has no usable CUDA device."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_module():
    """The JIT-built CUDA extension (the module the backend routes CUDA tensors to); fails loudly if it won't build."""
    from modelopt_lite.functional import backend

    mod = backend._load("cuda")
    if mod is None:
        pytest.fail(f"the CUDA kernels failed to build: {backend.native_error('cuda')}")
    return mod
