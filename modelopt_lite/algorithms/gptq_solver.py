"""The GPTQ solve for one weight matrix: quantize column by column, pushing each column's rounding error into the
columns not yet quantized through the inverse Hessian of the layer input (Frantar et al., 2022).

For a weight ``W`` (out, in) and the input Hessian ``H = X^T X / n`` (in, in), GPTQ minimizes
``||X W^T - X Q^T||^2`` one column at a time: with ``U`` the upper Cholesky factor of ``(H + damp I)^-1``, quantizing
column ``j`` to ``q_j`` moves every later column ``k`` by ``-(w_j - q_j) / U_jj * U_jk``. The updates are applied
lazily, ``block_size`` columns at a time (one matrix product per block for the columns further right).

Details, as the reference algorithm does them:

- dead columns (``H_jj == 0``: that input is always zero) get ``H_jj = 1`` and weight 0;
- ``damp = perc_damp * mean(diag(H))`` is added to the diagonal before inverting;
- ``desc_act``: columns are processed in order of decreasing ``H_jj`` (the most active inputs first), the result
  is put back in the original order;
- the grid comes from the weight quantizer's descriptor (:func:`grid_for`): integer (any bits, signed/unsigned,
  narrow range) or E4M3, per tensor, per channel or in blocks. A scale that covers every column (per tensor, per
  output channel) is computed from the original weight (what max calibration gives); a scale that covers a group
  of columns (a block along the input axis, or one input channel) is computed when the first column of its group
  is quantized, from the group's current (error-compensated) values, as the reference does with ``groupsize``.
  With ``desc_act`` a block is still the contiguous block of the quantizer (its scale is fixed when its first
  column in the permuted order comes up), so the result stays an ordinary block-quantized weight.

The result ``Q`` is exactly ``fake_quant(Q, amax)`` for the returned amax (every column is ``rint(w / s) * s``
computed by :mod:`modelopt_lite.functional.reference` with ``s = scale_from_amax(amax)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats import format_range, is_e4m3
from ..functional import blocks, reference
from ..functional.scales import scale_from_amax


@dataclass(frozen=True)
class Grid:
    """How one weight of shape ``(out, in)`` is quantized: the format and which rows/columns share a scale."""

    e4m3: bool
    qmin: float
    qmax: float
    bound: float
    row_group: int | None  #: rows sharing one scale (None: all rows)
    col_group: int | None  #: columns sharing one scale (None: all columns)
    amax_shape: tuple[int, ...]  #: the shape the weight quantizer stores its amax in

    def n_groups(self, out: int, cols: int) -> tuple[int, int]:
        """``(row groups, column groups)`` for a weight of ``out`` rows and ``cols`` columns."""
        rg = 1 if self.row_group is None else math.ceil(out / self.row_group)
        cg = 1 if self.col_group is None else math.ceil(cols / self.col_group)
        return rg, cg

    def fake(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Fake-quantize ``x`` (float32) with ``scale`` (float32, same shape) exactly as the quantizer does."""
        if self.e4m3:
            return reference.fake_e4m3(x, scale)
        # reference.fake_quant_int's formula, inlined for same-shape operands (the column loop calls this per column)
        dead = scale == 0
        s = torch.where(dead, torch.ones_like(scale), scale)
        y = torch.div(x, s).round_().clamp_(self.qmin, self.qmax).add_(0.0).mul_(s)
        return y.masked_fill_(dead, 0.0)


def grid_for(desc, shape: tuple[int, ...], label: str) -> Grid:
    """The :class:`Grid` of a weight quantizer's descriptor for a 2-D weight of ``shape``; ValueError naming
    ``label`` and the setting for what GPTQ cannot honour (dynamic, double-quantized block scales, scale_amax)."""
    if len(shape) != 2:
        raise ValueError(f"gptq: {label}: needs a 2-D weight (out, in), got shape {tuple(shape)}")
    if desc.dynamic:
        raise ValueError(f"gptq: {label}: the weight quantizer is dynamic; GPTQ needs a static amax")
    if desc.scale_amax is not None:
        raise ValueError(f"gptq: {label}: scale_amax={desc.scale_amax!r} is not supported by GPTQ")
    rng = format_range(desc.num_bits, desc.unsigned, desc.narrow_range)
    e4m3 = is_e4m3(desc.num_bits)
    if isinstance(desc.num_bits, tuple) and not e4m3:  # its Grid rounds integers or E4M3 only
        raise ValueError(f"gptq: {label}: num_bits={desc.num_bits!r} is not supported by GPTQ (integers and E4M3 only)")
    out, cols = shape
    if desc.block_sizes:
        bs = desc.block_sizes
        if bs.get("scale_bits") is not None:
            raise ValueError(
                f"gptq: {label}: double-quantized block scales (scale_bits={bs['scale_bits']!r}) are not supported"
            )
        sizes = blocks.normalize(bs, shape)
        rg = sizes.get(0, 1)
        cg = sizes.get(1, 1)
        amax_shape = blocks.blocks_shape(shape, sizes)
        return Grid(e4m3, rng.qmin, rng.qmax, float(rng.bound), rg, cg, tuple(amax_shape))
    if desc.axis is None:
        return Grid(e4m3, rng.qmin, rng.qmax, float(rng.bound), None, None, ())
    axes = {a % 2 for a in ((desc.axis,) if isinstance(desc.axis, int) else desc.axis)}
    amax_shape = (out if 0 in axes else 1, cols if 1 in axes else 1)
    return Grid(
        e4m3, rng.qmin, rng.qmax, float(rng.bound), 1 if 0 in axes else None, 1 if 1 in axes else None, amax_shape
    )


