"""The NVFP4 / MX / E5M2 / E2M1 bindings' errors, shared by tests/gpu/test_cuda_mx.py (real GPU, each case in a child
process) and the host-emulated binding test (tests/test_cuda_binding_emulated.py).

:func:`error_cases`: bad arguments the binding rejects before any launch. :func:`value_error_cases`: NaN / Inf
inputs that the kernels flag and the host turns into ValueError. :func:`flagged_failures`: the ``*_flagged``
bindings (the deferred checks' hot path) against the plain ones.
"""

from __future__ import annotations

import math

import torch
from cuda_cases import DTYPES
from mx_cases import data


def error_cases(device: str):
    """(callable(mod), exception type, message fragment): bad arguments the binding rejects before any launch."""
    x = torch.randn(4, 32, device=device)
    gs = torch.tensor(0.01, device=device)
    s = torch.tensor([0.1], device=device)
    return [
        (lambda m: m.fake_nvfp4(x.to(torch.int32), gs, 16), TypeError, "float32, float16 or bfloat16"),
        (lambda m: m.fake_nvfp4(x, gs, 8), ValueError, r"NVFP4 block size must be one of \(16, 32\)"),
        (lambda m: m.fake_nvfp4(x, torch.ones(2, device=device), 16), ValueError, "single \\(per-tensor\\) value"),
        (lambda m: m.fake_nvfp4(x[0, 0], gs, 16), ValueError, "at least one dimension"),
        (lambda m: m.fake_mx(x, "e3m4", 32, "floor"), ValueError, "MX element format must be one of"),
        (lambda m: m.fake_mx(x, "e4m3", 32, "round"), ValueError, "MX scale rounding must be one of"),
        (lambda m: m.fake_mx(x, "e4m3", 16, "floor"), ValueError, r"MX block size must be one of \(32,\)"),
        (lambda m: m.fake_mx(x.double(), "e2m1", 32, "floor"), TypeError, "float32, float16 or bfloat16"),
        (lambda m: m.fake_e5m2(x.to(torch.int32), s), TypeError, "float32, float16 or bfloat16"),
        (lambda m: m.fake_e2m1(x, torch.ones(3, 1, device=device)), ValueError, "does not broadcast"),
        (lambda m: m.fake_e5m2(x, torch.ones(1, 1, 32, device=device)), ValueError, "does not broadcast"),
        (lambda m: m.nvfp4_backward(x[:2], x, gs, 16), ValueError, "must match x"),
        (lambda m: m.mx_backward(x[:, :16], x, "e4m3", 32, "floor"), ValueError, "must match x"),
        (lambda m: m.mx_backward(x, x, "e4m3", 8, "floor"), ValueError, r"MX block size must be one of \(32,\)"),
    ]


