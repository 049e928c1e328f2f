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
