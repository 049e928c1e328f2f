"""Benchmark: the GPU-first real paths (FP8 ``_scaled_mm``, INT8 ``_int_mm``, INT4 ``int4pack``) against bf16.

Per layer: a bf16 ``nn.Linear(K, N)`` quantized (FP8_DEFAULT_CFG, FP8 with dynamic per-row activations and
per-channel weights, INT8_DEFAULT_CFG, INT4 blocks of 128 weight-only), converted with ``fake2real`` and timed end
to end (bf16 input -> quantize -> GEMM -> bf16 output) beside bf16 ``F.linear`` and torch's raw kernel on
pre-quantized operands (the ceiling: what we own is the gap). Also: the weight bytes against bf16's, and for INT4
the crossover M where the int4 GEMM stops beating dequantize-then-bf16 (``fast_gemm.INT4PACK_MAX_M``).

End to end: a small Llama decoder built locally (random weights, no download) in bf16, FP8 W8A8 real vs bf16:
prefill and decode tokens/s, with the logits' agreement with the float model printed beside the speed.

Timing: CUDA events on CUDA around 10 back-to-back calls (the steady state of a layer inside a model: the host
prepares the next call while the GPU runs this one, so the host overhead of a forward shows only where it exceeds the
GPU time, as at small M), median of ``--repeats`` such batches per call, after warm-up; ``time.perf_counter`` on CPU.
The first GPU run (H200, 2026-11-26) timed single calls with a synchronization between them instead, which adds the
whole host overhead of a forward (~0.1 ms in Python) to every row.

Usage::

    python bench/bench_real_gpu.py --device cuda           # M in {1,16,128,512,2048,4096}, K = N in {4096, 8192}
    python bench/bench_real_gpu.py --device cpu --quick    # tiny shapes: a smoke test of every path
    python bench/bench_real_gpu.py --m 1,16,2048 --kn 4096 --no-e2e --repeats 10   # tests/gpu/run_session.sh's
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import modelopt_lite as mtl
from modelopt_lite.real import fake2real, fast_gemm, int4pack

FULL_M, FULL_KN = (1, 16, 128, 512, 2048, 4096), (4096, 8192)
QUICK_M, QUICK_KN = (1, 32), (256,)
BATCH = 10  # back-to-back calls per CUDA timing


def _cfgs() -> dict:
    fp8_row = copy.deepcopy(mtl.FP8_DEFAULT_CFG)
    fp8_row["quant_cfg"]["*weight_quantizer"]["axis"] = 0
    fp8_row["quant_cfg"]["*input_quantizer"] = {"num_bits": (4, 3), "axis": (0,), "dynamic": True, "enable": True}
    return {
        "fp8 tensor": (mtl.FP8_DEFAULT_CFG, "scaled_mm"),
        "fp8 rowwise dyn": (fp8_row, "scaled_mm"),
        "int8": (mtl.INT8_DEFAULT_CFG, "int_mm"),
        "int4 g128": (mtl.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "int4pack"),
    }


class Timer:
    def __init__(self, dev: torch.device, repeats: int):
        self.dev, self.repeats = dev, repeats

    def __call__(self, fn) -> float:
        """Median milliseconds of ``fn()``."""
        with torch.no_grad():
            for _ in range(3):
                fn()
            if self.dev.type == "cuda":
                torch.cuda.synchronize()
                out = []
                for _ in range(self.repeats):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(BATCH):
                        fn()
                    b.record()
                    b.synchronize()
                    out.append(a.elapsed_time(b) / BATCH)
                return statistics.median(out)
            out = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(out)


def _real_layer(cfg, backend, k, n, dev):
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(k, n)).to(dev, torch.bfloat16)
    base = copy.deepcopy(lin[0])
    calib = torch.randn(64, k, device=dev, dtype=torch.bfloat16)
    fq = mtl.quantize(lin, copy.deepcopy(cfg), lambda m: m(calib)).eval()
    return fake2real(fq, backend=backend)[0], base


def _raw(name, real, x):
    """torch's raw kernel on pre-quantized operands (no activation quantization, no epilogue)."""
    k, n = real.in_features, real.out_features
    if name.startswith("fp8"):
        a = x.to(torch.float8_e4m3fn)
        w = real.weight.t()
        if "rowwise" in name:
            sa = torch.ones(x.shape[0], 1, device=x.device)
            sb = torch.ones(1, n, device=x.device)
        else:
            sa = sb = torch.ones((), device=x.device)
        return lambda: torch._scaled_mm(a, w, sa, sb, out_dtype=torch.bfloat16)
    if name == "int8":
        a = torch.randint(-127, 127, (max(x.shape[0], 17) if x.is_cuda else x.shape[0], k), device=x.device)
        a = a.to(torch.int8)
        w = real.weight.t()
        return lambda: torch._int_mm(a, w)
    p = fast_gemm.prepared(real, "int4pack", x)
    return lambda: int4pack.mm(x, p["packed"], p["group"], p["sz"])


def _bytes(m) -> int:
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())


