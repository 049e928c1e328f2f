"""Backend selection: which implementation runs the kernels of the ``modelopt_lite`` ops.

- ``"reference"``: the pure-torch definition in :mod:`modelopt_lite.functional.reference` (always there).
- ``"native"``: the C++ (OpenMP) kernels on CPU and the CUDA kernels on GPU: the modules ``setup.py`` prebuilt
  (``MODELOPT_LITE_BUILD_EXT=1``) when present and compatible, else JIT-built on first use
  (:mod:`~modelopt_lite.functional.native_prebuilt`).
- ``"auto"`` (default): native where it builds, else the reference with ONE warning naming the reason.

The environment variable ``MODELOPT_LITE_BACKEND`` (``reference|native|auto``) sets the initial choice; it is read,
never written. :func:`set_backend` and the :func:`use_backend` context manager change it at run time.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from types import ModuleType

from . import reference

_VALID = ("auto", "native", "reference")
_lock = threading.Lock()
_state: dict[str, str | None] = {"backend": None}
_loaded: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def _check(name: str) -> str:
    if name not in _VALID:
        raise ValueError(f"backend must be one of {_VALID}, got {name!r}")
    return name


def get_backend() -> str:
    """The backend in force: ``"auto"``, ``"native"`` or ``"reference"``."""
    current = _state["backend"]
    if current is None:
        env = os.environ.get("MODELOPT_LITE_BACKEND", "auto").strip().lower() or "auto"
        try:
            current = _state["backend"] = _check(env)
        except ValueError as e:
            raise ValueError(f"MODELOPT_LITE_BACKEND: {e}") from None
    return current


def set_backend(name: str) -> None:
    """Force a backend for this process: ``"auto"``, ``"native"`` or ``"reference"``."""
    _state["backend"] = _check(name)


@contextlib.contextmanager
def use_backend(name: str):
    """Run a block with a given backend, restoring the previous choice even on exceptions."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        _state["backend"] = previous


def _load(kind: str) -> ModuleType | None:
    """Build/load the native extension of ``kind`` ("cpu" or "cuda") once; None (with one warning) on failure."""
    with _lock:
        if kind in _loaded:
            return _loaded[kind]
        from . import native_prebuilt

        native_prebuilt.mode()  # a bad MODELOPT_LITE_NATIVE is the caller's mistake: raise it, do not fall back
        try:
            mod = native_prebuilt.load(kind)
        except Exception as e:  # noqa: BLE001 (a failed build must never break quantization: fall back, loudly, once)
            mod = None
            _errors[kind] = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"modelopt_lite: the native {kind.upper()} kernels could not be built or loaded "
                f"({_errors[kind].splitlines()[0][:300]}); falling back to the pure-torch reference, which is "
                "several times slower. Set MODELOPT_LITE_BACKEND=reference to silence this.",
                RuntimeWarning,
                stacklevel=4,
            )
        _loaded[kind] = mod
        return mod


def native_error(kind: str) -> str | None:
    """Why the native ``kind`` backend failed to load, or None."""
    return _errors.get(kind)


def is_native_cuda(mod) -> bool:
    """Whether ``mod`` is the loaded CUDA extension (the ops check its arguments in Python before calling it)."""
    return mod is not None and mod is _loaded.get("cuda")


def kernels_for(device_type: str) -> ModuleType:
    """The module whose functions run the kernels for tensors on ``device_type``."""
    choice = get_backend()
    if choice == "reference":
        return reference
    kind = "cuda" if device_type == "cuda" else "cpu" if device_type == "cpu" else None
    mod = _load(kind) if kind is not None else None
    if mod is None:
        if choice == "native":
            reason = native_error(kind) if kind else f"no native kernels for device type {device_type!r}"
            raise RuntimeError(f"MODELOPT_LITE_BACKEND=native but the native {kind} kernels are unavailable: {reason}")
        return reference
    return mod


def precompile(kinds=("cpu", "cuda")) -> dict[str, str]:
    """Build the native kernels ahead of time; returns ``{kind: "ok" | reason}``."""
    import torch

    report = {}
    for kind in kinds:
        if kind == "cuda" and not torch.cuda.is_available():
            report[kind] = "skipped: CUDA is not available"
            continue
        report[kind] = "ok" if _load(kind) is not None else f"failed: {native_error(kind)}"
    return report
