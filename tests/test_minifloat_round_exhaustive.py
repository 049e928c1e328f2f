"""mx_elem.h's E4M3 / E5M2 / E2M1 element rounding (the CPU scalar kernels' and every CUDA kernel's) against an
independent integer formulation, over every 31st float32 bit pattern (415M checks, a few seconds);
``MODELOPT_LITE_EXHAUSTIVE=1`` checks all 2**32 inputs of each format (about a minute)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent / "cuda_host" / "minifloat_round_check.cpp"


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("minifloat") / "check"
    flags = ["-O2", "-std=c++17", "-fno-fast-math", "-ffp-contract=off"]
    proc = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return exe


def test_minifloat_rounding_matches_integer_formulation(checker):
    step = 1 if os.environ.get("MODELOPT_LITE_EXHAUSTIVE") == "1" else 31
    proc = subprocess.run([str(checker), str(step)], capture_output=True, text=True, timeout=900)
    want_checked = 3 * ((2**32 - 1) // step + 1)
    assert proc.stdout.splitlines()[-1] == f"checked {want_checked} mismatches 0", proc.stdout[-2000:]
    assert proc.returncode == 0
