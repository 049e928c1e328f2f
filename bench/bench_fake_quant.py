"""Fake-quantization throughput: modelopt_lite's fused kernels next to copies, torch's ops and nvidia-modelopt.

    python bench/bench_fake_quant.py                      # CPU, (64,1024,1024) and (4096,4096) fp32
    python bench/bench_fake_quant.py --quick              # fewer rounds, (4096,4096) only
    python bench/bench_fake_quant.py --device cuda        # 256M-element tensors, cudaEvent timing
    python bench/bench_fake_quant.py --shapes 64x1024x1024 --dtype bf16 --rounds 15 --compile
    python bench/bench_fake_quant.py --formats mx --compile  # NVFP4 / MXFP8 rows only (issue 15 formats)

Prints one markdown table: median ms over interleaved rounds (every case once per round, so a noisy neighbour hits
all cases alike), GB/s counting the bytes read plus written, and the ratio to ``x.clone()`` in the same run. Outputs
are fresh tensors (as a quantizer's forward produces them), so on CPU every case pays the page faults of a new
buffer, as ``clone()`` does; ``y.copy_(x)`` into a preallocated buffer shows the memory-bandwidth floor. The
native kernels advise large outputs as transparent huge pages only with ``MODELOPT_LITE_HUGEPAGES=1`` (see
``empty_out`` in csrc/quant_cpu.cpp); ``--huge-pages on|off`` forces it for this run. The NVFP4/MX kernels' large
fresh outputs reuse the memory of released outputs (csrc/mx_output_pool.h); their rows "into torch.empty_like(x)"
time the kernel into a fresh torch allocation (the path before the pool). ``--faults`` notes the minor page faults
per call of every row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from mx_formulations import mx_cases, mx_summary  # bench/mx_formulations.py: the NVFP4 / MX rows
from run_all import (
    cpu_model,  # bench/run_all.py: one machine description for every report
)

import modelopt_lite.tensor_quant as tq
from modelopt_lite.functional import backend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def machine(device: str) -> str:
    desc = f"CPU {cpu_model()} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()}), torch {torch.__version__}"
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        desc += f", GPU {p.name} ({p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    kind = "cuda" if device == "cuda" else "cpu"
    native = backend._load(kind)
    if native is None:
        impl = f"UNAVAILABLE, timing the reference instead ({(backend.native_error(kind) or '')[:80]})"
    else:
        impl = native.kernel_impl() if hasattr(native, "kernel_impl") else kind
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    advice = "n/a"
    if native is not None and hasattr(native, "huge_page_advice"):
        advice = "on" if native.huge_page_advice() else "off (MODELOPT_LITE_HUGEPAGES=1 turns it on)"
    return (
        f"{desc}; modelopt_lite native kernels: {impl}; THP_MEM_ALLOC_ENABLE={thp}; "
        f"huge-page advice on fresh outputs: {advice}; {thp_policy()}"
    )


def thp_policy() -> str:
    """The kernel's transparent-huge-page settings (they decide what a fresh large output costs)."""
    parts = []
    for key in ("enabled", "defrag"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{key}").read_text()
            parts.append(f"THP {key}={text[text.index('[') + 1 : text.index(']')]}")
        except (OSError, ValueError):
            pass
    return ", ".join(parts) or "THP settings unknown"


def parse_shape(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.lower().split("x"))


def cases(x: torch.Tensor, include_compile: bool):
    """(name, fn, note) for one input tensor; a fn returning None marks an unavailable case."""
    dev = x.device
    c0 = x.shape[0]
    amax = torch.tensor(3.0, device=dev)
    amax_c0 = torch.rand([c0] + [1] * (x.dim() - 1), device=dev) * 2 + 1
    amax_last = torch.rand([1] * (x.dim() - 1) + [x.shape[-1]], device=dev) * 2 + 1
    blocks = {-1: 128}
    amax_blk = tq.blocks.block_amax(x, blocks)
    s, s_c0 = 3.0 / 127, (amax_c0 / 127).flatten()
    zp_c0 = torch.zeros(c0, dtype=torch.int32, device=dev)
    y = torch.empty_like(x)
    x_pos = x.abs()
    out = [
        ("x.clone()", lambda: x.clone(), "fresh output"),
        ("y.copy_(x), preallocated y", lambda: y.copy_(x), "bandwidth floor"),
        ("modelopt_lite per-tensor int8", lambda: tq.fake_tensor_quant(x, amax, 8), ""),
        (
            "modelopt_lite per-tensor uint8 (x >= 0)",
            lambda: tq.fake_tensor_quant(x_pos, amax, 8, True),
            "+ min check pass",
        ),
        ("modelopt_lite per-channel axis 0", lambda: tq.fake_tensor_quant(x, amax_c0, 8), f"{c0} channels"),
        ("modelopt_lite per-channel last axis", lambda: tq.fake_tensor_quant(x, amax_last, 8), f"{x.shape[-1]} ch."),
        ("modelopt_lite E4M3 per-tensor", lambda: tq.scaled_e4m3(x, amax), ""),
        ("modelopt_lite int4 block 128 (static)", lambda: tq.fake_block_quant(x, blocks, amax_blk, 4), ""),
        ("modelopt_lite int4 block 128 (dynamic)", lambda: tq.fake_block_quant(x, blocks, None, 4), "+ amax pass"),
        (
            "torch.fake_quantize_per_tensor_affine",
            lambda: torch.fake_quantize_per_tensor_affine(x, s, 0, -128, 127),
            "multiplies by 1/s",
        ),
        (
            "torch.fake_quantize_per_channel_affine",
            lambda: torch.fake_quantize_per_channel_affine(x, s_c0, zp_c0, 0, -128, 127),
            "axis 0",
        ),
        ("naive clamp(round(x/s))*s", lambda: torch.clamp(torch.round(x / s), -128, 127) * s, "4 passes"),
        (
            "naive E4M3 (x/s).to(fp8).float()*s",
            lambda: (x / s).to(torch.float8_e4m3fn).to(x.dtype) * s,
            "not saturating",
        ),
    ]
    if include_compile:
        naive = torch.compile(lambda t: torch.clamp(torch.round(t / s), -128, 127) * s)
        out.append(("torch.compile(naive chain)", lambda: naive(x), "inductor"))
    try:
        from modelopt.torch.quantization import tensor_quant as mtq  # nvidia-modelopt

        out.append(("nvidia-modelopt fake_tensor_quant", lambda: mtq.fake_tensor_quant(x, amax, None, 8), ""))
        out.append(("nvidia-modelopt scaled_e4m3", lambda: mtq.scaled_e4m3(x, amax, None, 4, 3), ""))
    except Exception as e:  # noqa: BLE001  (optional dependency: report why it is missing)
        out.append(("nvidia-modelopt (skipped)", lambda: None, f"not importable: {type(e).__name__}"))
    return out


def _minflt() -> int:
    """Minor page faults of this process so far (0 where ``resource`` is missing)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except ImportError:
        return 0


class Timer:
    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.faults = 0  #: minor page faults of the last call (CPU)

    def __call__(self, fn) -> float | None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            r = fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            f0, t0 = _minflt(), time.perf_counter()
            r = fn()
            ms = (time.perf_counter() - t0) * 1e3
            self.faults = _minflt() - f0
        if r is None:
            return None
        del r
        return ms


def run_shape(shape, dtype, device, rounds, include_compile, formats="all", show_faults=False):
    x = torch.randn(shape, dtype=dtype, device=device)
    if formats == "mx":
        y = torch.empty_like(x)
        table = [
            ("x.clone()", lambda: x.clone(), "fresh output"),
            ("y.copy_(x), preallocated y", lambda: y.copy_(x), "bandwidth floor"),
        ]
    else:
        table = cases(x, include_compile)
    if formats in ("all", "mx"):
        table += mx_cases(x, include_compile)
    timer = Timer(device)
    times: dict[str, list[float]] = {name: [] for name, _, _ in table}
    faults: dict[str, list[int]] = {name: [] for name, _, _ in table}
    errors: dict[str, str] = {}
    for name, fn, _ in table:  # warm-up (builds kernels, compiles)
        try:
            if timer(fn) is None:
                errors[name] = "n/a"
        except Exception as e:  # noqa: BLE001
            errors[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    for _ in range(rounds):
        for name, fn, _ in table:
            if name not in errors:
                times[name].append(timer(fn))
                faults[name].append(timer.faults)
    bytes_rw = 2 * x.numel() * x.element_size()
    clone = statistics.median(times["x.clone()"])
    rows = []
    copy = statistics.median(times["y.copy_(x), preallocated y"])
    for name, _, note in table:
        if name in errors:
            rows.append(f"| {name} | - | - | - | - | {errors[name] if errors[name] != 'n/a' else note} |")
            continue
        ms = statistics.median(times[name])
        if show_faults:
            note = f"{statistics.median(faults[name]):.0f} faults/call; {note}"
        rows.append(f"| {name} | {ms:.1f} | {bytes_rw / ms / 1e6:.1f} | {ms / clone:.2f} | {ms / copy:.2f} | {note} |")
    return rows, {name: statistics.median(v) for name, v in times.items() if v}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shapes", default=None, help="comma-separated, e.g. 64x1024x1024,4096x4096")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 9, --quick 3)")
    p.add_argument("--quick", action="store_true", help="3 rounds on the smallest default shape")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the naive chain (CPU)")
    p.add_argument(
        "--formats",
        choices=["all", "classic", "mx"],
        default="all",
        help="all rows, the integer/E4M3 rows only, or the NVFP4/MX rows only (with the copy baselines)",
    )
    p.add_argument("--faults", action="store_true", help="note the median minor page faults per call (CPU) in each row")
    p.add_argument(
        "--huge-pages",
        choices=["default", "on", "off"],
        default="default",
        help="huge-page advice of the native CPU kernels' outputs (default: MODELOPT_LITE_HUGEPAGES, else off)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    default = ["256x1024x1024", "16384x16384"] if args.device == "cuda" else ["64x1024x1024", "4096x4096"]
    shapes = [
        parse_shape(s) for s in (args.shapes.split(",") if args.shapes else default[-1:] if args.quick else default)
    ]
    rounds = args.rounds or (3 if args.quick else 9)
    native = backend._load("cuda" if args.device == "cuda" else "cpu")
    if native is not None and hasattr(native, "set_huge_page_advice"):
        native.set_huge_page_advice({"on": True, "off": False}.get(args.huge_pages))
    if native is not None:
        backend.set_backend("native")
    else:  # still runs: the modelopt_lite rows then time the pure-torch reference (named in the machine line)
        backend.set_backend("reference")
    print(f"Machine: {machine(args.device)}")
    print(f"Load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"Settings: {args.dtype}, median of {rounds} interleaved rounds, GB/s = (read + write bytes) / time\n")
    print("| shape / case | median ms | GB/s | x clone | x copy_ | note |")
    print("|---|---|---|---|---|---|")
    summaries = []
    for shape in shapes:
        print(f"| **{'x'.join(map(str, shape))} {args.dtype}** | | | | | |")
        compile_rows = args.compile or args.device == "cuda"
        rows, med = run_shape(shape, DTYPES[args.dtype], args.device, rounds, compile_rows, args.formats, args.faults)
        for row in rows:
            print(row)
        summaries.append(("x".join(map(str, shape)), med))
        sys.stdout.flush()
    print(f"\nLoad average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if native is not None and hasattr(native, "output_pool_stats"):
        held, nblocks, limit, hits, misses = native.output_pool_stats()
        print(f"NVFP4/MX output pool: limit {limit >> 20} MiB, {hits} hits, {misses} misses, {held >> 20} MiB kept")
    if args.formats != "classic":
        print()
        for shape, med in summaries:
            for line in mx_summary(med):
                print(f"{shape}: {line}")


if __name__ == "__main__":
    main()
