"""Where a public call's single-call time goes on a GPU: its host time against its kernel's.

    python bench/cuda_call_latency.py                  # 256M elements, fp32 and bf16
    python bench/cuda_call_latency.py --dry-run-cpu    # tiny CPU tensors (the rows and their code paths only)

For each public call next to the binding call that runs the same kernel (its flag returned unread), and
``y.copy_(x)`` / torch's ``fake_quantize_per_tensor_affine`` as yardsticks, three numbers (medians):

- ``event ms``: one call on an idle GPU between two CUDA events, as bench_cuda.py times it (host time before the
  first kernel counts; so does the GPU-side latency of every launch and copy the call issues);
- ``host us``: the wall time of that call on the host (it returns once its kernels are queued);
- ``warm host us``: the host time per call of a tight loop on a tiny tensor (the Python / dispatch / launch work
  with caches warm: what ``bench_call_overhead.py --cuda-path`` estimates on a CPU).

A public row's ``event ms`` minus its binding row's is what the call adds to the kernel on an idle GPU; ``host us``
says how much of that is host work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelopt_lite import tensor_quant as tq  # noqa: E402
from modelopt_lite.descriptor import QuantDescriptor  # noqa: E402
from modelopt_lite.functional import backend  # noqa: E402
from modelopt_lite.functional import library_mx as LMX  # noqa: E402
from modelopt_lite.nn import TensorQuantizer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cases(x: torch.Tensor, mod) -> list[tuple[str, object]]:
    """(row, callable) pairs on x (2-D, last dimension a multiple of 128); binding rows only with the CUDA
    extension (``mod``)."""
    amax = x.float().abs().amax()
    amax_blk = tq.blocks.block_amax(x, {-1: 128})  # a calibrated (static) block amax
    gs = LMX._global_scale(amax, x)
    y = torch.empty_like(x)
    mxfp8 = TensorQuantizer(
        QuantDescriptor(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)})
    )
    rows: list[tuple[str, object]] = [
        ("y.copy_(x), preallocated y", lambda: y.copy_(x)),
        ("torch.fake_quantize_per_tensor_affine", lambda: torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127)),
    ]
    if mod is not None:
        rows += [
            ("binding fake_mx_flagged e4m3", lambda: mod.fake_mx_flagged(x, "e4m3", 32, "floor")[0]),
            ("binding fake_nvfp4_flagged (global scale given)", lambda: mod.fake_nvfp4_flagged(x, gs, 16)[0]),
            ("binding fake_nvfp4_amax_flagged", lambda: mod.fake_nvfp4_amax_flagged(x, amax, 16)[0]),
            ("binding fake_block_dynamic int4/128", lambda: mod.fake_block_dynamic(x, 128, 7.0, -8, 7, False)[0]),
            (
                "binding fake_block_static int4/128",
                lambda: mod.fake_block_static(x, amax_blk, 128, 7.0, -8, 7, False)[0],
            ),
        ]
    rows += [
        ("public mx_fake_quant e4m3", lambda: LMX.mx_fake_quant(x, "e4m3")),
        ("public nvfp4_fake_quant", lambda: LMX.nvfp4_fake_quant(x, amax, 16)),
        ("public fake_block_quant int4/128 dynamic", lambda: tq.fake_block_quant(x, {-1: 128}, None, 4)),
        ("public fake_block_quant int4/128 static", lambda: tq.fake_block_quant(x, {-1: 128}, amax_blk, 4)),
        ("public fake_tensor_quant int8", lambda: tq.fake_tensor_quant(x, amax, 8)),
        ("TensorQuantizer MXFP8", lambda: mxfp8(x)),
    ]
    return rows


def primitives(x: torch.Tensor) -> list[tuple[str, object]]:
    """The host-side pieces a public call is made of on the device of x (tiny x): their warm host time."""
    from modelopt_lite.functional import deferred_errors
    from modelopt_lite.functional.backend import kernels_for

    dev = x.device
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    host = torch.zeros(1, dtype=torch.int32, pin_memory=x.is_cuda)
    rows: list[tuple[str, object]] = [
        ("x.device.type", lambda: x.device.type),
        ("torch.empty(1)", lambda: torch.empty(1, device=dev)),
        ("torch.zeros(1, int32)", lambda: torch.zeros(1, dtype=torch.int32, device=dev)),
        ("torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("pinned host slot .copy_(flag, non_blocking=True)", lambda: host.copy_(flag, non_blocking=True)),
        ("deferred_errors.deferring(x)", lambda: deferred_errors.deferring(x)),
        ("kernels_for(device type)", lambda: kernels_for(dev.type)),
    ]
    if x.is_cuda:
        event = torch.cuda.Event()
        rows += [
            ("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(dev)),
            ("deferred_errors._current_stream(device)", lambda: deferred_errors._current_stream(dev)),
            ("torch.cuda.Event().record(current_stream)", lambda: event.record(torch.cuda.current_stream(dev))),
            ("event.query()", event.query),
        ]
    return rows


def single_call(fn, cuda: bool, repeats: int) -> tuple[float, float]:
    """Median (event ms, host us) of one call on an idle device."""
    events, hosts = [], []
    for i in range(repeats + 2):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        r = fn()
        host = time.perf_counter() - t0
        if cuda:
            end.record()
            end.synchronize()
        del r
        if i >= 2:  # two warm-up calls
            hosts.append(host * 1e6)
            events.append(start.elapsed_time(end) if cuda else host * 1e3)
    return statistics.median(events), statistics.median(hosts)


def warm_host_us(fn, cuda: bool, calls: int) -> float:
    """Best of 5 loops: host microseconds per call, back to back on a tiny tensor."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=256 * 2**20, help="elements of the large tensor")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dry-run-cpu", action="store_true", help="tiny CPU tensors: the rows only, no timing claims")
    args = p.parse_args(argv)
    cuda = not args.dry_run_cpu
    if cuda and not torch.cuda.is_available():
        p.error("CUDA is not available (--dry-run-cpu runs the rows on the CPU)")
    dev = "cuda" if cuda else "cpu"
    numel, calls = (args.numel, 500) if cuda else (8192, 20)
    mod = backend._load("cuda") if cuda else None
    name = torch.cuda.get_device_name(0) if cuda else "CPU dry run"
    print(
        f"### One call's time, {name}; {numel / 2**20:g} M elements, median of {args.repeats}; torch {torch.__version__}"
    )
    print("\n| dtype | call | event ms | host us | warm host us (4x256) |\n|---|---|--:|--:|--:|")
    gen = torch.Generator(device=dev).manual_seed(0)
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        big = torch.randn(numel // 4096, 4096, device=dev, generator=gen).to(dtype)
        tiny = torch.randn(4, 256, device=dev, generator=gen).to(dtype)
        for (label, fn), (_, tiny_fn) in zip(cases(big, mod), cases(tiny, mod)):
            if dtype != torch.float32 and label.startswith("torch.fake_quantize"):
                continue  # float32 only
            ev, host = single_call(fn, cuda, args.repeats)
            warm = warm_host_us(tiny_fn, cuda, calls)
            print(f"| {dname} | {label} | {ev:.3f} | {host:.1f} | {warm:.1f} |", flush=True)
        del big
    print("\n| host primitive | warm host us |\n|---|--:|")
    for label, fn in primitives(torch.randn(4, 256, device=dev)):
        print(f"| {label} | {warm_host_us(fn, cuda, calls):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
