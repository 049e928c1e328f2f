"""The CUDA binding (modelopt_lite/csrc/quant_cuda_binding.cpp) built for the CPU, against the reference.

With ``MODELOPT_LITE_EMULATE_ON_HOST`` the binding takes CPU tensors and the launchers of quant_kernels.cu run
the kernel bodies on the host, so its validation, broadcast description, dtype handling and dispatch run here
exactly as on a GPU, over the whole matrix of tests/gpu/cuda_cases.py. The build (torch/extension.h, ~1 min on
2 cores) is opt-in: set ``MODELOPT_LITE_TEST_EMULATED=1``. Needs the CUDA headers (cuda_fp8.h), not a GPU.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "modelopt_lite" / "csrc"
SOURCES = [CSRC / "quant_cuda_binding.cpp", HERE / "cuda_host" / "emulated_kernels.cpp"]
DEPS = SOURCES + [
    CSRC / n
    for n in ("quant_kernels.cu", "quant_kernels.cuh", "quant_index.cuh", "quant_math.cuh", "quant_kernels_api.h")
]

pytestmark = pytest.mark.skipif(
    os.environ.get("MODELOPT_LITE_TEST_EMULATED") != "1",
    reason="opt-in (about 1 min to build): set MODELOPT_LITE_TEST_EMULATED=1",
)


def _cuda_include():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", "/opt/cuda"):
        if root and (Path(root) / "include" / "cuda_fp8.h").exists():
            return Path(root) / "include"
    return None


def _load_cases():
    spec = importlib.util.spec_from_file_location("cuda_cases", HERE / "gpu" / "cuda_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def emulated():
    inc = _cuda_include()
    if inc is None:
        pytest.skip("CUDA headers (cuda_fp8.h) not found")
    from torch.utils import cpp_extension

    from modelopt_lite.functional.native_build import cache_root

    digest = hashlib.sha1(b"".join(p.read_bytes() for p in DEPS)).hexdigest()[:12]
    name = f"modelopt_lite_cuda_emulated_{digest}"
    build = cache_root() / f"torch{torch.__version__.replace('+', '_')}" / name
    build.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=name,
        sources=[str(s) for s in SOURCES],
        build_directory=str(build),
        extra_cflags=["-O2", "-std=c++17", "-DMODELOPT_LITE_EMULATE_ON_HOST", f"-I{inc}"],
        verbose=False,
    )


cases = _load_cases()
GROUPS = {
    "int": cases.int_checks,
    "e4m3": cases.e4m3_checks,
    "affine": cases.affine_checks,
    "edge": cases.edge_checks,
    "binding": cases.binding_checks,
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_matrix_equals_reference(emulated, group):
    failures = []
    for check in GROUPS[group]():
        try:
            cases.run_check(emulated, "cpu", check)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_errors(emulated):
    for call, exc, msg in cases.error_cases("cpu"):
        with pytest.raises(exc, match=msg):
            call(emulated)


def test_histograms_equal_calibrator_grid(emulated):
    grid = pytest.importorskip("modelopt_lite.calib.grid")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 3001, generator=g).abs() * torch.tensor([[1.0], [1e-20], [1e20], [0.0], [7.0]])
    for cap in (2, 2048, 3000):
        exps = grid.needed_exp(a.amax(dim=1), cap)
        assert torch.equal(emulated.histogram_rows(a, exps, cap), grid.histogram_rows(a, exps, cap))
        h = a[[0, 3, 4]].half()
        he = grid.needed_exp(h.float().amax(dim=1), cap)
        assert torch.equal(emulated.histogram_rows(h, he, cap), grid.histogram_rows(h.float(), he, cap))
        m = float(a[0].max())
        want = grid.histogram_rows(a[:1], grid.needed_exp(torch.tensor([m]), cap), cap)[0]
        assert torch.equal(emulated.histogram(a[0], cap, m), want)
