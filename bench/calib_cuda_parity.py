"""CUDA parity of the calibrators: the same data on CPU and on CUDA must give identical histograms and amax.

Run on a machine with a GPU: ``python bench/calib_cuda_parity.py``. Prints a line per check and the collect /
compute_amax times on the GPU; exits 1 on any mismatch, 0 with a note when CUDA is not available.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modelopt_lite.calib import HistogramCalibrator, MaxCalibrator

METHODS = [("percentile", {"percentile": 99.99}), ("mse", {}), ("entropy", {})]


def run(make, batches, device, calls):
    cal = make()
    for b in batches:
        cal.collect(b.to(device))
    return cal, [cal.compute_amax(m, **kw) for m, kw in calls]


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA not available: nothing to check")
        return 0
    g = torch.Generator().manual_seed(0)
    acts = [torch.randn(256, 1024, generator=g) * s for s in (0.01, 1.0, 3.0)]
    acts.append(torch.rand(64, 1024, generator=g) * 40)
    weights = [torch.randn(64, 32, 3, 3, generator=g)]
    cases = {
        "max": (lambda: MaxCalibrator(8), acts, [("max", {})]),
        "max axis": (lambda: MaxCalibrator(8, axis=0), weights, [("max", {})]),
        "hist int8": (lambda: HistogramCalibrator(8), acts, METHODS),
        "hist uint4": (
            lambda: HistogramCalibrator(4, unsigned=True, skip_zeros=True),
            [a.abs() for a in acts],
            METHODS,
        ),
        "hist e4m3": (lambda: HistogramCalibrator((4, 3)), acts, METHODS[:2]),
        "hist axis": (lambda: HistogramCalibrator(8, axis=0, num_bins=512), weights, METHODS),
    }
    bad = 0
    for name, (make, batches, calls) in cases.items():
        cpu_cal, cpu = run(make, batches, "cpu", calls)
        gpu_cal, gpu = run(make, batches, "cuda", calls)
        same = all(a.device.type == "cuda" and torch.equal(a.cpu(), b) for a, b in zip(gpu, cpu))
        if hasattr(cpu_cal, "counts"):
            same = same and torch.equal(gpu_cal.counts.cpu(), cpu_cal.counts)
        bad += not same
        print(f"{'OK ' if same else 'BAD'} {name}: " + ", ".join(f"{float(a.float().max()):.6g}" for a in cpu))
    xs = [torch.randn(256, 1024, device="cuda") for _ in range(50)]
    cal = HistogramCalibrator(8)
    cal.collect(xs[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x in xs:
        cal.collect(x)
    torch.cuda.synchronize()
    print(f"GPU collect: {(time.perf_counter() - t0) / len(xs) * 1e3:.3f} ms/batch (256x1024)")
    for m, kw in METHODS:
        cal.compute_amax(m, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a = cal.compute_amax(m, **kw)
        torch.cuda.synchronize()
        print(f"GPU compute_amax {m}: {(time.perf_counter() - t0) * 1e3:.2f} ms -> {float(a):.6g}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
