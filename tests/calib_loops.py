"""Slow, straightforward loop versions of the histogram amax searches (the definitions the vectorized code meets).

One candidate at a time, explicit P and Q arrays for entropy (levels found with ``np.digitize`` on
``np.linspace`` edges, as TensorRT's calibrator does), explicit fake quantization of the bin centers for mse.
Used by the tests (vectorized == loop, exactly) and by ``bench/bench_calib.py``. Not part of the library.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from modelopt_lite.formats import int_range, is_e4m3
from modelopt_lite.functional import reference
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


def mse_loop(counts, width: float, start_bin: int, stride: int, num_bits, unsigned: bool) -> float:
    """First bin center minimizing sum_j counts_j * (fq(center_j) - center_j)**2, one candidate at a time."""
    counts = torch.as_tensor(counts, dtype=torch.int64)
    n = _occupied(counts)
    centers = (torch.arange(n, dtype=torch.float32) + 0.5) * torch.tensor(width, dtype=torch.float32)
    cnt = counts[:n].to(torch.float64)
    bound = bound_of(num_bits, unsigned)
    scores, cands = [], []
    for k in range(start_bin, n, stride):
        amax = centers[k]
        scale = scale_from_amax(amax, bound)
        if is_e4m3(num_bits):
            fq = reference.fake_e4m3(centers, scale)
        else:
            _, qmin, qmax = int_range(num_bits, unsigned, False)
            fq = reference.fake_quant_int(centers, scale, qmin, qmax)
        err = (fq - centers) ** 2
        scores.append(float((err.to(torch.float64) * cnt).sum()))
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
