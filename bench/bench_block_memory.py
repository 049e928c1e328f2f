"""Peak memory of one dynamic-block fake quantization, as a multiple of the input's bytes (Linux: VmHWM).

    python bench/bench_block_memory.py                    # float16 and bfloat16, native and reference, 8192x4096
    python bench/bench_block_memory.py --rows 2048 --cols 4100 --block 128

Each case runs in a fresh process (the peak RSS only grows); the number is (peak after the call - peak before) /
input bytes, where the output alone accounts for 1.00. Printed as one markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CASE = """
import sys
import torch
import modelopt_lite.tensor_quant as tq
from modelopt_lite.functional.backend import set_backend

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

dtype, backend, rows, cols, block = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
set_backend(backend)
x = torch.randn(rows, cols, dtype=getattr(torch, dtype))
tq.fake_block_quant(x[:16], {-1: block}, None, 4)
base = peak_kib()
y = tq.fake_block_quant(x, {-1: block}, None, 4)
print((peak_kib() - base) * 1024 / (x.numel() * x.element_size()))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--block", type=int, default=128)
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"| dtype | backend | peak / input bytes ({args.rows}x{args.cols}, blocks of {args.block}) |")
    print("|---|---|---|")
    for dtype in ("float16", "bfloat16"):
        for backend in ("native", "reference"):
            cmd = [sys.executable, "-c", _CASE, dtype, backend, str(args.rows), str(args.cols), str(args.block)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            print(f"| {dtype} | {backend} | {float(out.stdout.strip().splitlines()[-1]):.2f} |")


if __name__ == "__main__":
    main()
