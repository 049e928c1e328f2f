"""The CUDA kernels of E5M2/E2M1, NVFP4 and OCP MX (modelopt_lite/csrc/mx_kernels.cu), run on the CPU, bit for bit
against the pure-torch reference (:mod:`modelopt_lite.functional.microscaling`).

``tests/cuda_host/mx_host_harness.cpp`` includes mx_kernels.cu built with ``MODELOPT_LITE_EMULATE_ON_HOST``: the
launchers then execute the exact kernel bodies (16-byte vector path and element path, partial blocks, dtype
conversions) in a host loop. The device intrinsics themselves (``__fdiv_rn`` etc.) are not exercised here.
Skipped when nvcc is absent.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from test_native_mx import blocked_data, same, special_values

from modelopt_lite.functional import microscaling as MS

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "modelopt_lite" / "csrc"
SOURCES = [HERE / "cuda_host" / "mx_host_harness.cpp"] + [
    CSRC / n for n in ("mx_kernels.cu", "mx_lanes.cuh", "mx_kernels_api.h", "mx_elem.h", "quant_kernels_api.h")
]
DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
VIEW = {
    torch.float32: (torch.int32, np.int32),
    torch.float16: (torch.int16, np.int16),
    torch.bfloat16: (torch.int16, np.int16),
}
ELEMS = ("e4m3", "e5m2", "e2m1", "int8")


class Harness:
    def __init__(self, exe: Path, work: Path):
        self.exe, self.work, self.n = exe, work, 0

    def path(self) -> str:
        self.n += 1
        return str(self.work / f"a{self.n}.bin")

    def put(self, t: torch.Tensor) -> str:
        p = self.path()
        t = t.contiguous()
        t.view(VIEW[t.dtype][0]).numpy().tofile(p) if t.dtype in VIEW else t.numpy().tofile(p)
        return p

    def get(self, p: str, dtype, shape) -> torch.Tensor:
        if dtype in VIEW:
            return torch.from_numpy(np.fromfile(p, dtype=VIEW[dtype][1]).copy()).view(dtype).reshape(shape)
        return torch.from_numpy(np.fromfile(p, dtype=np.float32).copy()).reshape(shape)

    def run(self, line: str) -> tuple[int, int]:
        proc = subprocess.run(
            [str(self.exe)], input=line + "\n", capture_output=True, text=True, timeout=120, check=True
        )
        word, status, bad = proc.stdout.split()
        assert word == "ok"
        return int(status), int(bad)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: the CUDA host harness needs it")
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    exe = Path(tempfile.gettempdir()) / f"modelopt_lite_mx_host_harness_{os.getuid()}_{digest}"
    if not exe.exists():
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run(
            [nvcc, "-std=c++17", "-O2", str(SOURCES[0]), "-o", str(tmp)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        assert "warning" not in proc.stderr.lower(), proc.stderr
        os.replace(tmp, exe)
    return Harness(exe, tmp_path_factory.mktemp("mx_host"))


def nvfp4(h, x, gs, block, misalign=0):
    rows, cols = x.reshape(-1, x.shape[-1]).shape
    xf, yf, sf = h.put(x), h.path(), h.path()
    st, bad = h.run(f"nvfp4 {DT[x.dtype]} {rows} {cols} {block} {float(gs)!r} {misalign} {xf} {yf} {sf}")
    assert st == 0
    nb = -(-cols // block)
    return h.get(yf, x.dtype, x.shape), h.get(sf, torch.float32, (*x.shape[:-1], nb)), bad


def mx(h, x, elem, rounding, misalign=0):
    rows, cols = x.reshape(-1, x.shape[-1]).shape
    xf, yf, ef = h.put(x), h.path(), h.path()
    line = f"mx {DT[x.dtype]} {ELEMS.index(elem)} {int(rounding == 'rceil')} {rows} {cols} {misalign} {xf} {yf} {ef}"
    st, bad = h.run(line)
    assert st == 0
    return h.get(yf, x.dtype, x.shape), h.get(ef, torch.float32, (*x.shape[:-1], -(-cols // 32))), bad


@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("cols", (5, 64, 16 * 7 + 9))
def test_cuda_nvfp4_bodies_exact(harness, dtype, cols):
    x = blocked_data(dtype, cols, seed=cols)
    amax = x.float().abs().amax()
    for block in (16, 32):
        for gs in (MS.nvfp4_global_scale(amax), MS.nvfp4_global_scale(amax / 1000), torch.tensor(0.0)):
            for mis in (0, 4):  # aligned (16-byte vectors where the row allows) and misaligned (element path)
                y, s, bad = nvfp4(harness, x, gs, block, mis)
                what = f"{dtype} cols {cols} block {block} gs {gs.item()} misalign {mis}"
                same(y, MS.fake_nvfp4(x, gs, block), what)
                same(s, MS.nvfp4_block_scales(x, gs, block), what + " scales")
                assert bad == 0


@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("elem", ELEMS)
def test_cuda_mx_bodies_exact(harness, dtype, elem):
    for cols in (7, 96, 32 * 3 + 17):
        x = blocked_data(dtype, cols, seed=cols + 1)
        for rounding in ("floor", "rceil"):
            for mis in (0, 4):
                y, k, bad = mx(harness, x, elem, rounding, mis)
                what = f"{elem} {rounding} {dtype} cols {cols} misalign {mis}"
                same(y, MS.fake_mx(x, elem, 32, rounding), what)
                same(k, MS.mx_scale_exponents(x, elem, 32, rounding).float(), what + " exponents")
                assert bad == 0


def test_cuda_nonfinite_is_flagged(harness):
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    assert nvfp4(harness, x, torch.tensor(0.01), 16)[2] == 1
    assert mx(harness, x, "e4m3", "floor")[2] == 1
    x[1, 40] = -float("inf")
    assert mx(harness, x, "int8", "rceil")[2] == 1


@pytest.mark.parametrize("dtype", list(DT))
def test_cuda_minifloat_bodies_exact(harness, dtype):
    x = special_values().to(dtype)
    n = x.numel() - x.numel() % 8
    x = x[:n]
    s = (torch.rand(8, generator=torch.Generator().manual_seed(3)) + 0.05).float()
    s[2] = 0.0
    for ename, elem, rnd in (("e5m2", 1, MS.e5m2_round), ("e2m1", 2, MS.e2m1_round)):
        # inner a multiple of the 16-byte vector (4 or 8 elements) or not: one scale per vector, or one per element
        for channels, inner in ((1, 1), (8, n // 8), (4, 1), (8, 8), (3, 4), (5, 3)):
            sc = s[:channels]
            xf, sf, yf = harness.put(x), harness.put(sc), harness.path()
            st, _ = harness.run(f"mini {DT[dtype]} {elem} {n} {channels} {inner} {xf} {sf} {yf}")
            assert st == 0
            se = sc[(torch.arange(n) // inner) % channels]
            ref = torch.where(se == 0, 0.0, rnd(x.float() / torch.where(se == 0, 1.0, se)) * se).to(dtype)
            same(harness.get(yf, dtype, (n,)), ref, f"{ename} {dtype} channels {channels}")


def test_cuda_launchers_reject_bad_arguments(harness):
    x = torch.randn(2, 32)
    xf = harness.put(x)
    assert harness.run(f"nvfp4 0 2 32 8 0.1 0 {xf} {harness.path()} {harness.path()}")[0] != 0  # block 8
    # gs < 0: the kernel reads the global scale from device memory and flags it (bit 2), the binding raises
    assert harness.run(f"nvfp4 0 2 32 16 -1.0 0 {xf} {harness.path()} {harness.path()}") == (0, 2)
    assert harness.run(f"mx 0 4 0 2 32 0 {xf} {harness.path()} {harness.path()}")[0] != 0  # elem 4
