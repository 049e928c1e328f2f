"""JIT build of the native kernels in ``modelopt_lite/csrc`` with ``torch.utils.cpp_extension.load``.

Builds go to a per-user cache (``$XDG_CACHE_HOME/modelopt_lite`` or ``~/.cache/modelopt_lite``), keyed by the
torch version, so a later process loads the cached library in milliseconds. A lock file left behind by a killed
build is removed before building (torch's own baton would otherwise wait on it forever).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
_STALE_LOCK_S = 600.0
log = logging.getLogger(__name__)

SOURCES = {
    "cpu": ["quant_cpu.cpp"],
    "cuda": ["quant_cuda_binding.cpp", "quant_kernels.cu"],
}


def cache_root() -> Path:
    base = os.environ.get("MODELOPT_LITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "modelopt_lite"
    )
    return Path(base)


def _sources_digest(files: list[Path]) -> str:
    h = hashlib.sha1()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def _clear_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        log.warning("modelopt_lite: removing a stale build lock %s (left by a killed build)", lock)
        lock.unlink(missing_ok=True)


def load(kind: str):
    """Build (or load from the cache) and return the extension module for ``kind`` ("cpu" or "cuda")."""
    import torch
    from torch.utils import cpp_extension

    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available")
    files = [CSRC / s for s in SOURCES[kind]]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"kernel sources missing: {missing}")
    name = f"modelopt_lite_{kind}_{_sources_digest(files)}"
    build_dir = cache_root() / f"torch{torch.__version__.replace('+', '_')}" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir)
    cflags = ["-O3", "-fopenmp", "-std=c++17"]
    kwargs = dict(
        name=name,
        sources=[str(f) for f in files],
        build_directory=str(build_dir),
        extra_cflags=cflags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    if kind == "cuda":
        kwargs["extra_cuda_cflags"] = ["-O3", "-lineinfo", "-std=c++17"]
    t0 = time.perf_counter()
    mod = cpp_extension.load(**kwargs)
    log.info("modelopt_lite: native %s kernels ready in %.1fs (%s)", kind, time.perf_counter() - t0, build_dir)
    return mod