def value_error_cases(device: str):
    """NaN / Inf inputs (fp32, fp16, bf16): the kernels flag them, the host raises ValueError naming the value."""
    out = []
    for dtype in DTYPES:
        for v, text in ((math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")):
            x = torch.randn(3, 70).to(dtype)
            x[2, 65] = v  # in the partial last block
            xd = x.to(device)
            gs = torch.tensor(0.01, device=device)
            out.append((lambda m, xd=xd, gs=gs: m.fake_nvfp4(xd, gs, 16), ValueError, rf"NVFP4 input .*\({text}\)"))
            out.append(
                (lambda m, xd=xd: m.fake_mx(xd, "e2m1", 32, "rceil"), ValueError, rf"MX \(e2m1\) input .*\({text}\)")
            )
            g = torch.ones_like(xd)
            out.append(
                (lambda m, xd=xd, g=g, gs=gs: m.nvfp4_backward(g, xd, gs, 32), ValueError, rf"NVFP4 input .*\({text}\)")
            )
            out.append(
                (
                    lambda m, xd=xd, g=g: m.mx_backward(g, xd, "int8", 32, "floor"),
                    ValueError,
                    rf"MX \(int8\) .*\({text}\)",
                )
            )
    # a bad global scale: the kernel reads it from device memory and flags it (no host read before the launch)
    x = torch.randn(3, 70, device=device)
    for v, text in ((-1.0, "-1"), (math.nan, "nan"), (math.inf, "inf")):
        gs = torch.tensor(v, device=device)
        out.append((lambda m, gs=gs: m.fake_nvfp4(x, gs, 16), ValueError, rf"global_scale must be finite .*{text}"))
        out.append(
            (lambda m, gs=gs: m.nvfp4_backward(x, x, gs, 16), ValueError, rf"global_scale must be finite .*{text}")
        )
    return out


def flagged_failures(mod, device: str) -> list[str]:
    """The ``*_flagged`` bindings (the deferred error checks' hot path: the flag returned, never read) against the
    plain ones: the same output bit for bit, flag 0 on clean input, bit 1 on a NaN/Inf input, bit 2 on a bad NVFP4
    global scale (read by the kernel from device memory); the failure messages."""
    failures = []
    x = data((5, 70), torch.float32, 3).to(device)
    g = torch.ones_like(x)
    gs = torch.tensor(0.01, device=device)
    bad = x.clone()
    bad[4, 66] = math.nan
    calls = {
        "fake_nvfp4": lambda t, s: (t, s, 16),
        "nvfp4_backward": lambda t, s: (g, t, s, 16),
        "fake_mx": lambda t, s: (t, "e4m3", 32, "floor"),
        "mx_backward": lambda t, s: (g, t, "e2m1", 32, "rceil"),
    }
    for name, args in calls.items():
        y, flag = getattr(mod, name + "_flagged")(*args(x, gs))
        if flag.dtype != torch.int32 or flag.shape != (1,) or flag.device != x.device:
            failures.append(f"{name}_flagged: flag {flag.dtype} {tuple(flag.shape)} on {flag.device}")
        if int(flag.cpu()[0]) != 0 or not torch.equal(y, getattr(mod, name)(*args(x, gs))):
            failures.append(f"{name}_flagged: clean input gave flag {int(flag.cpu()[0])} or another output")
        _, flag = getattr(mod, name + "_flagged")(*args(bad, gs))
        if int(flag.cpu()[0]) & 1 != 1:
            failures.append(f"{name}_flagged: NaN input gave flag {int(flag.cpu()[0])}")
        if name.startswith(("fake_nvfp4", "nvfp4")):
            _, flag = getattr(mod, name + "_flagged")(*args(x, torch.tensor(-1.0, device=device)))
            if int(flag.cpu()[0]) != 2:
                failures.append(f"{name}_flagged: a negative global scale gave flag {int(flag.cpu()[0])}")
    return failures + _amax_flag_failures(mod, x, bad)


def _amax_flag_failures(mod, x: torch.Tensor, bad: torch.Tensor) -> list[str]:
    """The *_amax_flagged bindings' flag: bit 2 for an amax that is negative (a tiny one too, whose global scale
    would be 0), NaN or +-Inf; 0 for -0.0 and a dead amax; bit 1 for a NaN input."""
    failures = []
    g = torch.ones_like(x)
    calls = {
        "fake_nvfp4_amax_flagged": lambda t, a: (t, a, 16),
        "nvfp4_backward_amax_flagged": lambda t, a: (g, t, a, 32),
    }
    cases = [(x, v, 2) for v in (-1.0, -1e-30, math.nan, math.inf, -math.inf)]
    cases += [(x, v, 0) for v in (-0.0, 0.0, 1e-30)] + [(bad, 3.0, 1), (bad, -1.0, 3)]
    for name, args in calls.items():
        for t, v, want in cases:
            _, flag = getattr(mod, name)(*args(t, torch.tensor(v, device=x.device)))
            got = int(flag.cpu()[0])
            if flag.dtype != torch.int32 or got != want:
                failures.append(f"{name}: amax {v} on {'a NaN' if t is bad else 'a clean'} input gave flag {got}")
    return failures
