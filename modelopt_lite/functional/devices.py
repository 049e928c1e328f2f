"""A tensor's device type on the per-call hot path.

``t.device.type`` builds a ``torch.device`` on every read (about 0.3 us on a fast CPU; bench/cuda_call_latency.py
measured a GPU machine's host at about 5x the Python time of our development CPUs), while ``t.is_cuda`` /
``t.is_cpu`` are plain flag reads. The ops and the deferred checks read the device type of every call's input.
"""

from __future__ import annotations

import torch


def device_type(t: torch.Tensor) -> str:
    """``t.device.type``, read cheaply for CUDA and CPU tensors."""
    if t.is_cuda:
        return "cuda"
    if t.is_cpu:
        return "cpu"
    return t.device.type
