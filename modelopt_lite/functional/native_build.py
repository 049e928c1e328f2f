"""JIT build of the native kernels in ``modelopt_lite/csrc`` with ``torch.utils.cpp_extension.load``.

Builds go to a per-user cache (``$MODELOPT_LITE_CACHE``, else ``$XDG_CACHE_HOME/modelopt_lite`` or
``~/.cache/modelopt_lite``), in a folder keyed by the torch version, the Python version and a digest of the sources
and compiler flags. A finished build leaves a marker file; later processes import the cached library directly
(milliseconds, no compiler or ninja involved). The tables below (sources, flags, :data:`PREBUILT`) are also what
``setup.py`` compiles ahead of time (it loads this file by path: module-level imports stay stdlib-only), and
``native_prebuilt`` prefers such a prebuilt module when it is compatible.

Concurrency and killed builds: builders of one folder serialize on an OS file lock (``fcntl.flock``), which the
kernel releases when its holder dies, so a killed build never blocks the next process. Whoever holds that lock
knows that any ``lock`` file of torch's own ``FileBaton`` in the folder is stale (torch would otherwise wait on it
forever) and removes it. Where ``fcntl`` is missing (Windows), a baton older than ``_STALE_LOCK_S`` is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

CSRC = Path(__file__).resolve().parent.parent / "csrc"
_STALE_LOCK_S = 300.0  # a CPU build takes ~1 min; used only where fcntl is unavailable
_LOCK_WAIT_S = 1200.0  # give up waiting for another process's build after this long
log = logging.getLogger(__name__)

SOURCES = {
    "cpu": [
        "quant_cpu.cpp",
        "quant_scalar.cpp",
        "quant_avx2.cpp",
        "quant_avx512.cpp",
        "mx_cpu.cpp",
        "mx_scalar.cpp",
        "mx_avx2.cpp",
        "output_pool.cpp",
    ],
    "cuda": [
        "quant_cuda_binding.cpp",
        "quant_kernels.cu",
        "mx_cuda_binding.cpp",
        "mx_kernels.cu",
        "block_cuda_binding.cpp",
        "block_kernels.cu",
        "real_cuda_binding.cpp",
        "real_kernels.cu",
    ],
}
# Headers the sources include: part of the digest (a header change must rebuild), not compiled on their own.
HEADERS = {
    "cpu": [
        "quant_kernels.h",
        "quant_elem.h",
        "quant_vec_dispatch.h",
        "mx_kernels.h",
        "mx_elem.h",
        "mx_checks.h",
        "check_msg.h",
        "output_pool.h",
    ],
    "cuda": [
        "quant_kernels.cuh",
        "quant_index.cuh",
        "quant_math.cuh",
        "quant_kernels_api.h",
        "mx_kernels_api.h",
        "mx_lanes.cuh",
        "mx_elem.h",
        "mx_checks.h",
        "binding_errors.h",
        "launch_scope.h",
        "check_msg.h",
        "real_kernels_api.h",
    ],
}
# Strict IEEE float math: no fast-math, no FMA contraction (results must be bit-exact with the reference).
CFLAGS = ["-O3", "-fopenmp", "-fno-fast-math", "-ffp-contract=off"]  # the C++ standard: torch's default
LDFLAGS = ["-fopenmp"]
CUDA_CFLAGS = ["-O3", "-lineinfo", "-std=c++17"]
# The ahead-of-time modules ``setup.py`` builds into the package (MODELOPT_LITE_BUILD_EXT=1), each with a JSON build
# record beside it (``<module>.json``, :func:`prebuilt_info`); ``native_prebuilt`` loads them.
PREBUILT = {"cpu": "_native_cpu", "cuda": "_native_cuda"}
# setup.py's build only: setuptools adds Python's own CFLAGS (``-g`` among them); without debug info the prebuilt
# module has the JIT build's size (~0.5 MB, not ~10 MB). Code generation is unchanged.
PREBUILT_CFLAGS = ["-g0"]
_MARKER = "modelopt_lite_build_ok"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cache_root() -> Path:
    """The per-user cache folder of native builds."""
    base = os.environ.get("MODELOPT_LITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "modelopt_lite"
    )
    return Path(base)


def local_deps(sources: list[Path]) -> list[Path]:
    """The sources plus every csrc header they include (transitively, ``#include "..."``), in a stable order."""
    seen: dict[Path, None] = {}
    todo = list(sources)
    while todo:
        f = todo.pop(0)
        if f in seen:
            continue
        seen[f] = None
        for inc in _INCLUDE.findall(f.read_text(encoding="utf-8", errors="replace")):
            dep = f.parent / inc
            if dep.exists() and dep not in seen:
                todo.append(dep)
    return list(seen)


def _digest(files: list[Path], flags: list[str]) -> str:
    h = hashlib.sha1()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:12]


def _sources(kind: str) -> list[Path]:
    """The compiled sources of ``kind`` plus every csrc header they include (the digest's input)."""
    sources = [CSRC / s for s in SOURCES[kind]]
    missing = [str(f) for f in sources if not f.exists()]
    if missing:
        raise FileNotFoundError(f"kernel sources missing: {missing}")
    return local_deps(sources)  # a header change must rebuild too


