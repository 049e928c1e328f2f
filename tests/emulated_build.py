"""The CUDA bindings built for the CPU (``MODELOPT_LITE_EMULATE_ON_HOST``): shared by the tests that run them.

The bindings take CPU tensors and the launchers of the .cu files run the kernel bodies on the host. Building takes
about a minute (torch/extension.h), so those tests are opt-in: ``MODELOPT_LITE_TEST_EMULATED=1``. Needs the CUDA
headers (cuda_fp8.h), not a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
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
    CSRC / "block_cuda_binding.cpp",
    HERE / "cuda_host" / "emulated_block_kernels.cpp",
]
DEPS = (
    SOURCES
    + [
        CSRC / n
        for n in ("quant_kernels.cu", "quant_kernels.cuh", "quant_index.cuh", "quant_math.cuh", "quant_kernels_api.h")
    ]
    + [
        CSRC / n
        for n in (
            "mx_kernels.cu",
            "mx_lanes.cuh",
            "block_kernels.cu",
            "mx_kernels_api.h",
            "mx_elem.h",
            "mx_checks.h",
            "binding_errors.h",
            "launch_scope.h",
            "check_msg.h",
        )
    ]
)

#: the opt-in switch of the tests that build the emulated bindings
OPT_IN = pytest.mark.skipif(
    os.environ.get("MODELOPT_LITE_TEST_EMULATED") != "1",
    reason="opt-in (about 1 min to build): set MODELOPT_LITE_TEST_EMULATED=1",
)

_built: dict[str, object] = {}


def cuda_include():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", "/opt/cuda"):
        if root and (Path(root) / "include" / "cuda_fp8.h").exists():
            return Path(root) / "include"
    return None


def build():
    """The emulated extension module (built once per process; cached on disk by a digest of its sources); skips
    the calling test without the CUDA headers."""
    inc = cuda_include()
    if inc is None:
        pytest.skip("CUDA headers (cuda_fp8.h) not found")
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in DEPS)).hexdigest()[:12]
    if digest in _built:
        return _built[digest]
    from torch.utils import cpp_extension

    from modelopt_lite.functional.native_build import cache_root

    name = f"modelopt_lite_cuda_emulated_{digest}"
    out = cache_root() / f"torch{torch.__version__.replace('+', '_')}" / name
    out.mkdir(parents=True, exist_ok=True)
    mod = _built[digest] = cpp_extension.load(
        name=name,
        sources=[str(s) for s in SOURCES],
        build_directory=str(out),
        extra_cflags=["-O2", "-std=c++17", "-DMODELOPT_LITE_EMULATE_ON_HOST", f"-I{inc}"],
        verbose=False,
    )
    return mod


@contextlib.contextmanager
def cuda_path_on_host(emulated) -> Iterator[None]:
    """CPU tensors take the CUDA path inside the block: the emulated kernels, their routing (``kernels_for``,
    ``is_native_cuda``, the fused block kernel), deferred value checks and scalars filled as on a GPU; everything
    is restored on exit. Used by tests/test_deferred_cuda_emulated.py and bench/bench_call_overhead.py."""
    from modelopt_lite.functional import (
        amax_scale,
        backend,
        deferred_errors,
        division,
        library,
        library_block,
        library_block_cuda,
        library_minifloat,
        library_mx,
    )

    patches = [(m, "kernels_for", lambda device_type: emulated) for m in (library, library_mx, library_minifloat)]
    patches += [(m, "kernels_for", lambda device_type: emulated) for m in (library_block_cuda, library_block)]
    patches += [(amax_scale, "kernels_for", lambda device_type: emulated)]
    native = lambda m: m is emulated  # noqa: E731
    patches += [(m, "is_native_cuda", native) for m in (library, library_mx, library_minifloat, library_block_cuda)]
    patches += [(amax_scale, "is_native_cuda", native), (backend, "is_native_cuda", native)]
    patches += [
        (library_block_cuda, "FUSED_DEVICE_TYPES", ("cuda", "cpu")),
        (deferred_errors, "DEFER_DEVICE_TYPES", ("cpu",)),
        (division, "FILL_DEVICE_TYPES", ("cuda", "cpu")),  # scalars filled as on a GPU
    ]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    try:
        for m, name, value in patches:
            setattr(m, name, value)
        yield
    finally:
        for m, name, value in reversed(saved):
            setattr(m, name, value)
