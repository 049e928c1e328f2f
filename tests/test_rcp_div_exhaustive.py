"""mx_elem.h's division of a float16 / bfloat16 element through its scale's reciprocal (``fdiv_rcp``: the CUDA
NVFP4 and fused dynamic-block kernels; ``fdiv_rcp_clamped``: the elementwise E4M3 / E5M2 / E2M1 kernels) against
true division, bit for bit, with the element formats applied (tests/cuda_host/rcp_div_check.cpp): every 16-bit
significand against every 61st divisor significand (140M checks) plus every 16-bit value across the divisor's
range, a few seconds; ``MODELOPT_LITE_EXHAUSTIVE=1`` takes every
divisor significand (all 2**33 pairs, about a minute)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent / "cuda_host" / "rcp_div_check.cpp"


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("rcp_div") / "check"
    flags = ["-O2", "-std=c++17", "-fno-fast-math", "-ffp-contract=off"]
    proc = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return exe


def test_reciprocal_division_matches_true_division(checker):
    step = 1 if os.environ.get("MODELOPT_LITE_EXHAUSTIVE") == "1" else 61
    proc = subprocess.run([str(checker), str(step)], capture_output=True, text=True, timeout=900)
    significand_pairs = ((2**23 - 1) // step + 1) * 2**10
    last = proc.stdout.splitlines()[-1]
    checked = int(last.split()[1])
    assert last == f"checked {checked} mismatches 0", proc.stdout[-2000:]
    assert proc.returncode == 0
    # the range parts' counts are fixed by their loops: 2 x 65536 inputs x 85 exponents x 8 (4) significands, less
    # the inputs and pairs each leaves out, checked for the quotient and 5 formats (for the clamped division, 3)
    assert checked - significand_pairs == 6 * 45_010_030 + 4 * 41_335_812, checked
