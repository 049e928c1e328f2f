"""Where one call's GPU time goes: torch.profiler over a few calls, printed as a short markdown table.

Shared by the ``--profile`` options of bench_fake_quant.py (the public functions on CUDA) and bench_qat_cuda.py (a
QAT step): per call, the wall time between two CUDA events, the sum of the kernels' device time (the rest is the GPU
idle: launch and Python time not hidden behind earlier work, host synchronizations), and the kernels and host-side
ops by device time with their counts per call.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile


def _device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, name, None)
        if v is not None:
            return float(v)
    return 0.0


def profile_call(label: str, fn, calls: int = 3, top: int = 8) -> str:
    """Markdown lines: ``fn`` run ``calls`` times under the profiler (after one warm-up call), per call. Without
    CUDA (the scripts' CPU dry runs) the wall time is the host's and no kernel is listed."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(calls):
            fn()
        if cuda:
            end.record()
        sync()
        host_ms = (time.perf_counter() - t0) * 1e3
    wall_ms = (start.elapsed_time(end) if cuda else host_ms) / calls
    events = prof.key_averages()
    kernels = [e for e in events if _device_us(e) > 0 and e.device_type != torch.autograd.DeviceType.CPU]
    busy_ms = sum(_device_us(e) for e in kernels) / 1e3 / calls
    lines = [
        f"#### {label}: {wall_ms:.3f} ms per call ({'events' if cuda else 'host clock'}; profiler on), kernels "
        f"{busy_ms:.3f} ms, "
        f"GPU idle {max(wall_ms - busy_ms, 0.0):.3f} ms",
        "",
        "| kernel or memcpy | per call | device ms per call |",
        "|---|--:|--:|",
    ]
    for e in sorted(kernels, key=_device_us, reverse=True)[:top]:
        lines.append(f"| {e.key[:90]} | {e.count / calls:g} | {_device_us(e) / 1e3 / calls:.3f} |")
    host = [
        e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith(("aten::", "modelopt"))
    ]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    lines += ["", "| host op | per call | self CPU ms per call |", "|---|--:|--:|"]
    for e in host[:top]:
        lines.append(f"| {e.key[:90]} | {e.count / calls:g} | {e.self_cpu_time_total / 1e3 / calls:.3f} |")
    return "\n".join(lines) + "\n"
