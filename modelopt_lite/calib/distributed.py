"""Cross-rank reduction of calibration statistics (``torch.distributed``; gloo on CPU, NCCL on GPUs).

Each calibrator reduces *copies* of its statistics inside ``compute_amax``, so calling it twice never double
counts, and every rank ends with exactly what one process that saw all ranks' data would have:

- max: ``all_reduce(MAX)`` of the running max;
- histogram: ``all_reduce(MAX)`` of the grid exponent (the power-of-two bin width, see ``grid.py``), every rank
  re-bins its counts to it (an exact integer merge), then ``all_reduce(SUM)`` of the int64 counts.

Ranks that collected nothing take part with neutral values (zeros; the smallest exponent). The layout
(shape, number of bins) is first exchanged with ``all_gather_object`` so that a mismatch raises the same
ValueError on every rank instead of hanging in a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .grid import E_MIN, regrid


def is_active(group=None) -> bool:
    """True when ``torch.distributed`` is initialized and ``group`` has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_true(flag: bool, group=None) -> bool:
    """``flag`` on every rank (True only if it is True on all of them); ``flag`` itself without torch.distributed.
    Every rank must call it at the same point (a collective)."""
    if not is_active(group):
        return flag
    t = _all_reduce(torch.tensor([0.0 if flag else 1.0]), dist.ReduceOp.SUM, group)
    return float(t.item()) == 0.0


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(meta, group, label: str):
    """Gather every rank's layout; return the common one (None if no rank has data)."""
    metas = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, meta, group=group)
    present = [m for m in metas if m is not None]
    if not present:
        return None
    if any(m != present[0] for m in present):
        raise ValueError(f"{label}: ranks collected statistics of different layouts: {metas}")
    return present[0]


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    dev = _comm_device(group)
    buf = t.to(dev, copy=True)
    dist.all_reduce(buf, op=op, group=group)
    return buf


def reduce_max(amax: torch.Tensor | None, group, label: str) -> torch.Tensor | None:
    """Elementwise max of ``amax`` over the ranks of ``group`` (None where no rank has data)."""
    meta = None if amax is None else tuple(amax.shape)
    shape = _agree(meta, group, label)
    if shape is None:
        return None
    local = amax if amax is not None else torch.zeros(shape, dtype=torch.float32, device=_comm_device(group))
    out = _all_reduce(local, dist.ReduceOp.MAX, group)
    return out.to(local.device)


def merge_histograms(counts: torch.Tensor | None, exp: torch.Tensor | None, layout, group, label: str):
    """Sum the ranks' histograms on their common grid: ``(counts, exp, layout)``, or None when no rank has data.

    ``layout`` is any comparable description of the histogram (number of rows, bins, amax shape); it must be equal
    on every rank that has data.
    """
    layout = _agree(None if counts is None else layout, group, label)
    if layout is None:
        return None
    if counts is not None and exp is None:
        raise ValueError(f"{label}: merge_histograms got counts without their bin exponents")
    if counts is None or exp is None:
        dev = _comm_device(group)
        rows, cap = layout[0], layout[1]
        counts = torch.zeros(rows, cap, dtype=torch.int64, device=dev)
        exp = torch.full((rows,), E_MIN, dtype=torch.int64, device=dev)
    top = _all_reduce(exp, dist.ReduceOp.MAX, group).to(exp.device)
    merged = regrid(counts, exp, top)
    total = _all_reduce(merged, dist.ReduceOp.SUM, group).to(counts.device)
    return total, top, layout