def _row_amax(vals: torch.Tensor, row_group: int | None, n_rg: int) -> torch.Tensor:
    """max |vals| (out, k) over every row group, as float32 of shape (n_rg,)."""
    a = vals.abs().amax(1) if vals.shape[1] else vals.new_zeros(vals.shape[0])
    if row_group is None:
        return a.amax().reshape(1).float()
    pad = n_rg * row_group - a.shape[0]
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    return a.reshape(n_rg, row_group).amax(1).float()


def _row_sum(v: torch.Tensor, row_group: int | None, n_rg: int) -> torch.Tensor:
    """``v`` (out,) summed over every row group: (n_rg,)."""
    if row_group is None:
        return v.sum().reshape(1)
    pad = n_rg * row_group - v.shape[0]
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    return v.reshape(n_rg, row_group).sum(1)


def _expand_rows(s: torch.Tensor, row_group: int | None, out: int) -> torch.Tensor:
    """Per-row-group values (n_rg,) as one value per row (out,)."""
    if row_group is None:
        return s.expand(out).contiguous()
    return s.repeat_interleave(row_group)[:out].contiguous()


#: the amax shrink factors ``clip_search`` tries (1 first: a tie keeps the unclipped range)
CLIP_RATIOS = tuple(1.0 - 0.025 * k for k in range(17))


def search_amax(vals: torch.Tensor, weights: torch.Tensor, grid: Grid, n_rg: int) -> torch.Tensor:
    """The amax per row group (float32, (n_rg,)) among ``r * max|vals|`` for r in :data:`CLIP_RATIOS` that
    minimizes ``sum_j weights_j * (vals_ij - fake(vals_ij))^2`` over the group (``weights``: the Hessian diagonal
    of the columns, i.e. how much each input matters)."""
    amax = _row_amax(vals, grid.row_group, n_rg)
    out = vals.shape[0]
    v32 = vals.float()
    best, best_err = amax, None
    for r in CLIP_RATIOS:
        cand = amax * r if r != 1.0 else amax
        s = _expand_rows(scale_from_amax(cand, grid.bound), grid.row_group, out)
        q = grid.fake(v32, s[:, None].expand_as(v32).contiguous())
        err = _row_sum(((vals - q.double()) ** 2 * weights).sum(1), grid.row_group, n_rg)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best = torch.where(better, cand, best)
        best_err = torch.where(better, err, best_err)
    return best


def inverse_hessian_factor(h: torch.Tensor, perc_damp: float, label: str = "weight") -> torch.Tensor:
    """The upper Cholesky factor of ``(H + perc_damp * mean(diag H) * I)^-1`` (float64); ``h`` must already have
    its dead columns fixed. ValueError naming ``label`` when it is not positive definite."""
    h = h.double().clone()
    damp = perc_damp * float(h.diagonal().mean())
    h.diagonal().add_(damp)
    try:
        # with J the reversal, chol(J H J) = C gives H^-1 = (C^-1 J)^T (C^-1 J), so U = J C^-1 J is the upper
        # Cholesky factor of H^-1: one factorization and one triangular inverse instead of three factorizations
        c = torch.linalg.cholesky(h.flip(0, 1))
        eye = torch.eye(h.shape[0], dtype=h.dtype)
        return torch.linalg.solve_triangular(c, eye, upper=False).flip(0, 1)
    except torch.linalg.LinAlgError as e:
        raise ValueError(
            f"gptq: {label}: the damped Hessian is not positive definite (perc_damp={perc_damp}); "
            f"raise perc_damp or calibrate on more data"
        ) from e


