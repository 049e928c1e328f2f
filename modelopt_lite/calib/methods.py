"""Vectorized amax searches on histograms: percentile, mse and entropy (TensorRT-style KL divergence).

Every function takes ``counts`` (int64, shape (rows, cap): one histogram per row / channel) and ``exp`` (int64,
(rows,): row r has bin width ``2**exp[r]``, bin j covers ``[j w, (j+1) w)``) and returns float32 amax (rows,).
Rows holding no data, or only values below ``cap * 2**E_MIN`` (far below ``2**-24``), get amax 0.
``n`` below is a row's number of occupied bins (its last non-empty bin + 1).

- **percentile**: the left edge of the first bin where the cumulative count reaches ``percentile`` % of the
  total, i.e. of the bin holding the k-th smallest value, ``k = ceil(p N / 100)`` (the inverted-CDF quantile
  ``q``): ``amax <= q < amax + w``, exact for values on the grid (pytorch-quantization's convention).
- **mse**: candidates are the bin centers ``(k + 1/2) w`` for ``k in range(start_bin, n, stride)``. A candidate's
  score is the histogram's total squared fake-quantization error, each bin's values spread evenly over the bin,
  with the project's numerics (``scale = float32(amax) / bound`` from ``functional.scales``; integer levels or
  E4M3 values; saturation): computed exactly by ``quant_error.ErrorIntegral`` (closed form; no aliasing between
  the bin width and the step, unlike fake-quantizing bin centers). Implemented in ``mse.py``: the candidates x
  occupied-bins matrix is evaluated in chunks (float64); the **first** minimum wins.
- **entropy**: for ``i in range(start_bin, n + 1, stride)``, with ``b`` = counts and ``b[0] = b[1]`` (on a copy):
  P = ``b[:i]`` with the mass ``sum(b[i:])`` added to its last bin; Q = the ``i`` bins mapped onto
  ``L = 2**(num_bits - 1 + unsigned)`` levels (bin j -> level ``floor(j L / i)``), each level's mass spread
  evenly over its non-empty bins, empty bins 0; score ``KL(P/sum P || Q/sum Q)`` (infinite when P > 0 where Q = 0).
  The **last** minimum wins and amax = ``i w`` (the right edge of bin i-1). The sweep uses prefix sums:
  per candidate only the L level sums are formed (a candidates x levels matrix), never a Python loop.

Ties: scores within ``1e-9 * |min| + 1e-12`` of the minimum count as equal (float sums in different orders agree
to far better than that), and the first (mse) / last (entropy) of them is taken.
"""

from __future__ import annotations

import torch

from ..formats import element_format, is_float_format
from ..functional.division import true_div
from .grid import E_MIN, widths

#: Elements per chunk of the candidates x bins (mse) or candidates x levels (entropy) matrices: cache sized on
#: the CPU, large on GPUs (fewer kernel launches).
CHUNK = 1 << 16
CHUNK_CUDA = 1 << 23


_REL_TOL, _ABS_TOL = 1e-9, 1e-12


def chunk_size(device: torch.device) -> int:
    """Chunk size (elements) for the candidate sweeps on ``device``."""
    return CHUNK_CUDA if device.type == "cuda" else CHUNK


def occupied(counts: torch.Tensor) -> torch.Tensor:
    """Number of occupied bins per row: index of the last non-zero bin + 1 (0 for an empty row)."""
    cap = counts.shape[1]
    j = torch.arange(1, cap + 1, device=counts.device, dtype=torch.int64)
    return torch.where(counts > 0, j, torch.zeros_like(j)).amax(dim=1)


def pick(scores: torch.Tensor, valid: torch.Tensor, last: bool) -> torch.Tensor:
    """Index per row of the first (or last) valid score within the tie tolerance of the row's minimum.

    ``scores`` may hold +inf (an infinitely bad but valid candidate); invalid entries are never picked unless a row
    has no valid entry at all.
    """
    best = torch.where(valid, scores, torch.full_like(scores, float("inf"))).amin(dim=1, keepdim=True)
    ok = valid & (scores <= best + (_REL_TOL * best.abs() + _ABS_TOL))
    k = scores.shape[1]
    pos = torch.arange(k, device=scores.device)
    if last:
        return torch.where(ok, pos, torch.full_like(pos, -1)).amax(dim=1).clamp(min=0)
    return torch.where(ok, pos, torch.full_like(pos, k)).amin(dim=1).clamp(max=k - 1)