def source_digest(kind: str) -> str:
    """Digest of ``kind``'s sources, the headers they include and the compiler flags (no torch, no GPU involved):
    what a prebuilt module records, so that one built from other sources is never used."""
    return _digest(_sources(kind), CFLAGS + LDFLAGS + (CUDA_CFLAGS if kind == "cuda" else []))


def prebuilt_info(kind: str, archs: list[str] | None = None) -> dict[str, Any]:
    """The build record of a prebuilt ``kind`` module built here and now: ``setup.py`` writes it beside the module,
    ``native_prebuilt`` compares it with this process. ``archs``: the CUDA codes compiled (``sm_90``,
    ``compute_90``)."""
    import torch

    return {
        "module": PREBUILT[kind],
        "torch": str(torch.__version__),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "cuda": torch.version.cuda if kind == "cuda" else None,
        "digest": source_digest(kind),
        "archs": sorted(archs or []),
    }


def _clear_stale_baton(build_dir: Path, max_age_s: float | None) -> None:
    """Remove torch's ``lock`` baton: unconditionally (we hold the build lock) or when older than ``max_age_s``."""
    baton = build_dir / "lock"
    try:
        age = time.time() - baton.stat().st_mtime
    except FileNotFoundError:
        return
    if max_age_s is None or age > max_age_s:
        log.warning("modelopt_lite: removing a stale build lock %s (%.0f s old, left by a killed build)", baton, age)
        baton.unlink(missing_ok=True)


@contextlib.contextmanager
def _build_lock(build_dir: Path, timeout_s: float = _LOCK_WAIT_S):
    """Exclusive lock over a build folder, released by the OS if the holder dies."""
    try:
        import fcntl
    except ImportError:  # no flock: fall back to the age heuristic on torch's baton
        _clear_stale_baton(build_dir, _STALE_LOCK_S)
        yield
        return
    fd = os.open(build_dir / ".build.flock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has been building {build_dir} for over {timeout_s:.0f} s"
                    ) from None
                if not waited:
                    log.info("modelopt_lite: waiting for another process building %s", build_dir)
                    waited = True
                time.sleep(0.2)
        _clear_stale_baton(build_dir, None)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _import_built(name: str, build_dir: Path):
    """Import a finished build (marker present) directly; None when there is none."""
    marker = build_dir / _MARKER
    lib = build_dir / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"
    if not (marker.exists() and lib.exists() and marker.read_text().strip() == name):
        return None
    return import_extension(name, lib)


def import_extension(name: str, lib: Path):
    """Import the compiled module ``name`` (its init function: the last component of ``name``) from the file
    ``lib``; ImportError/OSError when it cannot be loaded."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(lib))
    spec = importlib.util.spec_from_file_location(name, str(lib), loader=loader)
    if spec is None:
        raise ImportError(f"cannot make an import spec for {lib}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _cuda_archs() -> list[str]:
    """What a CUDA build is compiled for (torch targets the visible GPUs, or TORCH_CUDA_ARCH_LIST): a cache key, so
    a build cached on one GPU model is never imported on another."""
    import torch

    caps = sorted({"sm_{}{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})
    return caps + ["arch_list=" + os.environ.get("TORCH_CUDA_ARCH_LIST", "")]


def build_dir_for(kind: str) -> tuple[str, Path]:
    """``(module name, build folder)`` of the native ``kind`` for this torch, Python and source version."""
    import torch

    files = _sources(kind)
    flags = CFLAGS + LDFLAGS + (CUDA_CFLAGS + _cuda_archs() if kind == "cuda" else [])
    name = f"modelopt_lite_{kind}_{_digest(files, flags)}"
    tag = f"torch{torch.__version__.replace('+', '_')}_py{sys.version_info.major}{sys.version_info.minor}"
    return name, cache_root() / tag / name


def load(kind: str):
    """Build (or load from the cache) and return the extension module for ``kind`` ("cpu" or "cuda")."""
    import torch

    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    name, build_dir = build_dir_for(kind)
    t0 = time.perf_counter()
    try:
        mod = _import_built(name, build_dir)
    except (ImportError, OSError) as e:  # a damaged library: rebuild it below
        log.warning("modelopt_lite: cached native %s kernels failed to import (%s); rebuilding", kind, e)
        mod = None
    if mod is not None:
        log.debug("modelopt_lite: native %s kernels loaded from %s", kind, build_dir)
        return mod
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {
        "name": name,
        "sources": [str(CSRC / s) for s in SOURCES[kind]],
        "build_directory": str(build_dir),
        "extra_cflags": list(CFLAGS),
        "extra_ldflags": list(LDFLAGS),
        "verbose": False,
    }
    if kind == "cuda":
        kwargs["extra_cuda_cflags"] = list(CUDA_CFLAGS)
    with _build_lock(build_dir):
        mod = _import_built(name, build_dir)  # another process may have finished it while we waited
        if mod is None:
            (build_dir / _MARKER).unlink(missing_ok=True)
            mod = cpp_extension.load(**kwargs)
            (build_dir / _MARKER).write_text(name)
    log.info("modelopt_lite: native %s kernels ready in %.1fs (%s)", kind, time.perf_counter() - t0, build_dir)
    return mod
