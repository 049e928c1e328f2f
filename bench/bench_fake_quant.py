"""Fake-quantization throughput: modelopt_lite's fused kernels next to copies, torch's ops and nvidia-modelopt.

    python bench/bench_fake_quant.py                      # CPU, (64,1024,1024) and (4096,4096) fp32
    python bench/bench_fake_quant.py --quick              # fewer rounds, (4096,4096) only
    python bench/bench_fake_quant.py --device cuda        # 256M-element tensors, cudaEvent timing
    python bench/bench_fake_quant.py --shapes 64x1024x1024 --dtype bf16 --rounds 15 --compile
    python bench/bench_fake_quant.py --formats mx --compile  # NVFP4 / MXFP8 rows only (issue 15 formats)

Prints one markdown table: median ms over interleaved rounds (every case once per round, so a noisy neighbour hits
all cases alike; each round in its own seeded random order, so no row always follows the same one), GB/s counting
the bytes read plus written, the ratio to ``y.copy_(x)`` into a preallocated buffer (the memory-bandwidth floor)
and to ``x.clone()``, and for every modelopt_lite row how many times faster it is than torch's op and
nvidia-modelopt's op for the same job, all in the same run (``n/a`` where nvidia-modelopt is not importable: run it
with the peer's interpreter, e.g. ``/tmp/venv-peer/bin/python``). A summary line per shape checks
the CPU targets of issue 24 (integer/E4M3/int4 rows <= 1.3x the copy floor, >= 5x torch's and nvidia-modelopt's ops).
Outputs are fresh tensors as a quantizer's forward produces them: every native CPU kernel takes its large outputs
from one pool of released output memory (csrc/output_pool.h), so a call pays no page faults for an output the
caller has released (``clone()`` and torch's ops pay them every call). The NVFP4/MX rows "into torch.empty_like(x)"
time the kernel into a fresh torch allocation (the path without the pool). New pooled blocks are advised as
transparent huge pages only with ``MODELOPT_LITE_HUGEPAGES=1``; ``--huge-pages on|off`` forces it for this run.
``--faults`` notes the minor page faults per call of every row. ``--also-impl avx2`` (CPU) adds, for every
modelopt_lite integer/E4M3/int4 row, the same row with that kernel set forced (``avx512``, ``avx2`` or ``scalar``),
timed in the same interleaved rounds: whether the AVX-512 kernels help on this CPU, in one run.
"""

from __future__ import annotations

import argparse
import os
import random
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
    desc = (
        f"CPU {cpu_model()} ({os.cpu_count()} cores, {cpu_features()}, torch threads {torch.get_num_threads()}), "
        f"torch {torch.__version__}, nvidia-modelopt {_modelopt_version()}"
    )
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


