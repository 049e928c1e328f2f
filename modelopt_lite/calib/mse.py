"""The ``mse`` amax search (see ``methods.py`` for the definition), vectorized over candidates and channels.

For a candidate with scale ``s`` the score is ``sum_j c_j * s**3 * (G(hi_j / s) - G(lo_j / s)) / w`` with ``G`` from
``quant_error.ErrorIntegral``. Work per chunk of candidates:

- bins below the saturation point of the chunk's largest scale: ``G`` is evaluated on their edges (a
  candidates x bins matrix; on all edges once when most bins are occupied, else on both edges of each occupied
  bin only);
- bins above it are saturated for every candidate of the chunk, where ``G(v) = const + (v - top)**3 / 3``: their
  sum is a cubic in ``1/s`` built from suffix sums of ``c (hi**p - lo**p)``, ``p = 1, 2, 3``: O(1) per candidate.

So the cost is about half the full candidates x bins matrix, with no Python loop over bins or candidates.
"""

from __future__ import annotations

import torch

from ..functional.scales import bound_of, scale_from_amax
from .grid import widths
from .methods import check_start, chunk_size, live_rows, occupied, pick
from .quant_error import ErrorIntegral


def _occupied_bins(counts: torch.Tensor, n: torch.Tensor):
    """Per row, the occupied bin indices ascending, padded with the row's last occupied bin (count 0)."""
    nz = counts > 0
    nnz = nz.sum(dim=1, keepdim=True)
    cap = counts.shape[1]
    key = torch.where(nz, torch.zeros_like(counts), torch.ones_like(counts)) * cap + torch.arange(
        cap, device=counts.device
    )
    jmax = max(int(nnz.max()), 1)
    order = torch.argsort(key, dim=1)[:, :jmax]
    pad = torch.arange(jmax, device=counts.device).reshape(1, -1) >= nnz
    cols = torch.where(pad, torch.clamp(n - 1, min=0).reshape(-1, 1), order)
    cnt = torch.where(pad, torch.zeros_like(order), torch.gather(counts, 1, order))
    return cols, cnt


def _suffix(x: torch.Tensor) -> torch.Tensor:
    """``out[:, j] = x[:, j:].sum(1)`` for j = 0..J (the last column 0)."""
    tail = torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])
    return torch.cat([tail, torch.zeros_like(x[:, :1])], dim=1)


def mse_amax(counts, exp, start_bin: int, stride: int, num_bits, unsigned: bool, what: str = "mse") -> torch.Tensor:
    """amax per row (float32) minimizing the histogram's squared fake-quantization error; first minimum wins."""
    rows = counts.shape[0]
    dev = counts.device
    n = occupied(counts)
    live = live_rows(exp, n)
    check_start(n, live, start_bin, what)
    out = torch.zeros(rows, dtype=torch.float32, device=dev)
    if not bool(live.any()):
        return out
    nmax = int(n[live].max())
    k_all = torch.arange(start_bin, nmax, stride, device=dev)
    w = widths(exp).reshape(-1, 1)
    cand = (k_all.to(torch.float32) + 0.5).reshape(1, -1) * w.to(torch.float32)  # (rows, K) bin centers, exact
    scale = scale_from_amax(cand, bound_of(num_bits, unsigned)).to(torch.float64)
    g = ErrorIntegral(num_bits, unsigned, dev)
    cols, cnt = _occupied_bins(counts[:, :nmax], n)
    dense = 2 * cols.shape[1] > nmax + 1
    if dense:
        cols, cnt = torch.arange(nmax, device=dev).expand(rows, -1), counts[:, :nmax]
    lo = cols.to(torch.float64) * w  # (rows, J), ascending per row
    hi = lo + w
    c = cnt.to(torch.float64)
    s1, s2, s3 = (_suffix(c * (hi**p - lo**p)) for p in (1, 2, 3))
    dead_score = (s3[:, 0] / (3 * w[:, 0])).reshape(-1, 1)  # scale 0: every value quantizes to 0
    q = g.top
    scores = torch.empty(rows, k_all.numel(), dtype=torch.float64, device=dev)
    span = (nmax + 1) if dense else 2 * lo.shape[1]
    kc = max(1, chunk_size(dev) // span)
    rc = max(1, chunk_size(dev) // (span * min(kc, k_all.numel())))
    for r0 in range(0, rows, rc):
        r1 = min(rows, r0 + rc)
        lo_r, c_r, w_r = lo[r0:r1], c[r0:r1], w[r0:r1]
        for k0 in range(0, k_all.numel(), kc):
            k1 = min(k_all.numel(), k0 + kc)
            s = scale[r0:r1, k0:k1]
            safe = torch.where(s == 0, torch.ones_like(s), s)
            thr = g.top_start * safe.amax(dim=1, keepdim=True)  # bins with lo >= thr saturate for all
            js = int(torch.searchsorted(lo_r.contiguous(), thr).max())
            sk = safe.unsqueeze(2)
            if dense:
                edges = torch.arange(js + 1, device=dev, dtype=torch.float64).reshape(1, 1, -1) * w_r.unsqueeze(2)
                d_g = g.g12(edges / sk, inplace=True).diff(dim=2)
            else:
                d_g = g.g12(hi[r0:r1, None, :js] / sk, inplace=True).sub_(g.g12(lo_r[:, None, :js] / sk, inplace=True))
            part = torch.matmul(d_g, c_r[:, :js].unsqueeze(2)).squeeze(2)  # 12 * sum c dG below the split
            a = 1.0 / safe
            cubic = (
                4
                * a
                * (
                    s3[r0:r1, js : js + 1] * a * a
                    - 3 * q * s2[r0:r1, js : js + 1] * a
                    + 3 * q * q * s1[r0:r1, js : js + 1]
                )
            )
            sc = (part + cubic) * safe**3 / (12 * w_r)
            scores[r0:r1, k0:k1] = torch.where(s == 0, dead_score[r0:r1], sc)
    best = pick(scores, k_all.reshape(1, -1) < n.reshape(-1, 1), last=False)
    amax = torch.gather(cand, 1, best.reshape(-1, 1)).squeeze(1)
    return torch.where(live, amax, out)
