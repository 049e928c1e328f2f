"""The histogram grid: power-of-two bin widths, so histograms merge exactly whatever the batch split.

A histogram with ``cap`` bins and exponent ``e`` has bin width ``w = 2**e`` and counts value ``v >= 0`` in bin
``floor(v / w)``. ``e`` is the smallest integer (not below ``E_MIN``) with ``cap * 2**e > max``, so every value
fits and the top occupied bin is above ``cap / 2``. Dividing by a power of two is exact in floating point, so the
bin of a value does not depend on anything but ``e``; and a bin of width ``2**e`` lies inside exactly one bin of
width ``2**(e+k)`` (index ``j >> k``). Growing the range is therefore an exact integer merge, and the histogram
of any data, collected in any batches, on any number of ranks, is the same function of (data, final ``e``),
with the final ``e`` a function of the overall max only.
"""

from __future__ import annotations

import torch

#: Exponent of an all-zero (or empty) histogram: far below any amax that matters (cap * 2**E_MIN <= 2**-24).
E_MIN = -160


def pow2(exp: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """``2.0 ** exp`` (exact for integer exponents in the dtype's range)."""
    return torch.pow(torch.tensor(2.0, dtype=dtype, device=exp.device), exp.to(dtype))


def needed_exp(row_max: torch.Tensor, cap: int) -> torch.Tensor:
    """Smallest ``e >= E_MIN`` with ``cap * 2**e > row_max`` (int64, elementwise, exact)."""
    m = row_max.to(torch.float64)
    _, ex = torch.frexp(m)  # m < 2**ex
    c = int(cap).bit_length()  # 2**(c-1) <= cap < 2**c, so cap * 2**(ex - c + 1) > m always
    e = ex.to(torch.int64) - c
    fits = float(cap) * pow2(e) > m
    e = torch.where(fits, e, e + 1)
    e = torch.where(m > 0, e, torch.full_like(e, E_MIN))
    return torch.clamp(e, min=E_MIN)


def histogram_rows(a: torch.Tensor, exp: torch.Tensor, cap: int, *, inplace: bool = False) -> torch.Tensor:
    """int64 counts (rows, cap) of ``a`` (rows, values >= 0, each below ``cap * 2**exp`` of its row).

    The bin of ``v`` is ``floor(v * 2**-e)``: an exact power-of-two scaling (done in float64 when ``2**-e`` would
    overflow float32), truncated to an integer. ``inplace=True`` lets it reuse ``a`` as scratch memory.
    """
    rows = a.shape[0]
    ex = exp.to(torch.int64).reshape(-1, 1)
    if a.dtype != torch.float64 and bool((ex < -100).any()):
        a, inplace = a.double(), True
    scale = pow2(-ex, a.dtype)
    scaled = a.mul_(scale) if inplace else a * scale
    n = rows * cap
    idx = scaled.to(torch.int32 if n < 2**31 else torch.int64)  # truncation == floor for values >= 0
    if rows > 1:
        idx += torch.arange(rows, device=a.device, dtype=idx.dtype).reshape(-1, 1) * cap
    return torch.bincount(idx.reshape(-1), minlength=n).reshape(rows, cap)


def coarsen(counts: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Merge each row's bins by ``2**shift[row]`` (bin j -> j >> shift): an exact integer re-binning."""
    rows, cap = counts.shape
    k = torch.clamp(shift.to(torch.int64), 0, 62).reshape(-1, 1)
    j = torch.arange(cap, device=counts.device, dtype=torch.int64).reshape(1, -1)
    target = (j >> k) + torch.arange(rows, device=counts.device, dtype=torch.int64).reshape(-1, 1) * cap
    out = torch.zeros(rows * cap, dtype=counts.dtype, device=counts.device)
    out.index_add_(0, target.reshape(-1), counts.reshape(-1))
    return out.reshape(rows, cap)


def regrid(counts: torch.Tensor, exp: torch.Tensor, new_exp: torch.Tensor) -> torch.Tensor:
    """Counts re-binned from ``exp`` to ``new_exp >= exp`` (per row); returns ``counts`` itself when unchanged."""
    shift = new_exp - exp
    if not bool((shift > 0).any()):
        return counts
    return coarsen(counts, shift)


def widths(exp: torch.Tensor) -> torch.Tensor:
    """Bin widths ``2**exp`` as float64."""
    return pow2(exp)
