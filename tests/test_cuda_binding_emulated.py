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
SOURCES = [
    CSRC / "quant_cuda_binding.cpp",
    HERE / "cuda_host" / "emulated_kernels.cpp",
    CSRC / "mx_cuda_binding.cpp",
    HERE / "cuda_host" / "emulated_mx_kernels.cpp",
]
DEPS = (
    SOURCES
    + [
        CSRC / n
        for n in ("quant_kernels.cu", "quant_kernels.cuh", "quant_index.cuh", "quant_math.cuh", "quant_kernels_api.h")
    ]
    + [CSRC / n for n in ("mx_kernels.cu", "mx_kernels_api.h", "mx_elem.h", "mx_checks.h")]
)

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


def test_microscaling_ops_equal_reference(emulated):
    """fake_nvfp4 / fake_mx / fake_e5m2 / fake_e2m1 of mx_cuda_binding.cpp (bodies: tests/test_native_mx_cuda_host.py)."""
    from modelopt_lite.functional import microscaling as ms

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 83, generator=g) * 2.0 ** torch.randint(-12, 8, (6, 1), generator=g)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xd = x.to(dtype)
        gs = ms.nvfp4_global_scale(xd.float().abs().amax())
        for block in (16, 32):
            assert torch.equal(emulated.fake_nvfp4(xd, gs, block), ms.fake_nvfp4(xd, gs, block))
        for elem in ("e4m3", "e5m2", "e2m1", "int8"):
            for rounding in ("floor", "rceil"):
                assert torch.equal(emulated.fake_mx(xd, elem, 32, rounding), ms.fake_mx(xd, elem, 32, rounding))
        s = torch.rand(6, 1, generator=g) + 0.1
        assert torch.equal(emulated.fake_e5m2(xd, s), (ms.e5m2_round(xd.float() / s) * s).to(dtype))
        assert torch.equal(emulated.fake_e2m1(xd, s), (ms.e2m1_round(xd.float() / s) * s).to(dtype))
    bad = x.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NVFP4 input contains NaN or Inf"):
        emulated.fake_nvfp4(bad, torch.tensor(0.01), 16)
    with pytest.raises(ValueError, match="MX block size must be one of"):
        emulated.fake_mx(x, "e4m3", 16, "floor")
