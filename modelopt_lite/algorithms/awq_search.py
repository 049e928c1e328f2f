"""The two AWQ searches on one Linear, scored exactly on the layer's input Gram matrix (see :mod:`.awq_stats`).

Scale search (``awq_lite``): for ``alpha`` on a grid in [0, 1], the per-input-channel scale
``s = clamp(a ** alpha / w ** (1 - alpha), 1e-4, 1e4)``, normalised by ``sqrt(max(s) * min(s))``, with ``a`` the
mean ``|x_j|`` of the calibration inputs and ``w`` the mean over output rows of ``|W_ij| / max|W_block|``. The
layer then computes ``(x / s) @ Q(W * s)^T``; the candidate's error is ``sum over tokens and outputs of
((x / s) @ Q(W * s)^T - x @ W^T)^2 = trace(D G D^T)`` with ``D = Q(W * s) / s - W`` and ``G = X^T X``. The alpha with
the least error wins (the first one on a tie), unless no alpha beats the unscaled weight (then the layer keeps
it: unlike ModelOpt, AWQ never makes a layer's measured error worse than round-to-nearest).

Clip search (``awq_clip``): for each block of the weight (``block_sizes`` along the input axis), the amax
``r * max|W_block|`` for ``r`` from ``min_clip_ratio`` to 1 in steps of ``shrink_step`` that minimises the error of
that block's partial dot products, ``d^T G_bb d`` with ``d = Q_r(w_block) - w_block`` and ``G_bb`` the block's
diagonal part of ``G`` (ModelOpt's clip loss, on every calibration token). Ties keep the larger ratio.

Candidates are quantized by a scratch copy of the layer's own weight quantizer, so every format it supports works.
"""

from __future__ import annotations

import math

import torch

from ..nn import TensorQuantizer

_S_MIN, _S_MAX = 1e-4, 1e4
_TINY = torch.finfo(torch.float32).tiny


def block_size(wq: TensorQuantizer, label: str) -> int | None:
    """The block size along the weight's input axis, None when ``wq`` is not a block quantizer.

    Raises:
        ValueError: blocks along another axis (AWQ needs blocks along the input axis, ``-1`` or ``1``).
    """
    bs = wq.block_sizes
    if not bs:
        return None
    sizes = {k: v for k, v in bs.items() if not isinstance(k, str)}
    if set(sizes) - {-1, 1} or len(sizes) != 1:
        raise ValueError(f"awq: {label}: blocks must run along the input axis (-1 or 1) only, got {dict(bs)}")
    return int(next(iter(sizes.values())))


