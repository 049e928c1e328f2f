"""The cost of one quantizer call on a small tensor (CPU): where the per-call work, not the data, is the time.

    python bench/bench_call_overhead.py                 # 64x64 float32, 1 thread
    python bench/bench_call_overhead.py --quick         # fewer repeats
    python bench/bench_call_overhead.py --shape 16x1024 --threads 2
    python bench/bench_call_overhead.py --cuda-path     # the CUDA path's host time, on the CPU (see below)

A ``TensorQuantizer`` forward for per-tensor and per-channel int8, E4M3 and int4 dynamic blocks of 32, next to
torch's ``fake_quantize_per_tensor_affine`` on the same input in the same process: microseconds per call, the best
of several timed loops (the least disturbed by other work on the machine). The script uses the public API only, so
it runs unchanged on an earlier checkout (``PYTHONPATH=<checkout>``) for a before/after comparison.

``--cuda-path``: the host time a CUDA call spends before and around its kernels, measured without a GPU. CPU tensors
take the CUDA path (the host-emulated CUDA bindings of tests/emulated_build.py, built once, about a minute; the
routing, the deferred value checks and the device-filled scalars of a GPU), and rows for NVFP4 / MXFP8 quantizers,
the public ``nvfp4_fake_quant`` / ``mx_fake_quant`` / ``fake_block_quant`` calls and a forward + backward are added.
The emulated kernels run on the host, so on a tiny input the time is the Python, dispatch and allocation work of a
call (a GPU adds its launch calls, about 2-5 us each): the part that leaves a GPU idle on a single call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelopt_lite.descriptor import QuantDescriptor  # noqa: E402
from modelopt_lite.nn import TensorQuantizer  # noqa: E402


def per_call_us(fn, x: torch.Tensor, calls: int, loops: int) -> float:
    for _ in range(max(10, calls // 20)):
        fn(x)
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="64x64", help="input shape, e.g. 64x64")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="fewer calls per loop and fewer loops")
    p.add_argument("--cuda-path", action="store_true", help="CPU tensors take the host-emulated CUDA path")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(v) for v in args.shape.lower().split("x"))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    rows = x.shape[0]
    quantizers = {
        "TensorQuantizer int8 per tensor": QuantDescriptor(num_bits=8, amax=2.0),
        f"TensorQuantizer int8 per channel (axis 0, {rows})": QuantDescriptor(
            num_bits=8, axis=0, amax=[1.0 + 0.01 * i for i in range(rows)]
        ),
        "TensorQuantizer E4M3 per tensor": QuantDescriptor(num_bits=(4, 3), amax=2.0),
        "TensorQuantizer int4 dynamic blocks of 32": QuantDescriptor(
            num_bits=4, block_sizes={-1: 32, "type": "dynamic"}
        ),
    }
    calls, loops = (300, 3) if args.quick else (2000, 7)
    cases = {name: TensorQuantizer(d).__call__ for name, d in quantizers.items()}
    cases["torch.fake_quantize_per_tensor_affine"] = lambda t: torch.fake_quantize_per_tensor_affine(
        t, 0.1, 0, -128, 127
    )
    route = contextlib.nullcontext()
    if args.cuda_path:
        cases.update(cuda_path_cases(x))
        route = _emulated_cuda_path()
    import modelopt_lite

    print(
        f"### Call cost, {args.shape} float32, {args.threads} thread(s), best of {loops} loops of {calls} calls; "
        f"modelopt_lite from {Path(modelopt_lite.__file__).resolve().parent.parent}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs\n"
    )
    print("| call | us per call |")
    print("|---|--:|")
    with route:
        for name, fn in cases.items():
            print(f"| {name} | {per_call_us(fn, x, calls, loops):.1f} |", flush=True)
    return 0


def cuda_path_cases(x: torch.Tensor) -> dict:
    """The rows added by ``--cuda-path`` (x's last dimension a multiple of 32)."""
    from modelopt_lite.functional import library_mx
    from modelopt_lite.tensor_quant import fake_block_quant

    nvfp4 = QuantDescriptor(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, amax=3.0)
    mxfp8 = QuantDescriptor(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)})
    q_nv, q_mx = TensorQuantizer(nvfp4), TensorQuantizer(mxfp8)
    amax = torch.tensor(3.0)
    xg = x.clone().requires_grad_()

    def step(q):
        return lambda t: q(xg).sum().backward()

    return {
        "TensorQuantizer NVFP4 (dynamic blocks of 16, global amax)": q_nv.__call__,
        "TensorQuantizer MXFP8": q_mx.__call__,
        "nvfp4_fake_quant(x, amax tensor)": lambda t: library_mx.nvfp4_fake_quant(t, amax, 16),
        "mx_fake_quant(x, 'e4m3')": lambda t: library_mx.mx_fake_quant(t, "e4m3"),
        "fake_block_quant(x, {-1: 32}) (dynamic int4)": lambda t: fake_block_quant(t, {-1: 32}),
        "NVFP4 quantizer forward + backward (of .sum())": step(q_nv),
        "MXFP8 quantizer forward + backward (of .sum())": step(q_mx),
    }


def _emulated_cuda_path():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from emulated_build import build, cuda_path_on_host  # tests/emulated_build.py (needs the CUDA headers)

    return cuda_path_on_host(build())


if __name__ == "__main__":
    sys.exit(main())
