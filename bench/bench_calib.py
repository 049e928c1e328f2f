"""Histogram calibration benchmark: collect and compute_amax times, amax vs loop references and ground truth.

Data: ``--batches`` batches of (256, 1024) N(0, 1) (seed 0). Reported:

- collect time per batch: our ``HistogramCalibrator`` (int64 counts, power-of-two grid), an inline copy of the
  ``torch.histc`` path of pytorch-quantization / ModelOpt (float32 counts, first-batch bin width, grown by
  appending bins), our ``MaxCalibrator``, and nvidia-modelopt's ``HistogramCalibrator`` when importable;
- compute_amax time and value per method (percentile 99.99, mse, entropy) for ours, for the slow loop references
  of ``tests/calib_loops.py`` on our histogram (must be equal), for the same loops on the histc-style histogram
  (a different bin width: the difference is reported in bin widths), and for nvidia-modelopt when importable;
- the true 99.99th percentile of ``|x|`` (inverted CDF and linear interpolation).

Times are the minimum over ``--repeats`` runs (this machine is shared and noisy); run with
``python bench/bench_calib.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from calib_loops import entropy_loop, mse_loop, percentile_loop

from modelopt_lite.calib import HistogramCalibrator, MaxCalibrator

METHODS = [("percentile", {"percentile": 99.99}), ("mse", {}), ("entropy", {})]


class HistcStyle:
    """The pytorch-quantization / ModelOpt torch path: float32 histc counts, width fixed by the first batch."""

    def __init__(self, num_bins=2048):
        self.num_bins, self.hist, self.edges = num_bins, None, None

    def collect(self, x):
        x = x.detach().abs().float()
        x_max = x.max()
        if self.edges is None:
            self.hist = torch.histc(x, bins=self.num_bins, min=0, max=float(x_max))
            self.edges = torch.linspace(0, float(x_max), self.num_bins + 1)
            return
        if x_max > self.edges[-1]:
            width = float(self.edges[1] - self.edges[0])
            n = math.ceil(float(x_max) / width)
            self.edges = torch.arange(0, width * (n + 1) - width / 2, width)[: n + 1]
        hist = torch.histc(x, bins=len(self.edges) - 1, min=0, max=float(self.edges[-1]))
        hist[: self.hist.numel()] += self.hist
        self.hist = hist


CPU_TIME: dict = {}


def best_of(fn, repeats, key=None):
    """Minimum wall time over ``repeats`` runs (and the minimum process CPU time, kept under ``key``)."""
    best, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        best, cpu = min(best, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    if key is not None:
        CPU_TIME[key] = min(cpu, CPU_TIME.get(key, float("inf")))
    return best, out


def load_modelopt():
    try:
        from modelopt.torch.quantization.calib import HistogramCalibrator as MoHist
    except Exception as e:  # noqa: BLE001 - any import problem means "not available"
        return None, f"{type(e).__name__}: {e}"
    return MoHist, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-loops", action="store_true", help="skip the slow loop references")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    xs = [torch.randn(256, 1024) for _ in range(args.batches)]
    nb = len(xs)
    mo_cls, mo_err = load_modelopt()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {nb} batches of (256, 1024) N(0,1); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )

    def run(make):
        def go():
            cal = make()
            for x in xs:
                cal.collect(x)
            return cal

        return go

    makers = {
        "ours HistogramCalibrator (int64, pow2 grid)": lambda: HistogramCalibrator(8),
        "torch.histc path (float32 counts, inline copy)": HistcStyle,
        "ours MaxCalibrator": lambda: MaxCalibrator(8),
    }
    if mo_cls is not None:
        makers["nvidia-modelopt HistogramCalibrator"] = lambda: mo_cls(8, None, False)
    best = dict.fromkeys(makers, float("inf"))
    cals = {}
    for _ in range(args.repeats):  # interleaved rounds, so background load hits every entry alike
        for name, make in makers.items():
            t, cals[name] = best_of(run(make), 1, key=name)
            best[name] = min(best[name], t)
    print("\n| collect | total s | ms / batch | CPU ms / batch |\n|---|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t:.3f} | {t / nb * 1e3:.2f} | {CPU_TIME[name] / nb * 1e3:.2f} |")
    if mo_cls is None:
        print(f"(nvidia-modelopt not importable: {mo_err})")

    ours = cals["ours HistogramCalibrator (int64, pow2 grid)"]
    counts, width = ours.counts, ours.bin_width
    hs = cals["torch.histc path (float32 counts, inline copy)"]
    ref_counts = torch.round(hs.hist).to(torch.int64)
    ref_width = float(hs.edges[1] - hs.edges[0])
    occupied = int(torch.nonzero(counts).max()) + 1
    print(
        f"\nbin width: ours 2**{int(math.log2(width))} = {width:.6g} ({occupied} occupied bins); "
        f"histc path {ref_width:.6g} ({hs.hist.numel()} bins); ratio {width / ref_width:.3f}"
    )

    a = torch.cat([x.flatten() for x in xs]).abs().double()
    n = a.numel()
    k = math.ceil(0.9999 * n)
    q_inv = float(torch.kthvalue(a, k).values)
    pos = 0.9999 * (n - 1)
    lo, hi = (float(torch.kthvalue(a, math.floor(pos) + j).values) for j in (1, 2))
    frac = pos - math.floor(pos)
    q_lin = lo + frac * (hi - lo)
    print(
        f"ground truth 99.99th percentile of |x|: {q_inv:.6f} (inverted CDF), {q_lin:.6f} (linear); "
        f"max |x| {float(a.max()):.6f}"
    )

    print(
        "\n| method | ours amax | ours ms | ours CPU ms | loop ref on our hist | equal | loop s | loop on histc hist "
        "| diff (our bins) | modelopt amax | modelopt ms |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for method, kw in METHODS:
        t_ours, amax = best_of(lambda m=method, k=kw: ours.compute_amax(m, **k), max(args.repeats, 5), key=method)
        amax = float(amax)
        loop = {
            "percentile": lambda c, w: percentile_loop(c, w, 99.99),
            "mse": lambda c, w: mse_loop(c, w, 128, 1, 8, False),
            "entropy": lambda c, w: entropy_loop(c, w, 128, 1, 8, False),
        }[method]
        if args.no_loops:
            ref = ref_h = float("nan")
            t_loop = float("nan")
        else:
            t_loop, ref = best_of(lambda lp=loop: lp(counts, width), 1)
            ref_h = loop(ref_counts, ref_width)
        mo_amax, mo_ms = "n/a", "n/a"
        if mo_cls is not None:
            mo = cals["nvidia-modelopt HistogramCalibrator"]
            t_mo, v = best_of(lambda m=method, k=kw, c=mo: c.compute_amax(m, **k), 1)
            mo_amax, mo_ms = f"{float(v):.4f}", f"{t_mo * 1e3:.1f}"
        print(
            f"| {method} | {amax:.4f} | {t_ours * 1e3:.2f} | {CPU_TIME[method] * 1e3:.2f} | {ref:.4f} | "
            f"{amax == ref} | {t_loop:.2f} | "
            f"{ref_h:.4f} | {abs(amax - ref_h) / width:.2f} | {mo_amax} | {mo_ms} |"
        )


if __name__ == "__main__":
    main()