def cpu_features() -> str:
    """The vector extensions the CPU reports (Linux /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = set(text[text.index("flags") :].splitlines()[0].split())
    except (OSError, ValueError):
        return "features unknown"
    names = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f in flags]
    return "+".join(names) if names else "no AVX2"


def _modelopt_version() -> str:
    try:
        import modelopt

        return getattr(modelopt, "__version__", "installed")
    except Exception:  # noqa: BLE001  (optional dependency)
        return "not importable (n/a)"


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


TORCH_PT, TORCH_C0, TORCH_LAST = (
    "torch.fake_quantize_per_tensor_affine",
    "torch.fake_quantize_per_channel_affine",
    "torch.fake_quantize_per_channel_affine, last axis",
)
TORCH_E4M3 = "naive E4M3 (x/s).to(fp8).float()*s"
MO_PT, MO_C0, MO_LAST, MO_E4M3 = (
    "nvidia-modelopt fake_tensor_quant",
    "nvidia-modelopt fake_tensor_quant, per-channel axis 0",
    "nvidia-modelopt fake_tensor_quant, per-channel last axis",
    "nvidia-modelopt scaled_e4m3",
)
#: the torch and nvidia-modelopt rows doing the same job as each modelopt_lite row (per-tensor ones for the block
#: rows: neither has a block fake-quant op; torch has no E4M3 fake-quant op, its naive chain stands in)
PEERS = {
    "modelopt_lite per-tensor int8": (TORCH_PT, MO_PT),
    "modelopt_lite per-tensor uint8 (x >= 0)": (TORCH_PT, MO_PT),
    "modelopt_lite per-channel axis 0": (TORCH_C0, MO_C0),
    "modelopt_lite per-channel last axis": (TORCH_LAST, MO_LAST),
    "modelopt_lite E4M3 per-tensor": (TORCH_E4M3, MO_E4M3),
    "modelopt_lite int4 block 128 (static)": (TORCH_PT, MO_PT),
    "modelopt_lite int4 block 128 (dynamic)": (TORCH_PT, MO_PT),
}


def cases(x: torch.Tensor, include_compile: bool):
    """(name, fn, note) for one input tensor; a fn returning None marks an unavailable case."""
    dev = x.device
    c0 = x.shape[0]
    amax = torch.tensor(3.0, device=dev)
    amax_c0 = torch.rand([c0] + [1] * (x.dim() - 1), device=dev) * 2 + 1
    amax_last = torch.rand([1] * (x.dim() - 1) + [x.shape[-1]], device=dev) * 2 + 1
    blocks = {-1: 128}
    amax_blk = tq.blocks.block_amax(x, blocks)
    s, s_c0, s_last = 3.0 / 127, (amax_c0 / 127).flatten(), (amax_last / 127).flatten()
    zp_c0 = torch.zeros(c0, dtype=torch.int32, device=dev)
    zp_last = torch.zeros(x.shape[-1], dtype=torch.int32, device=dev)
    y = torch.empty_like(x)
    x_pos = x.abs()
    out = [
        ("x.clone()", lambda: x.clone(), "fresh output"),
        ("y.copy_(x), preallocated y", lambda: y.copy_(x), "bandwidth floor"),
        ("modelopt_lite per-tensor int8", lambda: tq.fake_tensor_quant(x, amax, 8), ""),
        (
            "modelopt_lite per-tensor uint8 (x >= 0)",
            lambda: tq.fake_tensor_quant(x_pos, amax, 8, True),
            "min check in the same pass",
        ),
        ("modelopt_lite per-channel axis 0", lambda: tq.fake_tensor_quant(x, amax_c0, 8), f"{c0} channels"),
        ("modelopt_lite per-channel last axis", lambda: tq.fake_tensor_quant(x, amax_last, 8), f"{x.shape[-1]} ch."),
        ("modelopt_lite E4M3 per-tensor", lambda: tq.scaled_e4m3(x, amax), ""),
        ("modelopt_lite int4 block 128 (static)", lambda: tq.fake_block_quant(x, blocks, amax_blk, 4), ""),
        (
            "modelopt_lite int4 block 128 (dynamic)",
            lambda: tq.fake_block_quant(x, blocks, None, 4),
            "amax in the same pass",
        ),
        (TORCH_PT, lambda: torch.fake_quantize_per_tensor_affine(x, s, 0, -128, 127), "multiplies by 1/s"),
        (TORCH_C0, lambda: torch.fake_quantize_per_channel_affine(x, s_c0, zp_c0, 0, -128, 127), "axis 0"),
        (
            TORCH_LAST,
            lambda: torch.fake_quantize_per_channel_affine(x, s_last, zp_last, x.dim() - 1, -128, 127),
            f"{x.shape[-1]} ch.",
        ),
        ("naive clamp(round(x/s))*s", lambda: torch.clamp(torch.round(x / s), -128, 127) * s, "4 passes"),
        (TORCH_E4M3, lambda: (x / s).to(torch.float8_e4m3fn).to(x.dtype) * s, "not saturating"),
    ]
    if include_compile:
        naive = torch.compile(lambda t: torch.clamp(torch.round(t / s), -128, 127) * s)
        out.append(("torch.compile(naive chain)", lambda: naive(x), "inductor"))
    try:
        from modelopt.torch.quantization import tensor_quant as mtq  # nvidia-modelopt

        out.append((MO_PT, lambda: mtq.fake_tensor_quant(x, amax, None, 8), ""))
        out.append((MO_C0, lambda: mtq.fake_tensor_quant(x, amax_c0, None, 8), ""))
        out.append((MO_LAST, lambda: mtq.fake_tensor_quant(x, amax_last, None, 8), ""))
        out.append((MO_E4M3, lambda: mtq.scaled_e4m3(x, amax, None, 4, 3), ""))
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
    """One call's time. CUDA: between two events recorded around the call on an idle GPU (the call's whole latency:
    its Python and launches before the first kernel count), or with ``burst`` > 1 the mean of that many calls back
    to back (the throughput of a stream of calls: host time overlaps earlier calls' kernels)."""

    def __init__(self, device: str, burst: int = 1):
        self.cuda = device == "cuda"
        self.burst = burst
        self.faults = 0  #: minor page faults of the last call (CPU)

    def __call__(self, fn) -> float | None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            r = fn()
            for _ in range(self.burst - 1):
                if r is None:
                    break
                del r
                r = fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / self.burst
        else:
            f0, t0 = _minflt(), time.perf_counter()
            r = fn()
            ms = (time.perf_counter() - t0) * 1e3
            self.faults = _minflt() - f0
        if r is None:
            return None
        del r
        return ms


def forced(native, impl: str, fn):
    """fn with the native CPU kernel set ``impl`` forced for the call (back to "auto" after)."""

    def call():
        native.set_kernel_impl(impl)
        try:
            return fn()
        finally:
            native.set_kernel_impl("auto")

    return call


def run_shape(shape, dtype, device, rounds, include_compile, formats="all", show_faults=False, also=(), burst=1):
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
    native = backend._load("cpu") if also else None
    for impl in also:
        table += [(f"{n} [{impl}]", forced(native, impl, fn), note) for n, fn, note in list(table) if n in PEERS]
    timer = Timer(device, burst)
    times: dict[str, list[float]] = {name: [] for name, _, _ in table}
    faults: dict[str, list[int]] = {name: [] for name, _, _ in table}
    errors: dict[str, str] = {}
    for name, fn, _ in table:  # warm-up (builds kernels, compiles)
        try:
            if timer(fn) is None:
                errors[name] = "n/a"
        except Exception as e:  # noqa: BLE001
            errors[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    for r in range(rounds):
        # each round in its own order (seeded): a row's time then does not depend on which row ran before it (a
        # slow peer op that leaves the caches cold, frees memory, ...), which a fixed cyclic order would repeat
        for name, fn, _ in random.Random(r).sample(table, len(table)):
            if name not in errors:
                times[name].append(timer(fn))
                faults[name].append(timer.faults)
    bytes_rw = 2 * x.numel() * x.element_size()
    med = {name: statistics.median(v) for name, v in times.items() if v}
    clone, copy = med["x.clone()"], med["y.copy_(x), preallocated y"]
    rows = []
    for name, _, note in table:
        if name in errors:
            rows.append(f"| {name} | - | - | - | - | - | - | {errors[name] if errors[name] != 'n/a' else note} |")
            continue
        ms = med[name]
        if show_faults:
            note = f"{statistics.median(faults[name]):.0f} faults/call; {note}"
        peers = [_speedup(med, p, ms) for p in PEERS.get(name, ())] or ["", ""]
        rows.append(
            f"| {name} | {_ms(ms)} | {bytes_rw / ms / 1e6:.1f} | {ms / copy:.2f} | {ms / clone:.2f} | "
            f"{peers[0]} | {peers[1]} | {note} |"
        )
    return rows, med


def _ms(ms: float) -> str:
    """Three significant digits from 1 ms down (cache-sized shapes), one decimal above."""
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def _speedup(med: dict, peer: str, ms: float) -> str:
    """How many times faster than the peer row of the same run ("n/a" where that row did not run)."""
    return f"{med[peer] / ms:.1f}x" if peer in med else "n/a"


def target_summary(shape: str, med: dict) -> str:
    """Issue 24's CPU targets for the modelopt_lite integer/E4M3/int4 rows of one shape."""
    copy = med["y.copy_(x), preallocated y"]
    rows = [n for n in PEERS if n in med]
    if not rows:
        return f"{shape}: no modelopt_lite rows"
    worst_copy = max(rows, key=lambda n: med[n])
    parts = [f"{shape}: worst row {med[worst_copy] / copy:.2f}x the copy_ floor ({worst_copy}; target <= 1.3)"]
    for i, who in ((0, "torch"), (1, "nvidia-modelopt")):
        have = [n for n in rows if PEERS[n][i] in med]
        if not have:
            parts.append(f"{who}: n/a")
            continue
        slowest = min(have, key=lambda n: med[PEERS[n][i]] / med[n])
        parts.append(f"least speedup over {who} {med[PEERS[slowest][i]] / med[slowest]:.1f}x ({slowest}; target >= 5)")
    return "; ".join(parts)


def profile_rows(shape, dtype) -> None:
    """torch.profiler of each modelopt_lite row on CUDA: its kernels and the GPU's idle time per call."""
    from cuda_profile import profile_call  # bench/cuda_profile.py

    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    print()
    for name, fn, _ in cases(x, include_compile=False):
        if name.startswith("modelopt_lite") or name.startswith("y.copy_"):
            print(profile_call(name, fn))


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
    p.add_argument(
        "--also-impl",
        action="append",
        default=[],
        choices=["avx512", "avx2", "scalar"],
        help="CPU: also time every modelopt_lite integer/E4M3/int4 row with this kernel set forced (repeatable)",
    )
    p.add_argument(
        "--burst",
        type=int,
        default=1,
        help="CUDA: time this many calls back to back per sample (mean per call; default 1: one call on an idle GPU)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: after the table, torch.profiler of each modelopt_lite row of the first shape (kernels, GPU idle)",
    )
    args = p.parse_args(argv)
    if args.profile and args.device != "cuda":
        p.error("--profile: CUDA only (--device cuda)")
    if args.burst < 1 or (args.burst > 1 and args.device != "cuda"):
        p.error("--burst: a positive count, CUDA only (--device cuda)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if args.also_impl and args.device != "cpu":
        p.error("--also-impl: CPU kernel sets only (--device cpu)")
    default = ["256x1024x1024", "16384x16384"] if args.device == "cuda" else ["64x1024x1024", "4096x4096"]
    shapes = [
        parse_shape(s) for s in (args.shapes.split(",") if args.shapes else default[-1:] if args.quick else default)
    ]
    rounds = args.rounds or (3 if args.quick else 9)
    native = backend._load("cuda" if args.device == "cuda" else "cpu")
    if native is not None and hasattr(native, "set_huge_page_advice"):
        native.set_huge_page_advice({"on": True, "off": False}.get(args.huge_pages))
    if args.also_impl and native is None:
        p.error(f"--also-impl: the native CPU kernels are unavailable ({backend.native_error('cpu')})")
    if native is not None:
        backend.set_backend("native")
    else:  # still runs: the modelopt_lite rows then time the pure-torch reference (named in the machine line)
        backend.set_backend("reference")
    print(f"Machine: {machine(args.device)}")
    print(f"Load average at start: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    timing = f", {args.burst} calls back to back per sample (mean per call)" if args.burst > 1 else ""
    print(
        f"Settings: {args.dtype}, median of {rounds} interleaved rounds{timing}, GB/s = (read + write bytes) / time\n"
    )
    print(
        "| shape / case | median ms | GB/s | x copy_ | x clone | torch op / this | nvidia-modelopt op / this | note |"
    )
    print("|---|---|---|---|---|---|---|---|")
    summaries = []
    for shape in shapes:
        print(f"| **{'x'.join(map(str, shape))} {args.dtype}** | | | | | | | |")
        compile_rows = args.compile or args.device == "cuda"
        rows, med = run_shape(
            shape,
            DTYPES[args.dtype],
            args.device,
            rounds,
            compile_rows,
            args.formats,
            args.faults,
            args.also_impl,
            args.burst,
        )
        for row in rows:
            print(row)
        summaries.append(("x".join(map(str, shape)), med))
        sys.stdout.flush()
    if args.profile:
        profile_rows(shapes[0], DTYPES[args.dtype])
    print(f"\nLoad average at end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if native is not None and hasattr(native, "output_pool_stats"):
        held, nblocks, limit, hits, misses = native.output_pool_stats()
        print(
            f"Output pool (every native CPU kernel): limit {limit >> 20} MiB, {hits} hits, {misses} misses, {held >> 20} MiB kept"
        )
    if args.formats != "mx":
        print()
        for shape, med in summaries:
            print(f"Targets: {target_summary(shape, med)}")
    if args.formats != "classic":
        print()
        for shape, med in summaries:
            for line in mx_summary(med):
                print(f"{shape}: {line}")


if __name__ == "__main__":
    main()
