"""Benchmark: FP32 vs FP16/BF16 (GPU) vs real INT8 Linear and Conv2d, every available int8 path side by side.

Shapes (the torch_quantizer README's): Linear batch 512, 960x960 and 4096x4096; Conv2d batch 1, 512 -> 512
channels, 3x3, 14x14 and 28x28. Times are medians over interleaved rounds (every path once per round), so slow
drift of a shared machine hits all paths alike. Each real module is timed end to end (float input -> quantize
activations -> integer GEMM -> float output), like the float op it replaces; raw kernels are listed for context.

Usage::

    python bench/bench_real_int8.py                 # CPU
    python bench/bench_real_int8.py --device cuda   # GPU: _int_mm vs FP16/BF16 (INT8 should win on 4096x4096)
    python bench/bench_real_int8.py --quick         # fewer rounds, small shapes only (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import modelopt_lite as mtl
from modelopt_lite.real import fake2real, int8_gemm


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timeit(fns: dict, rounds: int, dev) -> dict:
    """Median milliseconds per function, measured in interleaved rounds after one warm-up call each."""
    times = {k: [] for k in fns}
    with torch.no_grad():
        for f in fns.values():
            f()
        _sync(dev)
        for _ in range(rounds):
            for k, f in fns.items():
                t = time.perf_counter()
                f()
                _sync(dev)
                times[k].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def _quantized(module: torch.nn.Module, x: torch.Tensor):
    wrap = torch.nn.Sequential(module)
    fq = mtl.quantize(wrap, mtl.INT8_DEFAULT_CFG, lambda m: m(x))
    return fq


def _real(fq, backend):
    return fake2real(fq, inplace=False, backend=backend)


def _raw_linear_paths(x, w, dev, exact_note):
    """Raw int8 kernels for context (activation codes prepared outside the timing)."""
    out = {}
    q = torch.clamp(torch.round(x / (x.abs().max() / 127)), -128, 127)
    wq = torch.clamp(torch.round(w / (w.abs().amax(1, keepdim=True) / 127)), -128, 127).to(torch.int8)
    if dev.type == "cuda":
        a, b = q.to(torch.int8), wq.contiguous().T
        out["raw torch._int_mm (int8 codes in, int32 out)"] = (lambda: torch._int_mm(a, b), "exact")
        return out
    if hasattr(torch.ops.quantized, "linear_prepack"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wt = torch._make_per_channel_quantized_tensor(
                wq, torch.ones(w.shape[0], dtype=torch.double), torch.zeros(w.shape[0], dtype=torch.int64), 0
            )
            packed = torch.ops.quantized.linear_prepack(wt, None)
            xq = torch._make_per_tensor_quantized_tensor((q + 128).to(torch.uint8), 1.0, 128)
        out["raw quantized.linear (fbgemm, u8 out)"] = (
            lambda: torch.ops.quantized.linear(xq, packed, 1000.0, 0),
            exact_note,
        )
    if int8_gemm.onednn_available():
        pk = torch.ops.onednn.qlinear_prepack(wq, None)
        u = (q + 128).to(torch.uint8)
        ones, zp = torch.ones(w.shape[0]), torch.zeros(w.shape[0], dtype=torch.int64)
        out["raw onednn qlinear, 1 call (fp32 out)"] = (
            lambda: int8_gemm._onednn_linear_call(u, 128, 1.0, pk, ones, zp, None),
            exact_note,
        )
    return out


def bench_linear(m, k, n, dev, rounds, big_int_mm: bool):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n).to(dev)
    x = torch.randn(m, k, device=dev)
    fq = _quantized(lin, x)
    mode = int8_gemm.onednn_mode() if dev.type == "cpu" else "n/a"
    exact_note = "EXACT" if mode == "direct" else "NOT exact here (u8*s8 int16 saturation, no VNNI)"
    paths = {"fp32 F.linear": (lambda: F.linear(x, lin.weight, lin.bias), "float")}
    if dev.type == "cuda":
        for dt in (torch.float16, torch.bfloat16):
            xh, wh, bh = x.to(dt), lin.weight.to(dt), lin.bias.to(dt)
            paths[f"{str(dt)[6:]} F.linear"] = (lambda xh=xh, wh=wh, bh=bh: F.linear(xh, wh, bh), "float")
    paths["fake-quant QuantLinear (fp32)"] = (lambda: fq(x), "reference numerics")
    paths.update(_real_paths(fq, x, dev, mode, big_int_mm, "QuantizedLinear"))
    for k2, v in _raw_linear_paths(x, lin.weight.detach(), dev, exact_note).items():
        paths[k2] = v
    return paths


def _real_paths(fq, x, dev, mode, big_int_mm: bool, cls_name: str) -> dict:
    """``label -> (run, note)`` for each real-INT8 backend this device offers (one real module per backend)."""
    backends = (
        ["int_mm"]
        if dev.type == "cuda"
        else (["onednn"] if int8_gemm.onednn_available() else []) + ["float_exact"] + (["int_mm"] if big_int_mm else [])
    )
    paths = {}
    for be in backends:
        real = _real(fq, be)
        label = f"real {cls_name} [{be}{'/' + mode if be == 'onednn' else ''}]"
        paths[label] = (lambda real=real: real(x), _check(fq, real, x))
    return paths


def _check(fq, real, x) -> str:
    """``exact-int (max diff vs fake d, bound b)``: the bound of the real module holds?"""
    with torch.no_grad():
        a, b = fq(x), real(x)
        bound = real[0].error_bound(x)
    d = (a.double() - b.double()).abs()
    ok = bool((d <= bound).all())
    return f"{'within' if ok else 'OUTSIDE'} bound (max diff {float(d.max()):.1e})"


def bench_conv(hw, dev, rounds, big_int_mm: bool):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(512, 512, 3, padding=1).to(dev)
    x = torch.randn(1, 512, hw, hw, device=dev)
    fq = _quantized(conv, x)
    mode = int8_gemm.onednn_mode() if dev.type == "cpu" else "n/a"
    paths = {"fp32 F.conv2d": (lambda: conv(x), "float")}
    if dev.type == "cuda":
        for dt in (torch.float16, torch.bfloat16):
            ch = torch.nn.Conv2d(512, 512, 3, padding=1).to(dev, dt)
            xh = x.to(dt)
            paths[f"{str(dt)[6:]} F.conv2d"] = (lambda ch=ch, xh=xh: ch(xh), "float")
    paths["fake-quant QuantConv2d (fp32)"] = (lambda: fq(x), "reference numerics")
    paths.update(_real_paths(fq, x, dev, mode, big_int_mm, "QuantizedConv2d"))
    return paths


def _report(title, paths, rounds, dev):
    res = _timeit({k: f for k, (f, _) in paths.items()}, rounds, dev)
    base = res[next(iter(res))]
    print(f"\n## {title}")
    print("| path | median ms | speed vs fp32 | numerics |")
    print("|---|---|---|---|")
    for k, ms in res.items():
        print(f"| {k} | {ms:.3f} | {base / ms:.2f}x | {paths[k][1]} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 15 on GPU, 7 on CPU)")
    p.add_argument("--quick", action="store_true", help="small shapes and 3 rounds only")
    p.add_argument("--int-mm-cpu", action="store_true", help="also time torch._int_mm on CPU (naive, very slow)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    rounds = a.rounds or (3 if a.quick else (15 if dev.type == "cuda" else 7))
    name = (
        torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else f"CPU ({torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}, oneDNN int8 mode: {int8_gemm.onednn_mode()})"
    )
    print(f"# bench_real_int8: torch {torch.__version__}, {name}, {rounds} rounds")
    lin_shapes = [(512, 960, 960)] + ([] if a.quick else [(512, 4096, 4096)])
    for m, k, n in lin_shapes:
        small = k * n <= 960 * 960
        _report(
            f"Linear batch {m}, {k} -> {n}",
            bench_linear(m, k, n, dev, rounds, a.int_mm_cpu or (small and dev.type == "cpu")),
            rounds,
            dev,
        )
    for hw in [14] + ([] if a.quick else [28]):
        _report(f"Conv2d batch 1, 512 -> 512, 3x3, {hw}x{hw}", bench_conv(hw, dev, rounds, a.int_mm_cpu), rounds, dev)


if __name__ == "__main__":
    main()
