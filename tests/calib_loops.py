"""Slow, straightforward loop versions of the histogram amax searches (the definitions the vectorized code meets).

One candidate at a time: explicit P and Q arrays for entropy (levels found with ``np.digitize`` on
``np.linspace`` edges, as TensorRT's calibrator does); for mse the error integral of each bin from the quantizer's
level list (the integral itself is checked against sampled fake quantization in test_calib_histogram.py).
Used by the tests (vectorized == loop, exactly) and by ``bench/bench_calib.py``. Not part of the library.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from modelopt_lite.formats import element_format, int_range
from modelopt_lite.functional.scales import bound_of, scale_from_amax

REL_TOL, ABS_TOL = 1e-9, 1e-12  # the documented tie rule of modelopt_lite.calib.methods


def _occupied(counts) -> int:
    nz = np.nonzero(np.asarray(counts))[0]
    return int(nz[-1]) + 1 if nz.size else 0


def _pick(scores, last: bool) -> int:
    scores = np.asarray(scores, dtype=np.float64)
    best = scores.min()
    ok = [k for k, v in enumerate(scores) if v <= best + (REL_TOL * abs(best) + ABS_TOL) or v == best]
    return ok[-1] if last else ok[0]


def percentile_loop(counts, width: float, percentile: float) -> float:
    """Left edge of the first bin where the running count reaches percentile % of the total."""
    counts = [int(c) for c in counts]
    target = sum(counts) * percentile / 100.0
    run = 0
    for j, c in enumerate(counts):
        run += c
        if run >= target:
            return j * width
    return (len(counts) - 1) * width


def _g_int(v, qmax):
    """Integral of (t - level(t))**2 from 0 to v for the integer levels 0..qmax (saturating)."""
    i = np.minimum(np.floor(v + 0.5), qmax)
    return i / 12 + (v - i) ** 3 / 3


def _g_levels(v, levels):
    """The same for any ascending level list starting at 0 (E4M3), summing whole cells level by level."""
    levels = [float(x) for x in levels]
    starts = [0.0] + [(a + b) / 2 for a, b in itertools.pairwise(levels)]
    below = [0.0]  # integral from 0 to starts[k]
    for k in range(len(levels) - 1):
        lv, a, b = levels[k], starts[k], starts[k + 1]
        below.append(below[-1] + ((b - lv) ** 3 - (a - lv) ** 3) / 3)
    k = np.searchsorted(np.asarray(starts), v, side="right") - 1
    lv, a = np.asarray(levels)[k], np.asarray(starts)[k]
    return np.asarray(below)[k] + ((v - lv) ** 3 - (a - lv) ** 3) / 3


def e4m3_levels():
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


def mse_loop(counts, width: float, start_bin: int, stride: int, num_bits, unsigned: bool) -> float:
    """First bin center minimizing the total squared fake-quant error (bins read as uniform), one at a time."""
    counts = np.asarray(counts, dtype=np.float64)
    n = _occupied(counts)
    lo = np.arange(n, dtype=np.float64) * width
    hi = lo + width
    cnt = counts[:n]
    bound = bound_of(num_bits, unsigned)
    lv = e4m3_levels() if element_format(num_bits).is_e4m3 else None
    qmax = None if lv is not None else int_range(num_bits, unsigned, False).qmax

    def g(v):
        return _g_levels(v, lv) if lv is not None else _g_int(v, qmax)

    scores, cands = [], []
    for k in range(start_bin, n, stride):
        amax = torch.tensor((k + 0.5) * width, dtype=torch.float32)
        s = float(scale_from_amax(amax, bound))
        if s == 0:
            per_bin = (hi**3 - lo**3) / (3 * width)
        else:
            per_bin = (g(hi / s) - g(lo / s)) * s**3 / width
        scores.append(float((cnt * per_bin).sum()))
        cands.append(float(amax))
    return cands[_pick(scores, last=False)]


def kl_divergence(p, q) -> float:
    """KL(p/sum p || q/sum q); inf where p > 0 and q == 0 (or q is all zero)."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if q.sum() <= 0:
        return math.inf
    p = p / p.sum()
    q = q / q.sum()
    total = 0.0
    for pj, qj in zip(p, q):
        if pj > 0:
            if qj == 0:
                return math.inf
            total += pj * math.log(pj / qj)
    return total


def entropy_loop(counts, width: float, start_bin: int, stride: int, num_bits, unsigned: bool) -> float:
    """TensorRT-style KL search, candidate by candidate (last minimum; amax = i * width)."""
    nbins = 2 ** (num_bits - 1 + int(unsigned))
    counts = np.asarray(counts, dtype=np.float64)
    n = _occupied(counts)
    bins = counts[:n].copy()
    bins[0] = bins[1]
    scores, cands = [], []
    for i in range(start_bin, n + 1, stride):
        p = bins[:i].copy()
        p[i - 1] += bins[i:].sum()
        level = np.digitize(np.arange(i), np.linspace(0, i, nbins + 1)) - 1
        level[bins[:i] == 0] = -1
        q = np.zeros(i)
        for lv in range(nbins):
            members = level == lv
            k = int(members.sum())
            if k:
                q[members] = bins[:i][members].sum() / k
        scores.append(kl_divergence(p, q))
        cands.append(i * width)
    return cands[_pick(scores, last=True)]
