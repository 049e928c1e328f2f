"""What the CUDA fake-quant kernels compile to, without a GPU: registers, spills and instruction mix per kernel (SASS).

    python bench/sass_hot_path.py                       # sm_90 (H100/H200); needs nvcc, cuobjdump and nvdisasm
    python bench/sass_hot_path.py --arch sm_100 --filter Nvfp4

Compiles mx_kernels.cu, block_kernels.cu and quant_kernels.cu with the extension's own CUDA flags
(functional/native_build.py) to a cubin, disassembles it and prints one row per forward kernel (FULL: the build for
whole aligned 16-byte vectors and whole blocks, which common shapes run; general: partial blocks and odd views): registers per thread
(occupancy: 2048 threads per SM need <= 32; 64 gives half), spilled bytes, the static instruction count, and the
markers of work a bandwidth-bound kernel should not do per element or per 16-byte vector:

- ``div32``: inlined integer divisions (``I2F.U32.RP``, the start of the 32-bit division sequence; a 64-bit division
  calls a routine holding one more);
- ``f64``: float64 conversions (``F2F.F64*``/``F2I.*F64``/``I2F.F64*``; a quarter of the float32 rate on H100);
- ``branch regions``: ``BSSY`` (divergent-branch reconvergence points);
- ``fdiv``: IEEE float divisions (``FCHK``, one per inlined ``__fdiv_rn``);
- ``loop/elem`` (histograms): the instructions of the tightest loop (a backward branch) that loads 16-byte vectors,
  per element those loads bring (``LDG.E.128`` x 16 bytes / the element size): the issue one value costs, which
  caps a kernel whose loop issues at the SM's rate (4 warp instructions per cycle) before the memory does. Blank for
  the lanes kernels, whose one loop also holds their cold paths (the division's fallback, partial blocks), so that a
  static count of it says little; their hot path per element is counted by hand (bench/REPORT.md).

Static counts include the cold paths (partial blocks, misaligned views, the division slow path); they compare builds
of the same kernel (run it at two commits), they are not a time. GPU time needs bench_cuda.py on a GPU.
cuobjdump and nvdisasm ship with the CUDA toolkit (pip: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from modelopt_lite.functional.native_build import CSRC, CUDA_CFLAGS  # noqa: E402

SOURCES = ("mx_kernels.cu", "block_kernels.cu", "quant_kernels.cu")
MARKERS = {
    "div32": re.compile(r"^I2F\.U32\.RP\b"),
    "f64": re.compile(r"^(F2F\.F64|F2I\.[\w.]*F64|I2F\.F64)"),
    "branch regions": re.compile(r"^BSSY\b"),
    "fdiv": re.compile(r"^FCHK\b"),
}
_PTXAS = re.compile(r"Function properties for (\S+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores")
_REGS = re.compile(r"Compiling entry function '(\S+)'.*?Used (\d+) registers", re.S)


# Template parameters of each op (mx_kernels.cu / block_kernels.cu), in order.
PARAMS = {
    "Nvfp4Op": ("vectors", "bwd", "full"),  # vectors: P (2: MLQ_MX_NVFP4_ONE_LANE)
    "MxOp": ("vectors", "elem", "bwd", "full"),
    "MinifloatOp": ("elem", "full"),
    "DynBlockOp": ("vectors", "e4m3", "bwd", "full", "static"),  # static: a given block amax (fake_block_static)
}
ELEMS = ("e4m3", "e5m2", "e2m1", "int8")


def label(name: str) -> str | None:
    """A readable label for a forward kernel's mangled name (op, dtype, element, FULL or general), else None."""
    m = re.search(r"(Nvfp4Op|MxOp|MinifloatOp|DynBlockOp)I(13__nv_bfloat16|6__half|f)((?:L[ib]\d+E)+)", name)
    if m:
        dtype = {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32"}[m.group(2)]
        nums = [int(v) for v in re.findall(r"L[ib](\d+)E", m.group(3))]
        names = PARAMS[m.group(1)]
        if m.group(1) == "DynBlockOp" and len(nums) == 4:  # builds before the static block amax
            names = names[:-1]
        vals = dict(zip(names[len(names) - len(nums) :], nums))  # older builds: fewer leading parameters
        if vals.get("bwd"):
            return None
        parts = [m.group(1), dtype]
        if "elem" in vals:
            parts.append(ELEMS[vals["elem"]])
        if "e4m3" in vals:
            parts.append("e4m3" if vals["e4m3"] else "int")
        if "vectors" in vals:
            parts.append(f"P={vals['vectors']}")
        if "full" in vals:  # builds before 2026-11-27 had one kernel for every layout
            parts.append("FULL" if vals["full"] else "general")
        if vals.get("static"):
            parts.append("static")
        # lanes_kernel<Op, U> / lanes_kernel_min_blocks<Op, U, B>: slots per thread (1 or 2 today), resident blocks
        u = re.search(r"ELi(\d+)E(?:Li(\d+)E)?EEvT_", name)
        if u and int(u.group(1)) > 2:
            parts.append(f"U={u.group(1)}")
        if u and u.group(2):
            parts.append(f"min {u.group(2)} blocks")
        return " ".join(parts)
    m = re.search(r"histogram_kernelI(13__nv_bfloat16|6__half|f|d)E", name)
    if m:
        return "histogram " + {"13__nv_bfloat16": "bf16", "6__half": "fp16", "f": "fp32", "d": "fp64"}[m.group(1)]
    return None


def compile_one(nvcc: str, cuobjdump: str, src: str, arch: str, work: str) -> tuple[str, str]:
    cubin = os.path.join(work, src + ".cubin")
    cmd = [nvcc, *CUDA_CFLAGS, f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", cubin, str(CSRC / src)]
    built = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if built.returncode != 0:
        raise SystemExit(f"nvcc failed on {src}:\n{built.stderr[-3000:]}")
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=False)
    if sass.returncode != 0:
        raise SystemExit(f"cuobjdump failed (is nvdisasm on PATH?):\n{sass.stderr[-2000:]}")
    return built.stderr, sass.stdout


ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


def loop_per_element(block: str, elem_bytes: int) -> str:
    """Instructions per loaded element of the tightest loop (a backward branch) with a 16-byte load."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", block)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, t) in enumerate(ins):
        m = re.search(r"\bBRA (0x[0-9a-f]+)", t)
        if m is None or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
            continue
        body = [op for _, op in ins[at[int(m.group(1), 16)] : i + 1]]
        loads = sum("LDG.E.128" in op for op in body)
        if loads:
            per = len(body) / (loads * 16 // elem_bytes)
            best = per if best is None else min(best, per)
    return "" if best is None else f"{best:.1f}"


def kernel_rows(ptxas_log: str, sass: str, pattern: re.Pattern) -> list[dict]:
    regs = dict(_REGS.findall(ptxas_log))
    spills = {n: int(s) for n, _stack, s in _PTXAS.findall(ptxas_log)}
    rows = []
    for block in re.split(r"\n\s+Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        text = label(name)
        if text is None or not pattern.search(text):
            continue
        ops = [re.sub(r"^@!?U?P\w+\s+", "", i) for i in re.findall(r"/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", block)]
        counts = Counter(k for op in ops for k, rx in MARKERS.items() if rx.match(op))
        rows.append(
            {
                "kernel": text,
                "regs": int(regs.get(name, 0)),
                "spill": spills.get(name, 0),
                "instructions": len(ops),
                **{k: counts.get(k, 0) for k in MARKERS},
                "loop/elem": loop_per_element(block, ELEM_BYTES[text.split()[1]]) if text.startswith("hist") else "",
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--filter", default="", help="regex on the kernel label (e.g. 'Nvfp4|histogram')")
    p.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    a = p.parse_args()
    if shutil.which(a.nvcc) is None or shutil.which(a.cuobjdump) is None:
        print("needs nvcc and cuobjdump (with nvdisasm) on PATH; nothing to do")
        return
    pattern = re.compile(a.filter)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        for src in SOURCES:
            log, sass = compile_one(a.nvcc, a.cuobjdump, src, a.arch, work)
            rows += kernel_rows(log, sass, pattern)
    cols = ["kernel", "regs", "spill", "instructions", *MARKERS, "loop/elem"]
    print(f"### SASS of the forward fake-quant kernels, {a.arch} ({len(rows)} kernels)\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in sorted(rows, key=lambda r: r["kernel"]):
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
