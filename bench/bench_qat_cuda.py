"""QAT step time on the GPU: forward + backward of a quantized MLP block (Linear -> GELU -> Linear, residual) whose
weights are fake-quantized to NVFP4 or MXFP8 every step, modelopt_lite's kernels against the same model with a
pure-torch quantization chain under torch.compile.

    python bench/bench_qat_cuda.py                    # d=2048, 8192 tokens, bf16 activations
    python bench/bench_qat_cuda.py --dry-run-cpu      # exercise the script on the CPU (tiny sizes, no compile)

Rows per format: ours eager (the public ops: nvfp4_fake_quant / mx_fake_quant with their STE backward kernels),
ours eager through one ``TensorQuantizer`` per weight (what ``quantize()`` builds; NVFP4's global amax calibrated
once from the weight, as after calibration, instead of the per-step max of the first row),
ours with torch.compile of the model (our ops stay opaque nodes), and torch.compile of the model with the lean
pure-torch chain of bench/cuda_mx_rows.py and the same clipped straight-through gradient (``w`` where
``|w| <= block range``); unquantized bf16 for scale. Time per step: CUDA events, median of --repeats.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench_cuda import Timer  # noqa: E402  (bench/ is on sys.path as the script's folder)
from cuda_mx_rows import torch_mx, torch_nvfp4  # noqa: E402

from modelopt_lite.functional import library_mx  # noqa: E402
from modelopt_lite.functional import microscaling as MS  # noqa: E402
from modelopt_lite.functional.abs_max import abs_max  # noqa: E402


def _ours(fmt: str):
    if fmt == "nvfp4":  # the global amax as a dynamic quantizer takes it: max |w| in one pass, in w's dtype
        return lambda w: library_mx.nvfp4_fake_quant(w, abs_max(w.detach()).float(), 16)
    return lambda w: library_mx.mx_fake_quant(w, "e4m3", 32, "floor")


def _chain(fmt: str):
    """The pure-torch chain with the clipped STE: forward fq(w), gradient w's where |w| <= its block's range."""

    def fq(w):
        if fmt == "nvfp4":
            gs = MS.nvfp4_global_scale(w.detach().float().abs().amax())
            wq = torch_nvfp4(w.detach(), gs)
            wb = w.detach().float().reshape(-1, 16)
            s = (wb.abs().amax(-1, keepdim=True) / (gs * 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn).float()
            top = s * gs * 6.0
        else:
            wq = torch_mx(w.detach(), "e4m3")
            wb = w.detach().float().reshape(-1, 32)
            a = wb.abs().amax(-1, keepdim=True)
            k = ((a.view(torch.int32) >> 23) & 0xFF) - 127 - 8
            k = torch.where(a == 0, torch.full_like(k, -127), k.clamp(-126, 127))
            top = ((k + 127) << 23).view(torch.float32) * 448.0
        keep = (wb.abs() <= top).reshape(w.shape).to(w.dtype)
        return wq + (w - w.detach()) * keep

    return fq


class Block(torch.nn.Module):
    def __init__(self, d: int, quant, device, dtype, quant_down=None):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d, bias=False, device=device, dtype=dtype)
        self.down = torch.nn.Linear(4 * d, d, bias=False, device=device, dtype=dtype)
        self.quant = quant
        self.quant_down = quant_down  # None: ``quant`` for both weights

    def forward(self, x):
        q = self.quant or (lambda w: w)
        qd = self.quant_down or q
        return x + F.linear(F.gelu(F.linear(x, q(self.up.weight))), qd(self.down.weight))


def _quantizer_block(fmt: str, d: int, device, dtype) -> Block:
    """The block with one TensorQuantizer per weight, as quantize() gives each Linear its weight quantizer."""
    from modelopt_lite.descriptor import QuantDescriptor
    from modelopt_lite.nn import TensorQuantizer

    block = Block(d, None, device, dtype)

    def quantizer(w):
        if fmt == "nvfp4":  # the global amax calibrated once (max of |w|), as after calibration
            nvfp4 = {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
            desc = QuantDescriptor(num_bits=(2, 1), block_sizes=nvfp4, amax=float(w.detach().abs().amax()))
        else:
            desc = QuantDescriptor(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)})
        return TensorQuantizer(desc).to(device)

    block.quant, block.quant_down = quantizer(block.up.weight), quantizer(block.down.weight)
    return block


def _stepper(model, x):
    """One forward + backward step of ``model`` on ``x``."""

    def step():
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()

    return step


def time_step(model, x, repeats: int, cuda: bool) -> float:
    """Median seconds of one forward + backward step (3 warm-up steps), timed as bench_cuda's rows are."""
    return Timer("cuda" if cuda else "cpu", repeats)(_stepper(model, x))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=2048, help="model width (a multiple of 32)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--formats", default="nvfp4,mxfp8")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--dry-run-cpu", action="store_true", help="tiny sizes on the CPU, no torch.compile")
    p.add_argument(
        "--profile", action="store_true", help="CUDA: torch.profiler of one step of every row after the table"
    )
    args = p.parse_args(argv)
    cuda = not args.dry_run_cpu
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available: bench_qat_cuda skipped (run it on a GPU machine).")
        return 0
    if not cuda:
        args.d, args.tokens, args.repeats, args.compile = 64, 32, 2, False
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    name = torch.cuda.get_device_name() if cuda else "CPU dry run"
    print(f"### QAT step (MLP block d={args.d}, {args.tokens} tokens, {dtype}), {name}; torch {torch.__version__}\n")
    print("| weights | implementation | ms per step | vs torch.compile chain |")
    print("|---|---|---|---|")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.d, device=device, dtype=dtype)
    base = Block(args.d, None, device, dtype)
    print(f"| {dtype} (no quantization) | eager | {time_step(base, x, args.repeats, cuda) * 1e3:.3f} | |", flush=True)
    profiles = []
    for fmt in args.formats.split(","):
        rows = [("modelopt_lite eager", Block(args.d, _ours(fmt), device, dtype))]
        rows.append(("modelopt_lite eager, TensorQuantizer per weight", _quantizer_block(fmt, args.d, device, dtype)))
        if args.compile:
            rows.append(
                ("modelopt_lite, torch.compile(model)", torch.compile(Block(args.d, _ours(fmt), device, dtype)))
            )
            rows.append(
                ("torch.compile(model with pure-torch chain)", torch.compile(Block(args.d, _chain(fmt), device, dtype)))
            )
        else:
            rows.append(("model with pure-torch chain (eager)", Block(args.d, _chain(fmt), device, dtype)))
        times = {}
        for label, model in rows:
            try:
                times[label] = time_step(model, x, args.repeats, cuda)
            except Exception as e:  # noqa: BLE001  (a row that cannot run is reported, not fatal)
                print(f"| {fmt} | {label} | n/a ({type(e).__name__}: {str(e).splitlines()[0][:60]}) | |", flush=True)
        ref = times.get(rows[-1][0])
        for label, t in times.items():
            rel = f"{ref / t:.2f}x" if ref else ""
            print(f"| {fmt} | {label} | {t * 1e3:.3f} | {rel} |", flush=True)
        profiles += [(f"{fmt}, {label}", model) for label, model in rows if label in times]
    if args.profile:
        from cuda_profile import profile_call  # bench/cuda_profile.py

        print()
        for label, model in profiles:
            print(profile_call(label, _stepper(model, x), top=10), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
