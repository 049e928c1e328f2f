"""Prebuilt native kernels: the modules ``setup.py`` compiles ahead of time (``MODELOPT_LITE_BUILD_EXT=1``).

A prebuilt module ``modelopt_lite/_native_<kind>`` (``native_build.PREBUILT``) sits in the package beside its build
record ``_native_<kind>.json``, written by the same build (``native_build.prebuilt_info``): the torch and Python
versions, the digest of the sources and flags and, for CUDA, the CUDA version and the GPU codes compiled. The
record is read BEFORE the library is loaded, so a module built for another torch is never loaded. Any mismatch, a
missing record or a library that fails to import is logged with its reason and the kernels are JIT-built instead
(``native_build.load``), exactly as without a prebuilt module.

``MODELOPT_LITE_NATIVE`` (read, never written): ``auto`` (default) uses a compatible prebuilt module, else JIT;
``jit`` ignores prebuilt modules; ``prebuilt`` never JIT-builds (a deployment image without a compiler): it fails
with the reason when there is no compatible prebuilt module.
"""

from __future__ import annotations

import importlib.machinery
import json
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from . import native_build

MODES = ("auto", "jit", "prebuilt")
PACKAGE_DIR = Path(__file__).resolve().parent.parent
log = logging.getLogger(__name__)


def mode() -> str:
    """``MODELOPT_LITE_NATIVE``: ``auto`` (default), ``jit`` or ``prebuilt``."""
    value = os.environ.get("MODELOPT_LITE_NATIVE", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"MODELOPT_LITE_NATIVE must be one of {MODES}, got {value!r}")
    return value


def library_path(kind: str, package_dir: Path | None = None) -> Path | None:
    """The prebuilt library of ``kind`` that this interpreter can load (its extension suffixes), or None."""
    stem = native_build.PREBUILT[kind]
    folder = PACKAGE_DIR if package_dir is None else package_dir
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / (stem + suffix)
        if path.is_file():
            return path
    return None


def arch_supported(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether code compiled for ``archs`` (``sm_90``, ``sm_90a``, ``compute_80``) runs on a GPU of compute
    ``capability``: a cubin of the same major version and a minor version not above it (an ``a`` cubin only on its
    own GPU), or PTX of a version not above it."""
    major, minor = capability
    cc = 10 * major + minor
    for arch in archs:
        kind, _, code = arch.partition("_")
        specific = code.endswith("a")
        digits = code.rstrip("af")
        if not digits.isdigit():
            continue
        n = int(digits)
        if kind == "sm" and (n == cc or (not specific and n // 10 == major and n <= cc)):
            return True
        if kind == "compute" and not specific and n <= cc:
            return True
    return False


def incompatibility(kind: str, record: dict[str, Any]) -> str | None:
    """Why a prebuilt ``kind`` module with build record ``record`` must not be used in this process (None: usable)."""
    here = native_build.prebuilt_info(kind)
    for key, what in (
        ("module", "module"),
        ("torch", "torch"),
        ("python", "Python"),
        ("cuda", "CUDA"),
        ("digest", "kernel sources digest"),
    ):
        if record.get(key) != here[key]:
            return f"built for {what} {record.get(key)!r}, this installation has {here[key]!r}"
    if kind == "cuda":
        import torch

        archs = record.get("archs") or []
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            if not arch_supported(list(archs), cap):
                return f"compiled for GPU codes {archs}, GPU {i} is sm_{cap[0]}{cap[1]}"
    return None


def find(kind: str, package_dir: Path | None = None) -> tuple[ModuleType | None, str]:
    """``(module, "")`` for a compatible prebuilt ``kind`` module, else ``(None, why not)``."""
    lib = library_path(kind, package_dir)
    if lib is None:
        return None, "no prebuilt module in the package"
    record_path = lib.with_name(native_build.PREBUILT[kind] + ".json")
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"{lib.name} has no build record {record_path.name}"
    except (OSError, ValueError) as e:
        return None, f"unreadable build record {record_path}: {e}"
    if not isinstance(record, dict):
        return None, f"build record {record_path} is not a JSON object"
    try:
        why = incompatibility(kind, record)
    except (OSError, RuntimeError) as e:  # sources missing, CUDA driver trouble
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        return None, f"{lib.name}: {why}"
    try:
        mod = native_build.import_extension(f"modelopt_lite.{native_build.PREBUILT[kind]}", lib)
    except (ImportError, OSError) as e:
        return None, f"{lib.name} failed to import: {e}"
    return mod, ""


def load(kind: str) -> ModuleType:
    """The native ``kind`` kernels: the compatible prebuilt module, else a JIT build (``MODELOPT_LITE_NATIVE``)."""
    how = mode()
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
    if how != "jit":
        mod, why = find(kind)
        if mod is not None:
            log.info("modelopt_lite: native %s kernels: prebuilt %s", kind, getattr(mod, "__file__", mod.__name__))
            return mod
        if how == "prebuilt":
            raise RuntimeError(f"MODELOPT_LITE_NATIVE=prebuilt but no compatible prebuilt {kind} kernels: {why}")
        level = logging.DEBUG if why == "no prebuilt module in the package" else logging.WARNING
        log.log(
            level, "modelopt_lite: not using prebuilt native %s kernels (%s); building them just in time", kind, why
        )
    return native_build.load(kind)
