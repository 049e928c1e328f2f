"""GPU fake-quantization throughput: modelopt_lite's CUDA kernels against a device-to-device copy and peers.

    python bench/bench_cuda.py                    # 2**28 elements (256M) per tensor, fp32 and bf16
    python bench/bench_cuda.py --quick            # 2**24 elements, no torch.compile / nvidia-modelopt
    python bench/bench_cuda.py --dry-run-cpu      # exercise this script on the CPU (reference kernels, tiny sizes)
    python bench/bench_cuda.py --cases mx,hist    # some case groups only (int, mx, hist)

For each case (per-tensor int8, per-channel axis 0 and last axis, E4M3, 4-bit blocks of 128, the int8 backward,
the calibration histogram; with ``mx`` NVFP4, MXFP8/MXFP4/MXINT8/MX-E5M2, per-tensor E5M2/E2M1 and the fused dynamic
int4 blocks, each next to ``torch.compile`` of its exact pure-torch chain: cuda_mx_rows.py) it times, with CUDA events (median of --repeats after warm-up):
ours (the extension functions called directly, and where it differs the public API), ``y.copy_(x)`` into a
preallocated buffer (the bandwidth ceiling), torch's ``fake_quantize_per_*_affine``, the naive eager chain,
``torch.compile`` of that chain, and nvidia-modelopt's CUDA path when it imports. GB/s counts the bytes each call
must move (inputs read once + outputs written once); "% copy" divides by the copy's GB/s. Target: >= 90 %.
Prints a markdown table headed by the device name. Exits 0 with a note when CUDA is unavailable.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cuda_mx_rows import mx_cases, reference_module  # noqa: E402  (bench/ is on sys.path as the script's folder)

from modelopt_lite.functional import reference
from modelopt_lite.functional.scales import scale_from_amax

SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class Timer:
    """Median wall time of a callable: CUDA events on the GPU, perf_counter on the CPU (dry runs). With ``burst`` > 1
    each run times that many calls back to back (the mean per call): the throughput of a stream of calls, whose host
    time overlaps the kernels queued before it, where one call on an idle GPU also pays its host time before its
    first kernel."""

    def __init__(self, device: str, repeats: int, warmup: int = 3, burst: int = 1):
        self.device, self.repeats, self.warmup, self.burst = device, repeats, warmup, burst

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.burst):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / self.burst)
            else:
                t0 = time.perf_counter()
                for _ in range(self.burst):
                    fn()
                times.append((time.perf_counter() - t0) / self.burst)
        return statistics.median(times)


def _try(fn):
    try:
        fn()
        return fn
    except Exception as e:  # noqa: BLE001  (a peer that cannot run this case is reported as n/a)
        return f"n/a ({type(e).__name__}: {str(e).splitlines()[0][:60]})" if str(e) else f"n/a ({type(e).__name__})"


def _modelopt():
    try:
        from modelopt.torch.quantization import tensor_quant as mtq_tq
    except Exception:  # noqa: BLE001
        return None
    return mtq_tq


def naive_int(x, s, qmin, qmax):
    return (torch.clamp(torch.round(x.float() / s), qmin, qmax) * s).to(x.dtype)


def naive_e4m3(x, s):
    return ((x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def build_cases(mod, x, args, device):
    """(case name, bytes moved, [(impl name, callable or 'n/a ...')])."""
    n = x.numel()
    es = x.element_size()
    rows = 1 << (max(n.bit_length() - 1, 0) // 2)
    x2 = x.view(rows, n // rows)
    amax = x.float().abs().amax()
    s = scale_from_amax(amax, 127)
    s_row = scale_from_amax(x2.float().abs().amax(dim=1, keepdim=True), 127)
    s_col = scale_from_amax(x2.float().abs().amax(dim=0, keepdim=True), 127)
    s_e4 = scale_from_amax(amax, 448.0)
    xb = x2.view(rows, -1, 128)
    s_blk = scale_from_amax(xb.float().abs().amax(dim=2, keepdim=True), 7)
    zp_row = torch.zeros(rows, dtype=torch.int32, device=device)
    zp_col = torch.zeros(x2.shape[1], dtype=torch.int32, device=device)
    sf = float(s)
    mtq = _modelopt() if args.peers else None
    compiled_int = compiled_e4 = None
    if args.compile:
        compiled_int = torch.compile(naive_int, dynamic=False)
        compiled_e4 = torch.compile(naive_e4m3, dynamic=False)
    rw = 2 * n * es

    def peers_int(xx, ss, axis, zp):
        out = []
        if axis is None:
            out.append(
                (
                    "torch.fake_quantize_per_tensor_affine",
                    _try(lambda: torch.fake_quantize_per_tensor_affine(xx, sf, 0, -128, 127)),
                )
            )
        else:
            out.append(
                (
                    "torch.fake_quantize_per_channel_affine",
                    _try(lambda: torch.fake_quantize_per_channel_affine(xx, ss.flatten(), zp, axis, -128, 127)),
                )
            )
        out.append(("naive eager chain", _try(lambda: naive_int(xx, ss, -128, 127))))
        if compiled_int is not None:
            out.append(("torch.compile(naive chain)", _try(lambda: compiled_int(xx, ss, -128, 127))))
        if mtq is not None:
            a = ss * 127
            out.append(
                (
                    "nvidia-modelopt fake_tensor_quant",
                    _try(lambda: mtq.fake_tensor_quant(xx, a, num_bits=8, unsigned=False, narrow_range=False)),
                )
            )
        return out

    cases = [
        (
            "int8 per-tensor",
            rw,
            [("modelopt_lite", lambda: mod.fake_quant_int(x, s, -128, 127))] + peers_int(x, s, None, None),
        ),
        (
            "int8 per-channel axis 0",
            rw,
            [("modelopt_lite", lambda: mod.fake_quant_int(x2, s_row, -128, 127))] + peers_int(x2, s_row, 0, zp_row),
        ),
        (
            "int8 per-channel last axis",
            rw,
            [("modelopt_lite", lambda: mod.fake_quant_int(x2, s_col, -128, 127))] + peers_int(x2, s_col, 1, zp_col),
        ),
    ]
    e4 = [("modelopt_lite", lambda: mod.fake_e4m3(x, s_e4)), ("naive eager chain", _try(lambda: naive_e4m3(x, s_e4)))]
    if compiled_e4 is not None:
        e4.append(("torch.compile(naive chain)", _try(lambda: compiled_e4(x, s_e4))))
    if mtq is not None:
        e4.append(("nvidia-modelopt scaled_e4m3", _try(lambda: mtq.scaled_e4m3(x, amax, None, 4, 3))))
    cases.append(("E4M3 per-tensor", rw, e4))
    blk = [
        ("modelopt_lite (static block scales)", lambda: mod.fake_quant_int(xb, s_blk, -8, 7)),
        ("naive eager chain", _try(lambda: naive_int(xb, s_blk, -8, 7))),
    ]
    if args.public:
        tq = importlib.import_module("modelopt_lite.tensor_quant")

        blk.append(
            (
                "modelopt_lite public fake_block_quant (dynamic amax)",
                _try(lambda: tq.fake_block_quant(x2, {-1: 128}, None, 4)),
            )
        )
    if compiled_int is not None:
        blk.append(("torch.compile(naive chain)", _try(lambda: compiled_int(xb, s_blk, -8, 7))))
    cases.append(("int4 blocks of 128", rw, blk))
    g = torch.ones_like(x)
    cases.append(
        (
            "int8 backward (grad_x only)",
            3 * n * es,
            [("modelopt_lite", lambda: mod.int_backward(g, x, s, -128, 127, False))],
        )
    )
    cases.append(
        (
            "int8 backward + scale term",
            3 * n * es + 4 * n,
            [("modelopt_lite", lambda: mod.int_backward(g, x, s, -128, 127, True))],
        )
    )
    return cases


def hist_cases(mod, x, amax):
    n, es = x.numel(), x.element_size()
    cases = []
    if hasattr(mod, "histogram_rows"):
        xa = x.abs()
        top = float(amax)  # read once, outside the timed calls
        cases.append(
            (
                "histogram 2048 bins of |x| (int64)",
                n * es,
                [
                    ("modelopt_lite", lambda: mod.histogram(xa, 2048, top)),
                    ("torch.histc (float counts)", _try(lambda: torch.histc(xa.float(), 2048, 0, top))),
                ],
            )
        )
    return cases


def copy_time(timer: Timer, x: torch.Tensor) -> float:
    """Time of a device-to-device copy of x into a preallocated buffer (the bandwidth ceiling)."""
    y = torch.empty_like(x)
    return timer(lambda: y.copy_(x))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2**24 elements, 5 repeats, no compile / peers")
    p.add_argument("--numel", type=int, default=None, help="elements per tensor (default 2**28)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, fp16, bf16")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile baselines")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="skip nvidia-modelopt")
    p.add_argument("--no-public", dest="public", action="store_false", help="skip the public-API rows")
    p.add_argument("--dry-run-cpu", action="store_true", help="run on the CPU with the reference kernels")
    p.add_argument("--cases", default="int,mx,hist", help="comma list of case groups: int, mx, hist")
    p.add_argument(
        "--burst", type=int, default=1, help="calls back to back per timed run (mean per call; default 1: one call)"
    )
    args = p.parse_args(argv)
    dry = args.dry_run_cpu
    if not dry and not torch.cuda.is_available():
        print("CUDA is not available: bench_cuda skipped (run it on a GPU machine).")
        return 0
    if args.quick or dry:
        args.compile = args.compile and not args.quick and not dry
        args.peers = args.peers and not args.quick and not dry
    numel = args.numel or (2**12 * 16 if dry else 2**24 if args.quick else 2**28)
    repeats = args.repeats or (2 if dry else 5 if args.quick else 20)
    device = "cpu" if dry else "cuda"
    if dry:
        mod, name = reference, "CPU dry run (reference kernels)"
    else:
        from modelopt_lite.functional import native_build

        mod, name = native_build.load("cuda"), torch.cuda.get_device_name()
    if args.burst < 1:
        p.error("--burst must be >= 1")
    timer = Timer(device, repeats, burst=args.burst)
    dtypes = [{"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[d] for d in args.dtypes.split(",")]
    print(f"### CUDA fake quantization, {name}\n")
    per_run = f", {args.burst} calls back to back per run (mean per call)" if args.burst > 1 else ""
    print(
        f"{numel} elements per tensor ({numel / 2**20:.0f} M), median of {repeats} runs{per_run}; "
        f"torch {torch.__version__}\n"
    )
    print("| case | dtype | implementation | ms | GB/s | % of copy | note |")
    print("|---|---|---|---|---|---|---|")
    for dt in dtypes:
        # the chains are compiled once per (function, dtype, element type): a fresh dynamo cache per dtype keeps a
        # third dtype under the recompile limit (8 per function: past it, torch.compile runs the chain eagerly,
        # which is what the fp16 rows of 2026-11-27 measured)
        torch._dynamo.reset()
        x = torch.randn(numel, device=device).to(dt)
        t_copy = copy_time(timer, x)
        copy_gbs = 2 * x.numel() * x.element_size() / t_copy / 1e9
        print(f"| device-to-device copy | {SHORT[dt]} | `y.copy_(x)` | {t_copy * 1e3:.3f} | {copy_gbs:.0f} | 100 | |")
        groups = args.cases.split(",")
        todo = []
        if "int" in groups:
            todo += build_cases(mod, x, args, device)
        if "mx" in groups:
            todo += mx_cases(reference_module() if dry else mod, x, args.compile)
        if "hist" in groups:
            todo += hist_cases(mod, x, x.float().abs().amax())
        for case, nbytes, impls in todo:
            for impl, fn, *note in impls:
                tail = f" {note[0]} |" if note else " |"
                if isinstance(fn, str):
                    print(f"| {case} | {SHORT[dt]} | {impl} | {fn} | | |{tail}")
                    continue
                t = timer(fn)
                gbs = nbytes / t / 1e9
                row = f"| {case} | {SHORT[dt]} | {impl} | {t * 1e3:.3f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f} |"
                print(row + tail, flush=True)
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
