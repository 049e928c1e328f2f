"""The standalone C++ checkers of tests/cuda_host (mx_elem.h's element math against an independent formulation,
no torch headers): built with IEEE float semantics (no fast math, no FMA contraction) and run with a sampling step."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = Path(__file__).resolve().parent / "cuda_host"
FLAGS = ("-O2", "-std=c++17", "-fno-fast-math", "-ffp-contract=off")


def build(tmp_path_factory, source: str) -> Path:
    """The checker ``tests/cuda_host/<source>`` compiled into a fresh temporary folder (skips without a compiler)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp(Path(source).stem) / "check"
    cmd = [cxx, *FLAGS, str(SOURCES / source), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return exe


def run(exe: Path, step: int) -> int:
    """Run a checker with sampling step ``step``; asserts its last line reads ``checked <n> mismatches 0`` and its
    exit status 0, and returns n."""
    proc = subprocess.run([str(exe), str(step)], capture_output=True, text=True, timeout=900)
    last = proc.stdout.splitlines()[-1] if proc.stdout else ""
    fields = last.split()
    assert len(fields) == 4 and fields[0] == "checked" and fields[2:] == ["mismatches", "0"], proc.stdout[-2000:]
    assert proc.returncode == 0
    return int(fields[1])
