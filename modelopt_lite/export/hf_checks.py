"""The errors of :func:`~.hf_load.load_hf_checkpoint`: one message shape for every bad entry of a checkpoint."""

from __future__ import annotations

import torch


def bad(path, entry: str, why: str) -> ValueError:
    """``load_hf_checkpoint: <file>: <entry>: <why>``."""
    return ValueError(f"load_hf_checkpoint: {path}: {entry}: {why}")


def want(path, key: str, t: torch.Tensor | None, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """``t``, checked to exist with exactly ``dtype`` and ``shape``."""
    if t is None:
        raise bad(path, key, "is missing")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise bad(path, key, f"is {t.dtype} {tuple(t.shape)}, expected {dtype} {tuple(shape)}")
    return t
