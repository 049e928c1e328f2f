"""functional/devices.device_type: the cheap read of a tensor's device type equals ``t.device.type``."""

import pytest
import torch

from modelopt_lite.functional.devices import device_type


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_device_type_matches_torch(device):
    t = torch.empty(3, device=device)
    assert device_type(t) == t.device.type == device
    assert device_type(t[1:]) == device  # views too


def test_device_type_cuda_flag_first():
    """A tensor whose ``is_cuda`` is set reads "cuda" without building a torch.device (a stand-in: no GPU here)."""

    class Flags:
        is_cuda, is_cpu = True, False

        @property
        def device(self):
            raise AssertionError("t.device read")

    assert device_type(Flags()) == "cuda"  # type: ignore[arg-type]