def live_rows(exp: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Rows with data above the all-zero grid (the others get amax 0)."""
    return (exp > E_MIN) & (n > 0)


def percentile_amax(counts: torch.Tensor, exp: torch.Tensor, percentile: float) -> torch.Tensor:
    """amax per row at ``percentile`` (0 < p <= 100): left edge of the bin where the cumulative count reaches p%."""
    cum = counts.cumsum(dim=1)
    total = cum[:, -1:].to(torch.float64)
    target = true_div(total * float(percentile), 100.0)
    idx = torch.searchsorted(cum.to(torch.float64), target, side="left").squeeze(1)
    idx = torch.clamp(idx, max=counts.shape[1] - 1)
    amax = idx.to(torch.float64) * widths(exp)
    live = live_rows(exp, occupied(counts))
    return torch.where(live, amax, torch.zeros_like(amax)).to(torch.float32)


def check_start(n, live, start_bin, what, extra=0):
    """ValueError when ``start_bin`` leaves a live row without candidates."""
    if bool(live.any()):
        nmin = int(n[live].min())
        if start_bin > nmin - 1 + extra:
            raise ValueError(
                f"{what}: start_bin={start_bin} leaves no candidate: a histogram has only {nmin} "
                f"occupied bins; lower start_bin or raise num_bins"
            )


def _entropy_scores(b, cb, nz, bl, s, n, i_all, levels):
    """KL scores (rows, K) for candidates ``i_all`` (K,), from prefix sums (rows, cap + 1)."""
    rows = b.shape[0]
    big_i = i_all.reshape(1, -1).expand(rows, -1)
    valid = big_i <= n.reshape(-1, 1)
    ii = torch.minimum(big_i, torch.clamp(n, min=1).reshape(-1, 1))  # keep indices in range; masked below
    lv = torch.arange(levels + 1, device=b.device, dtype=torch.int64)
    starts = (lv.reshape(1, 1, -1) * ii.unsqueeze(2) + (levels - 1)) // levels  # ceil(l i / L), (rows, K, L+1)
    flat = starts.reshape(rows, -1)
    mass = torch.gather(cb, 1, flat).reshape(starts.shape).diff(dim=2)  # level masses M_l
    nbin = torch.gather(nz, 1, flat).reshape(starts.shape).diff(dim=2)  # non-empty bins per level n_l
    safe_n = torch.clamp(nbin, min=1)
    lvl_term = torch.where(mass > 0, mass * torch.log(mass / safe_n), torch.zeros_like(mass)).sum(dim=2)
    c_i = torch.gather(cb, 1, ii)
    b_last = torch.gather(b, 1, ii - 1)
    outl = s.reshape(-1, 1) - c_i
    p_last = b_last + outl
    a_term = torch.gather(bl, 1, ii - 1) + torch.where(p_last > 0, p_last * torch.log(p_last), torch.zeros_like(p_last))
    last_lv = ((ii - 1) * levels) // ii
    m_last = torch.gather(mass, 2, last_lv.unsqueeze(2)).squeeze(2)
    n_last = torch.gather(safe_n, 2, last_lv.unsqueeze(2)).squeeze(2)
    q_last = torch.where(m_last > 0, m_last / n_last, torch.ones_like(m_last))
    o_term = torch.where(outl > 0, outl * torch.log(q_last), torch.zeros_like(outl))
    s_ = s.reshape(-1, 1)
    kl = (a_term - lvl_term - o_term) / s_ + torch.log(c_i) - torch.log(s_)
    bad = ~valid | (c_i <= 0) | ((b_last == 0) & (outl > 0))  # invalid ones are also masked by pick()
    return kl.masked_fill(bad, float("inf"))


def check_entropy_args(num_bits, start_bin: int, what: str = "entropy") -> None:
    """Raise ValueError when the entropy search is not defined (float formats, or ``start_bin < 1``)."""
    if is_float_format(num_bits):
        raise ValueError(
            f"{what}: entropy calibration maps the histogram onto uniformly spaced integer levels; "
            f"{element_format(num_bits).title} levels are not uniform, so it is not defined for "
            f"num_bits={tuple(num_bits)}: use 'mse' "
            "or 'percentile'"
        )
    if start_bin < 1:
        raise ValueError(f"{what}: start_bin must be >= 1 for entropy, got {start_bin}")


def entropy_amax(
    counts, exp, start_bin: int, stride: int, num_bits, unsigned: bool, what: str = "entropy"
) -> torch.Tensor:
    """amax per row minimizing TensorRT's KL divergence (see module docstring); integer formats only."""
    check_entropy_args(num_bits, start_bin, what)
    levels = 2 ** (num_bits - 1 + int(unsigned))
    rows, cap = counts.shape
    dev = counts.device
    n = occupied(counts)
    live = live_rows(exp, n)
    check_start(n, live, start_bin, what, extra=1)
    out = torch.zeros(rows, dtype=torch.float32, device=dev)
    if not bool(live.any()):
        return out
    i_all = torch.arange(start_bin, int(n[live].max()) + 1, stride, device=dev)
    b = counts.to(torch.float64)
    if cap > 1:
        b[:, 0] = b[:, 1]
    zero = torch.zeros(rows, 1, dtype=torch.float64, device=dev)
    cb = torch.cat([zero, b.cumsum(dim=1)], dim=1)
    nz = torch.cat([zero, (b > 0).to(torch.float64).cumsum(dim=1)], dim=1)
    bl = torch.cat([zero, torch.where(b > 0, b * torch.log(b), torch.zeros_like(b)).cumsum(dim=1)], dim=1)
    s = torch.gather(cb, 1, n.reshape(-1, 1)).squeeze(1)
    scores = torch.empty(rows, i_all.numel(), dtype=torch.float64, device=dev)
    chunk = chunk_size(dev)
    kc = max(1, chunk // (levels + 1))
    rc = max(1, chunk // ((levels + 1) * min(kc, i_all.numel())))
    for r0 in range(0, rows, rc):
        r1 = min(rows, r0 + rc)
        for k0 in range(0, i_all.numel(), kc):
            k1 = min(i_all.numel(), k0 + kc)
            scores[r0:r1, k0:k1] = _entropy_scores(
                b[r0:r1], cb[r0:r1], nz[r0:r1], bl[r0:r1], s[r0:r1], n[r0:r1], i_all[k0:k1], levels
            )
    best = pick(scores, i_all.reshape(1, -1) <= n.reshape(-1, 1), last=True)
    amax = i_all[best].to(torch.float64) * widths(exp)
    # the top bin's upper edge may lie past float32's range (data near 3.4e38): its largest finite value covers the
    # data there, where float32 rounding would give an Inf amax
    amax = amax.clamp(max=torch.finfo(torch.float32).max)
    return torch.where(live, amax.to(torch.float32), out)