def layer_table(dev, ms, kns, timer) -> list[dict]:
    rows = []
    for kn in kns:
        layers = {name: _real_layer(cfg, be, kn, kn, dev) for name, (cfg, be) in _cfgs().items()}
        for m in ms:
            x = torch.randn(m, kn, device=dev, dtype=torch.bfloat16)
            base = next(iter(layers.values()))[1]
            t_bf16 = timer(lambda x=x, base=base: F.linear(x, base.weight, base.bias))
            for name, (real, _) in layers.items():
                t_ours = timer(lambda x=x, real=real: real(x))
                t_raw = timer(_raw(name, real, x))
                ratio = _bytes(real) / _bytes(base)
                rows.append({"K=N": kn, "M": m, "path": name, "bf16": t_bf16, "ours": t_ours, "raw": t_raw, "w": ratio})
                if name.startswith("int4"):
                    real.backend = "auto"  # the dequantize-then-bf16 side of the dispatch
                    real.__dict__.pop("_fast_cache", None)
                    deq = timer(lambda x=x, real=real: F.linear(x, real.dequantized_weight(), real.bias))
                    real.backend = "int4pack"
                    rows[-1]["dequant"] = deq
    return rows


def print_layers(rows) -> None:
    print(f"{'K=N':>5} {'M':>5} {'path':<16} {'bf16 ms':>9} {'ours ms':>9} {'x bf16':>7} {'raw ms':>9} "
          f"{'ours/raw':>8} {'w bytes':>8} {'deq ms':>8}")  # fmt: skip
    for r in rows:
        deq = f"{r['dequant']:8.4f}" if "dequant" in r else " " * 8
        print(
            f"{r['K=N']:>5} {r['M']:>5} {r['path']:<16} {r['bf16']:9.4f} {r['ours']:9.4f} "
            f"{r['bf16'] / r['ours']:7.2f} {r['raw']:9.4f} {r['ours'] / r['raw']:8.2f} {r['w']:8.3f} {deq}"
        )
    for kn in sorted({r["K=N"] for r in rows}):
        int4 = [r for r in rows if r["K=N"] == kn and "dequant" in r]
        wins = [r["M"] for r in int4 if r["ours"] < r["dequant"]]
        print(f"int4 crossover K=N={kn}: int4 GEMM faster than dequant+bf16 at M in {wins} "
              f"(fast_gemm.INT4PACK_MAX_M = {fast_gemm.INT4PACK_MAX_M})")  # fmt: skip


def _decoder(dev, quick: bool):
    import transformers

    h = 128 if quick else 2048
    cfg = transformers.LlamaConfig(
        vocab_size=512 if quick else 32000,
        hidden_size=h,
        intermediate_size=2 * h if quick else 5632,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=4 if quick else 16,
        num_key_value_heads=4 if quick else 16,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()


def end_to_end(dev, quick: bool, timer) -> None:
    model = _decoder(dev, quick)
    batch, seq, new = (2, 16, 2) if quick else (8, 512, 64)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    cfg = copy.deepcopy(mtl.FP8_DEFAULT_CFG)
    cfg["quant_cfg"]["*lm_head*"] = {"enable": False}
    fq = mtl.quantize(copy.deepcopy(model), cfg, lambda m: m(calib))
    real = fake2real(fq, backend="scaled_mm" if dev.type == "cpu" else "auto")
    with torch.no_grad():
        ref = model(ids).logits.float()
    print(f"\nend to end: Llama h={model.config.hidden_size} x{model.config.num_hidden_layers}, batch {batch}, "
          f"prompt {seq}, {new} new tokens")  # fmt: skip
    print(f"{'model':<10} {'prefill tok/s':>14} {'decode tok/s':>13} {'logit rel err':>14} {'top-1 agree':>12}")
    for name, m in (("bf16", model), ("fp8 real", real)):
        t_pre = timer(lambda m=m: m(ids))
        gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        t_gen = timer(lambda m=m, gen=gen: m.generate(ids, **gen))
        with torch.no_grad():
            out = m(ids).logits.float()
        err = float((out - ref).norm() / ref.norm())
        agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
        decode = batch * new / max((t_gen - t_pre) / 1e3, 1e-9)
        print(f"{name:<10} {batch * seq / (t_pre / 1e3):14.0f} {decode:13.0f} {err:14.4f} {agree:12.3f}")


def profile_layers(dev, m: int, kn: int, rows: int = 8) -> None:
    """Where a real layer's time goes: torch.profiler over 10 forwards of each path at M x K = N, the ops with the most
    device time (CPU time on the CPU). The raw kernel's row (_scaled_mm, _int_mm, ...) is among them, so the other
    rows are the gap between ours and raw in the table above: the activation codes, the epilogue, copies."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    x = torch.randn(m, kn, device=dev, dtype=torch.bfloat16)
    for name, (cfg, be) in _cfgs().items():
        real, _ = _real_layer(cfg, be, kn, kn, dev)
        with torch.no_grad():
            for _ in range(3):
                real(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            with profile(activities=acts) as prof:
                for _ in range(10):
                    real(x)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
        print(f"\nprofile: {name}, M={m}, K=N={kn}, 10 forwards")
        print(prof.key_averages().table(sort_by=key, row_limit=rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--m", default=None, help="comma-separated M values (default: the full or quick list)")
    ap.add_argument("--kn", default=None, help="comma-separated K = N values (default: the full or quick list)")
    ap.add_argument("--profile", action="store_true", help="also profile each path at the largest M and K = N")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    timer = Timer(dev, args.repeats or (2 if args.quick else 30))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    ms, kns = (QUICK_M, QUICK_KN) if args.quick else (FULL_M, FULL_KN)
    ms = tuple(int(v) for v in args.m.split(",")) if args.m else ms
    kns = tuple(int(v) for v in args.kn.split(",")) if args.kn else kns
    print_layers(layer_table(dev, ms, kns, timer))
    if args.profile:
        profile_layers(dev, max(ms), max(kns))
    if not args.no_e2e:
        end_to_end(dev, args.quick, timer)


if __name__ == "__main__":
    main()
