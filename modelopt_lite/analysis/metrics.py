"""Error metrics between a tensor and its quantized version, and the memory footprint of a model.

All metrics are computed in float64 and returned as Python floats, so they can be compared to hand computations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

_MB = 1024.0 * 1024.0


def _as_float64(t, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    return t.detach().to(torch.float64)


def calculate_quantization_error(x: torch.Tensor, xq: torch.Tensor) -> dict:
    """Error of ``xq`` (a dequantized/fake-quantized tensor) against the original ``x``.

    Returns a dict of floats:

    - ``mse``: mean of ``(x - xq)**2``; ``mae``: mean of ``|x - xq|``; ``max_abs_error``: max of ``|x - xq|``.
    - ``sqnr_db``: ``10 * log10(sum(x**2) / sum((x - xq)**2))`` (``inf`` when the error is zero, ``-inf`` when
      x is all zeros but the error is not).
    - ``cosine_similarity``: ``<x, xq> / (|x| |xq|)`` over the flattened tensors (1.0 when both are all zeros,
      0.0 when exactly one of them is).
    - ``numel``: number of elements compared.

    Raises:
        TypeError: non-tensor arguments. ValueError: shapes differ, empty tensors, or NaN/Inf values.
    """
    a, b = _as_float64(x, "x"), _as_float64(xq, "xq")
    if a.shape != b.shape:
        raise ValueError(f"x and xq must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        raise ValueError("calculate_quantization_error needs non-empty tensors")
    for name, t in (("x", a), ("xq", b)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or Inf; metrics would be meaningless")
    a, b = a.flatten(), b.flatten()
    err = a - b
    sig, noise = float((a * a).sum()), float((err * err).sum())
    if noise == 0.0:
        sqnr = math.inf
    elif sig == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(sig / noise)
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 and nb == 0.0:
        cos = 1.0
    elif na == 0.0 or nb == 0.0:
        cos = 0.0
    else:
        cos = float((a @ b) / (na * nb))
    return {
        "mse": float((err * err).mean()),
        "mae": float(err.abs().mean()),
        "max_abs_error": float(err.abs().max()),
        "sqnr_db": sqnr,
        "cosine_similarity": cos,
        "numel": a.numel(),
    }


def _unique_tensors(model: nn.Module):
    seen: set = set()
    for kind, it in (
        ("param", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, t in it:
            if t is None:
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape)) if t.numel() else id(t)
            if key in seen:
                continue
            seen.add(key)
            yield kind, name, t


def calculate_model_size(model: nn.Module) -> dict:
    """Memory footprint of a model's parameters and buffers (shared tensors counted once).

    Each tensor counts ``numel * element_size`` bytes, so real-INT8 models count their int8 weight codes at one
    byte each and packed INT4 weights (two codes per uint8 byte) at half a byte per weight.

    Returns a dict: ``num_params`` / ``num_buffers`` (elements), ``param_bytes``, ``buffer_bytes``,
    ``total_bytes``, ``param_mb``, ``buffer_mb``, ``total_mb`` (MiB, 2**20 bytes) and ``bytes_by_dtype``
    (``{"torch.int8": n, ...}``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"calculate_model_size expects an nn.Module, got {type(model).__name__}")
    out: dict[str, Any] = {"num_params": 0, "num_buffers": 0, "param_bytes": 0, "buffer_bytes": 0}
    by_dtype: dict[str, int] = {}
    for kind, _, t in _unique_tensors(model):
        nbytes = t.numel() * t.element_size()
        out[f"num_{kind}s"] += t.numel()
        out[f"{kind}_bytes"] += nbytes
        by_dtype[str(t.dtype)] = by_dtype.get(str(t.dtype), 0) + nbytes
    out["total_bytes"] = out["param_bytes"] + out["buffer_bytes"]
    for k in ("param", "buffer", "total"):
        out[f"{k}_mb"] = out[f"{k}_bytes"] / _MB
    out["bytes_by_dtype"] = by_dtype
    return out


def state_dict_bytes(state_dict: dict) -> int:
    """Bytes of the tensors in a state dict (``numel * element_size``, non-tensor entries ignored)."""
    return sum(t.numel() * t.element_size() for t in state_dict.values() if isinstance(t, torch.Tensor))