def prepare_hessian(h: torch.Tensor, label: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(H with dead columns fixed, dead mask)``: a column whose diagonal is 0 gets ``H_jj = 1`` (its row and
    column are already 0 for a Gram matrix)."""
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"gptq: {label}: the Hessian must be square, got shape {tuple(h.shape)}")
    h = h.double().clone()
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"gptq: {label}: the Hessian contains NaN or Inf (non-finite calibration inputs)")
    dead = h.diagonal() == 0
    h[dead, :] = 0
    h[:, dead] = 0
    h.diagonal()[dead] = 1.0
    return h, dead


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: Grid,
    *,
    block_size: int = 128,
    perc_damp: float = 0.01,
    desc_act: bool = False,
    clip_search: bool = False,
    label: str = "weight",
    factor: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ-quantize ``weight`` (out, in): returns ``(Q, amax)``, ``Q`` float32 fake-quantized values of the
    weight's shape and ``amax`` float32 in ``grid.amax_shape``, with ``grid.fake(Q, scale(amax)) == Q``.

    ``clip_search``: every scale is chosen by :func:`search_amax` (a shrunk range where that lowers the
    Hessian-weighted rounding error of its group) instead of the plain max.

    ``factor``: ``(U, perm, dead, diag)`` from :func:`hessian_factor` when several weights share one Hessian (computed
    once); else it is computed from ``hessian``.
    """
    if weight.dim() != 2:
        raise ValueError(f"gptq: {label}: needs a 2-D weight, got shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"gptq: {label}: the weight contains NaN or Inf")
    out, n = weight.shape
    u, perm, dead, diag = factor if factor is not None else hessian_factor(hessian, perc_damp, desc_act, label)
    if u.shape != (n, n):
        raise ValueError(f"gptq: {label}: Hessian of shape {tuple(u.shape)} does not match the weight {(out, n)}")
    n_rg, n_cg = grid.n_groups(out, n)
    w0 = weight.detach().double()
    given = amax is not None
    if amax is not None:  # the scales are given: GPTQ only picks the codes
        amax = amax.detach().to(torch.float32).reshape(n_rg, n_cg).clone()
        known_l = [True] * n_cg
    else:
        amax = torch.zeros(n_rg, n_cg, dtype=torch.float32)
        known_l = [False] * n_cg
    if grid.col_group is None and not given:  # one scale over all columns: from the original weight
        if clip_search:
            amax[:, 0] = search_amax(w0, diag, grid, n_rg)
        else:
            amax[:, 0] = _row_amax(w0, grid.row_group, n_rg)
        known_l = [True] * n_cg
    w = w0.clone()
    w[:, dead] = 0
    w = w[:, perm]
    diag_perm = diag[perm]
    group = (perm // grid.col_group) if grid.col_group is not None else torch.zeros(n, dtype=torch.long)
    group_l = group.tolist()
    members: dict[int, list[int]] = {}
    for pos, g in enumerate(group_l):
        members.setdefault(g, []).append(pos)
    scales: dict[int, torch.Tensor] = {}

    def scale_of(g: int) -> torch.Tensor:
        s = scales.get(g)
        if s is None:
            scales[g] = s = _expand_rows(scale_from_amax(amax[:, g], grid.bound), grid.row_group, out)
        return s

    # columns as rows (contiguous): wt[j] is column j of the permuted weight
    wt = w.t().contiguous()
    qt = torch.empty(n, out, dtype=torch.float32)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        w1 = wt[i1:i2].clone()
        err1 = torch.zeros(i2 - i1, out, dtype=torch.float64)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            g = group_l[j]
            if not known_l[g]:
                cols = torch.tensor(members[g])
                inside, later = cols[cols < i2], cols[cols >= i2]
                vals = [w1[inside - i1]]
                if len(later):
                    vals.append(wt[later] - u[i1:j, later].t() @ err1[:i])
                cur = torch.cat(vals, 0).t()
                if clip_search:
                    amax[:, g] = search_amax(cur, diag_perm[torch.cat([inside, later])], grid, n_rg)
                else:
                    amax[:, g] = _row_amax(cur, grid.row_group, n_rg)
                known_l[g] = True
            col = w1[i]
            qc = grid.fake(col.float(), scale_of(g))
            qt[j] = qc
            e = (col - qc.double()).div_(u1[i, i])
            if i + 1 < i2 - i1:
                w1[i + 1 :].addr_(u1[i, i + 1 :], e, alpha=-1)
            err1[i] = e
        if i2 < n:
            wt[i2:].addmm_(u[i1:i2, i2:].t(), err1, alpha=-1)
    q = qt.t()
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    return q[:, inv].contiguous(), amax.reshape(grid.amax_shape)


def hessian_factor(
    hessian: torch.Tensor, perc_damp: float, desc_act: bool, label: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U, perm, dead, diag)`` for :func:`gptq_quantize`: the upper Cholesky factor of the damped inverse Hessian
    in processing order, the processing order (decreasing ``H_jj`` with ``desc_act``, else the identity; a stable
    sort), the dead-column mask and the Hessian diagonal (original order, dead columns 1)."""
    h, dead = prepare_hessian(hessian, label)
    diag = h.diagonal().clone()
    n = h.shape[0]
    if desc_act:
        perm = torch.argsort(h.diagonal(), descending=True, stable=True)
        h = h[perm][:, perm]
    else:
        perm = torch.arange(n)
    return inverse_hessian_factor(h, perc_damp, label), perm, dead, diag
