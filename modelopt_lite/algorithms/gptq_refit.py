"""Refinements of a GPTQ solve (not in ModelOpt 0.47): a least-squares re-fit of the scales for the chosen codes, and
a float target for the layer output.

- :func:`refit_scales`: with the integer codes ``Z`` that GPTQ chose fixed, each row's scales (one per block of
  columns) are the least-squares solution of ``min_s (w - Z s) H (w - Z s)^T`` (the layer-output error in the metric
  of the input Hessian ``H``): a small ``(blocks x blocks)`` linear system per row. :func:`refine` alternates it with
  a GPTQ pass under the re-fitted scales (GPTQ then picks new codes for them) while the error
  ``tr((W - Q) H (W - Q)^T)`` goes down.
- :func:`float_target`: GPTQ fits ``Q X_q`` to ``W X_q`` (``X_q``: the layer's inputs in the model whose earlier
  layers are already quantized). To fit the float model's output ``W X_f`` instead, the weight is first moved to the
  least-squares solution ``W' = W (X_f^T X_q) (X_q^T X_q + damp I)^-1 = W + W M (H + damp I)^-1`` with
  ``M = (X_f - X_q)^T X_q``: then ``||X_f W^T - X_q Q^T||^2 = ||X_f W^T - X_q W'^T||^2 + ||X_q (W' - Q)^T||^2``
  (undamped), and GPTQ on ``W'`` minimizes the part that ``Q`` controls. The correction is 0 where the inputs agree.

Both return values that are exactly their own fake quantization (``grid.fake(Q, scale(amax)) == Q``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..functional.scales import scale_from_amax
from .gptq_solver import Grid

log = logging.getLogger(__name__)


def can_refit(grid: Grid) -> bool:
    """True for integer grids with one scale per row and block of columns (what :func:`refit_scales` re-fits)."""
    return not grid.e4m3 and grid.row_group == 1


def hessian_error(weight: torch.Tensor, q: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)`` in float64: the summed squared error of the layer output over the inputs that
    ``H`` (``X^T X / n``) describes."""
    d = weight.double() - q.double()
    return float(((d @ hessian.double()) * d).sum())


def _col_blocks(grid: Grid, n: int) -> list[slice]:
    size = n if grid.col_group is None else grid.col_group
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def refit_scales(
    weight: torch.Tensor, q: torch.Tensor, amax: torch.Tensor, hessian: torch.Tensor, grid: Grid
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q', amax')``: the codes of ``q`` (under the scales of ``amax``) kept, each row's scales re-fitted by least
    squares in the metric ``hessian``. A row whose system is singular or whose solution is not a positive finite
    scale keeps its old scales; ``amax'`` has ``amax``'s shape and ``Q' == grid.fake(Q', scale(amax'))``."""
    if not can_refit(grid):
        raise ValueError("refit_scales needs an integer grid with one scale per row and column block")
    out, n = weight.shape
    cols = _col_blocks(grid, n)
    nb = len(cols)
    a2 = amax.detach().float().reshape(out, nb)
    s = scale_from_amax(a2, grid.bound).double()
    sfull = torch.cat([s[:, b : b + 1].expand(out, c.stop - c.start) for b, c in enumerate(cols)], 1)
    live = sfull > 0
    z = torch.where(live, q.double() / torch.where(live, sfull, torch.ones_like(sfull)), torch.zeros_like(sfull))
    z = z.round()
    h = hessian.double()
    w = weight.double()
    gram = torch.empty(out, nb, nb, dtype=torch.float64)
    rhs = torch.empty(out, nb, dtype=torch.float64)
    for b, cb in enumerate(cols):
        zh = z[:, cb] @ h[cb, :]  # (out, n): z_b^T H restricted to block b's rows of H
        rhs[:, b] = (zh * w).sum(1)
        for c, cc in enumerate(cols):
            gram[:, b, c] = (zh[:, cc] * z[:, cc]).sum(1)
    sol, info = torch.linalg.solve_ex(gram, rhs.unsqueeze(-1))
    sol = sol.squeeze(-1)
    used = torch.stack([(z[:, c] != 0).any(1) for c in cols], 1)
    ok = (info == 0)[:, None] & torch.isfinite(sol) & (sol > 0) & used
    ok = ok.all(1, keepdim=True) & ok  # a singular row keeps all of its scales
    new_amax = torch.where(ok, (sol * grid.bound).float(), a2)
    s2 = scale_from_amax(new_amax, grid.bound)
    s2full = torch.cat([s2[:, b : b + 1].expand(out, c.stop - c.start) for b, c in enumerate(cols)], 1).contiguous()
    q2 = grid.fake((z.float() * s2full), s2full)  # the codes again, on the new grid (exactly its own fake quant)
    return q2, new_amax.reshape(amax.shape)


def refine(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: Grid,
    q: torch.Tensor,
    amax: torch.Tensor,
    iters: int,
    solve: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``iters`` rounds of: re-fit the scales (:func:`refit_scales`), then ``solve(amax)`` (GPTQ with those
    scales fixed) picks new codes; a round is kept only if it lowers :func:`hessian_error` (the re-fit alone never
    raises it). Returns the best ``(Q, amax)``."""
    if iters <= 0 or not can_refit(grid):
        return q, amax
    best = hessian_error(weight, q, hessian)
    for _ in range(iters):
        q_fit, amax_fit = refit_scales(weight, q, amax, hessian, grid)
        e_fit = hessian_error(weight, q_fit, hessian)
        q_new, amax_new = solve(amax_fit)
        e_new = hessian_error(weight, q_new, hessian)
        if e_new < min(best, e_fit):
            q, amax, best = q_new, amax_new, e_new
            continue
        if e_fit < best:
            q, amax, best = q_fit, amax_fit, e_fit
        break
    return q, amax


def float_target(weight: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor, perc_damp: float) -> torch.Tensor:
    """``W + W M (H + damp I)^-1`` (float64; ``damp = perc_damp * mean(diag H)``): the weight whose output on the
    quantized model's inputs best matches the float model's output (see the module docstring). ``hessian`` is
    ``X_q^T X_q / n`` and ``cross`` is ``M / n = (X_f - X_q)^T X_q / n``."""
    h = hessian.double().clone()
    h.diagonal().add_(perc_damp * float(h.diagonal().mean()))
    w = weight.double()
    return w + torch.linalg.solve(h, (w @ cross.double()).t()).t()  # H symmetric: (W M) H^-1 = (H^-1 (W M)^T)^T