def fake_quant(wq: TensorQuantizer, w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``w`` quantized as ``wq`` would, with ``amax`` (None: ``w``'s own max per channel/block), never touching
    ``wq`` itself (a scratch quantizer with the same descriptor does the work)."""
    d = wq.quant_desc
    if amax is None and d.amax is None and not d.dynamic and w.dim() == 2:
        bs = block_size(wq, "awq")
        if bs is not None and set(d.block_sizes) <= {-1, 1}:  # the block max, computed here (a fast reshape)
            pad = (-w.shape[1]) % bs
            wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
            amax = wp.detach().abs().reshape(w.shape[0], -1, bs).amax(-1)
    scratch = TensorQuantizer(d, amax=amax)
    return scratch(w)


def alpha_grid(alpha_step: float) -> list[float]:
    """``0, step, 2 step, ...`` up to 1 (rounded to 10 decimals; ModelOpt's arange may overshoot 1, this does not)."""
    n = int(math.floor(1.0 / alpha_step + 1e-9))
    return [round(k * alpha_step, 10) for k in range(n + 1)]


def clip_ratios(min_clip_ratio: float, shrink_step: float) -> list[float]:
    """1.0 first (ties keep the unclipped amax), then ``min_clip_ratio + k * shrink_step`` below 1."""
    out, k = [1.0], 0
    while True:
        r = round(min_clip_ratio + k * shrink_step, 6)
        if r >= 1.0 - 1e-9:
            return out
        out.append(r)
        k += 1


def weight_magnitude(w: torch.Tensor, bs: int | None) -> torch.Tensor:
    """Mean over output rows of ``|W_ij|`` relative to its block's (or row's) max: shape (in,), float32."""
    w = w.detach().float().abs()
    cin = w.shape[1]
    size = bs or cin
    pad = (-cin) % size
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    blocks = wp.reshape(w.shape[0], -1, size)
    rel = blocks / (blocks.amax(-1, keepdim=True) + _TINY)
    return rel.reshape(w.shape[0], -1)[:, :cin].mean(0)


def awq_scale(act: torch.Tensor, wmag: torch.Tensor, alpha: float) -> torch.Tensor:
    """The per-input-channel scale of one alpha (float32)."""
    s = (act.float().pow(alpha) / (wmag.float().pow(1.0 - alpha) + _TINY)).clamp(_S_MIN, _S_MAX)
    return s / (s.max() * s.min()).sqrt()


def output_error(d: torch.Tensor, gram: torch.Tensor) -> float:
    """``trace(D G D^T)``: the summed squared output error of a weight error ``D`` (out, in)."""
    return float(torch.sum((d @ gram).mul_(d)))


def search_scale(w, act, gram, count: int, wq: TensorQuantizer, alphas: list[float], bs: int | None):
    """``(best_alpha, best_scale, {alpha: mean squared output error})`` for one layer (see the module docstring)."""
    return search_scale_group([w], act, gram, count, [wq], alphas, [bs])


def search_scale_group(ws, act, gram, count: int, wqs, alphas: list[float], bss):
    """One scale for several layers that read the same input: the weight magnitude is the mean over all their
    rows, the error the sum of theirs (the mean over all their outputs). The unscaled weights (key None) are
    scored first and win unless an alpha does strictly better: ``(None, None, losses)`` then."""
    ws = [w.detach().float() for w in ws]
    dev = ws[0].device
    g = gram.to(dev, torch.float32)
    rows = sum(w.shape[0] for w in ws)
    wmag = sum(weight_magnitude(w, bs).to(dev) * w.shape[0] for w, bs in zip(ws, bss)) / rows
    act = act.to(dev)
    denom = max(count, 1) * rows

    def error(s):
        if s is None:
            return sum(output_error(fake_quant(wq, w) - w, g) for w, wq in zip(ws, wqs)) / denom
        return sum(output_error(fake_quant(wq, w * s) / s - w, g) for w, wq in zip(ws, wqs)) / denom

    losses: dict[float | None, float] = {None: error(None)}
    best: tuple = (None, None)
    for alpha in alphas:
        s = awq_scale(act, wmag, alpha)
        losses[alpha] = error(s)
        if losses[alpha] < losses[best[0]]:
            best = (alpha, s)
    return best[0], best[1], losses


def _diag_blocks(gram: torch.Tensor, bs: int, nb: int) -> torch.Tensor:
    cin = gram.shape[0]
    pad = nb * bs - cin
    g = torch.nn.functional.pad(gram, (0, pad, 0, pad)) if pad else gram
    return torch.stack([g[b * bs : (b + 1) * bs, b * bs : (b + 1) * bs] for b in range(nb)])


def search_clip(w, gram, count: int, wq: TensorQuantizer, ratios: list[float], bs: int, co_batch: int):
    """``(best_amax (out, n_blocks), best_ratio (out, n_blocks), {ratio: mean error})`` of the block clip search."""
    w = w.detach().float()
    cout, cin = w.shape
    nb = -(-cin // bs)
    pad = nb * bs - cin
    gb = _diag_blocks(gram.to(w.device, torch.float32), bs, nb)  # (nb, bs, bs)
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    amax0 = wp.reshape(cout, nb, bs).abs().amax(-1)  # the block max, as a max calibration gives
    best_loss = torch.full((cout, nb), float("inf"), dtype=torch.float64, device=w.device)
    best_ratio = torch.ones(cout, nb, dtype=torch.float32, device=w.device)
    totals: dict[float, float] = {}
    denom = max(count, 1) * cout
    for r in ratios:
        d = fake_quant(wq, w, amax0 * r) - w
        d = (torch.nn.functional.pad(d, (0, pad)) if pad else d).reshape(cout, nb, bs)
        loss = torch.empty(cout, nb, dtype=torch.float64, device=w.device)
        for lo in range(0, cout, co_batch):
            dc = d[lo : lo + co_batch].transpose(0, 1)  # (nb, rows, bs)
            loss[lo : lo + co_batch] = ((dc @ gb) * dc).sum(-1, dtype=torch.float64).transpose(0, 1)
        better = loss < best_loss
        best_loss = torch.where(better, loss, best_loss)
        best_ratio = torch.where(better, torch.full_like(best_ratio, r), best_ratio)
        totals[r] = float(loss.sum()) / denom
    return amax0 * best_ratio, best_ratio, totals
