"""Helpers shared by the demos: the per-user cache folder, ONNX Runtime sessions, timing and agreement metrics."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def quiet():
    """Silence a noisy third-party call (the ONNX exporter): Python warnings and everything written to the process's
    stdout/stderr file descriptors (C++ warnings included) are dropped for the block; restored on exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = []
    with tempfile.TemporaryFile() as sink, open(os.devnull, "w") as devnull, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for fd in (1, 2):
                try:
                    saved.append((fd, os.dup(fd)))
                    os.dup2(sink.fileno(), fd)
                except OSError:  # no such descriptor (embedded interpreters): nothing to silence there
                    pass
            with contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
                yield
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)


def cache_dir() -> Path:
    """The per-user cache folder (``$XDG_CACHE_HOME/modelopt_lite`` or ``~/.cache/modelopt_lite``); not created."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "modelopt_lite"


def ort_session(path, threads: int | None = None):
    """A CPU ONNX Runtime session that runs ``path`` exactly as written (the export layer's
    :func:`modelopt_lite.onnx_export.ort_runner.ort_session`: it turns off the ORT rewrites that break FP8 graphs or
    saturate on signed INT8 weights)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the demo runs the exports in ONNX Runtime: pip install onnxruntime") from e
    from ..onnx_export.ort_runner import ort_session as _session

    return _session(str(path), threads=threads)


def ort_run(sess, feeds: dict) -> np.ndarray:
    """The first output of ``sess`` for ``feeds`` (name -> numpy array)."""
    return sess.run(None, feeds)[0]


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_abs_diff(a, b) -> float:
    """``max |a - b|`` over all elements as a Python float (numpy or torch inputs)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"max_abs_diff: shapes differ, {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def argmax_agreement(a, b) -> float:
    """Percentage of rows whose argmax over the last axis is the same in ``a`` and ``b``."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"argmax_agreement: shapes differ, {a.shape} vs {b.shape}")
    return 100.0 * float(np.mean(a.argmax(-1) == b.argmax(-1)))


def file_size(path) -> int:
    """Size of a file in bytes (the ONNX model plus any external-data file next to it named ``<name>.data``)."""
    p = Path(path)
    total = p.stat().st_size
    for extra in (p.with_name(p.name + ".data"), p.with_suffix(".data")):
        if extra.exists():
            total += extra.stat().st_size
            break
    return total
