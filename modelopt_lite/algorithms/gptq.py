"""GPTQ as a calibration algorithm: ``{"method": "gptq", "perc_damp": 0.01, "block_size": 128, "desc_act": False}``.

ModelOpt 0.47 names the first two parameters the same (``perc_damp``, ``block_size``; it has no act-order);
``desc_act`` (act-order: quantize the most active input channels first) is the name AutoGPTQ and Hugging Face use.
There is no GPTQ preset in ModelOpt 0.47: combine a weight config with the algorithm, e.g.
``{**INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "algorithm": {"method": "gptq"}}`` (ModelOpt's way too).

Flow of ``quantize(model, cfg, forward_loop)`` with this algorithm:

1. a max calibration of every quantizer (one pass; activation ranges, and the weight ranges of layers GPTQ leaves
   alone), during which the quantized Linears with an enabled weight quantizer are recorded in call order
   and grouped by the input tensor they read (the query/key/value projections of an attention block share one);
2. then, group by group in call order (sequential, as the reference algorithm): the group's input in each forward of
   the loop (its first layer's first call; :mod:`.gptq_passes`) gives the Hessian ``X^T X`` of that input
   (after the layer's input quantizer, as the layer computes) in float64; the layers before it already carry their
   GPTQ weights, so the inputs reflect their quantization. With ``torch.distributed`` initialized, the Hessian and
   the token count are summed over the ranks (each rank runs its own share of the data), so every rank solves the
   same problem as one process with all the data (the float64 sum is only added up in another order: the tests
   find the same weights and amaxes, bit for bit);
3. :func:`~.gptq_solver.gptq_quantize` solves each layer of the group (one inverse-Hessian factor per group; layers
   with the same per-row grid are stacked into one matrix) and writes the quantized weight into the layer and the
   scales as the weight quantizer's static amax, so ``weight_quantizer(weight)`` equals the stored weight exactly.

Every pass of the loop runs the whole model, so the loop gets the model's real output from every call (it may pool,
score or log it). Passes are few (:mod:`.gptq_passes`): a group inside a block that an earlier group already reached
(an element of an ``nn.ModuleList``, e.g. a transformer layer) replays only that block on its recorded inputs, and
when the blocks form a chain (a transformer's layers) each next block's inputs are the previous block's outputs on
its recorded inputs, so a chain of blocks costs one pass of the loop, not one per block or per group.
``clip_search=True`` (not in ModelOpt) picks each scale among shrunk ranges by the Hessian-weighted rounding error
(:func:`~.gptq_solver.search_amax`). ``scale_refit=k`` (not in ModelOpt) then re-fits each row's block scales by
least squares for the chosen codes and re-runs GPTQ under them, up to ``k`` rounds while the layer-output error
falls (:mod:`.gptq_refit`). ``float_target=True`` (not in ModelOpt; the "asymmetric calibration" of GPTAQ) fits the
float model's layer output ``W X_float`` instead of ``W X``: a copy of the model taken before any weight changes
gives the float inputs of each group (its own passes and replays, as the model's), and the loop must feed the same
batches in the same order on every call (checked). Only one group's Hessian exists at a time. The loop must call the
model as ``model(...)`` (the passes count its forwards). If anything raises, ``quantize`` puts the weights and
quantizers back exactly.
"""

from __future__ import annotations

import copy
import logging
import numbers
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from ..calib.distributed import is_active
from ..conversion.algorithm_registry import register_algorithm
from ..nn import TensorQuantizer
from .block_replay import blocks_of
from .gptq_passes import Feed, passes
from .gptq_refit import float_target, refine
from .gptq_solver import Grid, gptq_quantize, grid_for, hessian_factor

log = logging.getLogger(__name__)

PARAMS = ("perc_damp", "block_size", "desc_act", "clip_search", "scale_refit", "float_target")


def check_params(params: dict) -> None:
    """ValueError/TypeError naming the bad value of a GPTQ parameter."""
    if "perc_damp" in params:
        p = params["perc_damp"]
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < float(p) <= 1.0:
            raise ValueError(f"gptq perc_damp must be a number in (0, 1], got {p!r}")
    if "block_size" in params:
        b = params["block_size"]
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
            raise ValueError(f"gptq block_size must be a positive int, got {b!r}")
    if "scale_refit" in params:
        r = params["scale_refit"]
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= int(r) <= 100:
            raise ValueError(f"gptq scale_refit must be an int in [0, 100], got {r!r}")
    for flag in ("desc_act", "clip_search", "float_target"):
        if flag in params and not isinstance(params[flag], bool):
            raise TypeError(f"gptq {flag} must be a bool, got {params[flag]!r}")


def candidates(model: nn.Module) -> dict[nn.Module, str]:
    """The quantized Linears GPTQ handles: an enabled weight quantizer and a 2-D weight (a grid GPTQ cannot honour,
    such as a dynamic one, is refused by :func:`~.gptq_solver.grid_for` before any pass)."""
    out: dict[nn.Module, str] = {}
    for name, m in model.named_modules():
        wq, w = getattr(m, "weight_quantizer", None), getattr(m, "weight", None)
        if not isinstance(m, nn.Linear) or wq is None or not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue
        if wq.is_enabled:
            out[m] = name
    return out


def _input_signature(m: nn.Module):
    """What the layer does to its input before the matmul (its input quantizer's state): layers that read one
    tensor share a Hessian only if this is equal."""
    iq = getattr(m, "input_quantizer", None)
    if iq is None:
        return None
    state = tuple((k, tuple(v.shape), v.detach().cpu().numpy().tobytes()) for k, v in iq.state_dict().items())
    return (iq.is_enabled, iq.quant_desc, state)


def _record_groups(model: nn.Module, mods: dict[nn.Module, str], calibrate) -> list[list[nn.Module]]:
    """Run ``calibrate()`` (max calibration) while recording, on its first batch, which candidate layers read the
    same input tensor, in call order. Layers never called are left out."""
    order: list[nn.Module] = []
    by_input: dict[int, list[nn.Module]] = {}
    alive: list[torch.Tensor] = []  # keeps the ids unique during the first pass
    state = {"passes": 0}

    def root_pre(_m, _inp):
        state["passes"] += 1

    def pre(m):
        def hook(_m, inp):
            if state["passes"] != 1 or m in order or not inp or not isinstance(inp[0], torch.Tensor):
                return
            order.append(m)
            by_input.setdefault(id(inp[0]), []).append(m)
            alive.append(inp[0])

        return hook

    handles = [model.register_forward_pre_hook(root_pre)]
    handles += [m.register_forward_pre_hook(pre(m)) for m in mods]
    try:
        calibrate()
    finally:
        for h in handles:
            h.remove()
        alive.clear()
    groups: list[list[nn.Module]] = []
    seen: set = set()
    for m in order:
        if m in seen:
            continue
        same = next(g for g in by_input.values() if m in g)
        for sig in dict.fromkeys(_input_signature(x) for x in same):  # split by input quantizer state
            g = [x for x in same if _input_signature(x) == sig]
            groups.append(g)
            seen.update(g)
    missed = [mods[m] for m in mods if m not in seen]
    if missed:
        log.warning(
            "gptq: %d layer(s) never called by the calibration loop keep max calibration: %s", len(missed), missed
        )
    return groups


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks of the default group (a copy), or ``t`` itself without torch.distributed."""
    if not is_active():
        return t
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buf = t.to(dev, copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(t.device)


def collect_inputs(
    model: nn.Module, layer: nn.Module, forward_loop, block: nn.Module | None = None, cache: Feed | None = None
) -> list[torch.Tensor]:
    """The input of ``layer`` (after its input quantizer), one ``(tokens, features)`` float32 tensor per pass of
    ``forward_loop`` (its first call in each forward; ``block``/``cache`` as :func:`collect_hessian`)."""
    out: list[torch.Tensor] = []

    def hook(m, inp):
        x = inp[0]
        iq = getattr(m, "input_quantizer", None)
        if iq is not None:
            x = iq(x)
        out.append(x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float32, copy=True))

    passes(model, layer, hook, forward_loop, block, cache)
    return out


def collect_hessian(
    model: nn.Module,
    group: list[nn.Module],
    forward_loop,
    label: str,
    block: nn.Module | None = None,
    cache: Feed | None = None,
    cross: dict | None = None,
) -> tuple[torch.Tensor, int]:
    """``(X^T X summed over every token, token count)`` of the group's input, in float64, over ``forward_loop``
    (the first call of the group's first layer in each forward), summed over the distributed ranks.

    With a ``block`` (see :func:`blocks_of`) and a ``cache``: if the cache holds (or, along a chain, can compute)
    that block's inputs, only the block is replayed on them; else the loop runs and the block's inputs are recorded
    into the cache (:func:`~.gptq_passes.passes`).

    ``cross``: ``{"inputs": [X_f per pass]}`` (the float model's inputs of the group, :func:`collect_inputs`); its
    ``"m"`` is set to ``(X_f - X) ^T X`` summed over the tokens (float64, summed over the ranks)."""
    n_in = cast(torch.Tensor, group[0].weight).shape[1]
    h_sum = torch.zeros(n_in, n_in, dtype=torch.float64)
    acc = {"n": 0, "pass": 0}
    if cross is not None:
        cross["m"] = torch.zeros(n_in, n_in, dtype=torch.float64)
    first = group[0]

    def hook(m, inp):
        x = inp[0]
        iq = getattr(m, "input_quantizer", None)
        if iq is not None:
            x = iq(x)
        x = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float64)
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"gptq: the input of {label} contains NaN or Inf")
        h_sum.addmm_(x.t(), x)
        acc["n"] += x.shape[0]
        if cross is not None:
            xf = cross["inputs"][acc["pass"]] if acc["pass"] < len(cross["inputs"]) else None
            if xf is None or xf.shape != x.shape:
                raise ValueError(
                    f"gptq float_target: the calibration loop fed {label} different data than in the float pass "
                    "(the loop must yield the same batches in the same order every time)"
                )
            cross["m"].addmm_(xf.double().sub_(x).t(), x)
        acc["pass"] += 1

    passes(model, first, hook, forward_loop, block, cache)
    h = _sum_over_ranks(h_sum)
    n = int(_sum_over_ranks(torch.tensor([acc["n"]], dtype=torch.float64)).item())
    if cross is not None:
        cross["m"] = _sum_over_ranks(cross["m"])
    return h, n


def _stack_key(m: nn.Module, grid: Grid):
    """Layers of one group with equal keys are solved as one stacked matrix (same per-row grid)."""
    if grid.row_group != 1:
        return id(m)
    return (grid.e4m3, grid.qmin, grid.qmax, grid.bound, grid.col_group)


def solve_group(
    group, names, h, n, *, perc_damp, block_size, desc_act, clip_search=False, scale_refit=0, cross=None
) -> None:
    """GPTQ every layer of ``group`` with the Hessian ``h / n`` and write weights and amaxes back.

    ``cross`` (``(X_f - X)^T X`` summed, see :func:`collect_hessian`): the target is the float model's output
    (:func:`~.gptq_refit.float_target`); ``scale_refit``: rounds of :func:`~.gptq_refit.refine`."""
    label = ", ".join(names[m] for m in group)
    if n == 0:
        log.warning("gptq: %s saw no calibration tokens; keeping max calibration", label)
        return
    factor = hessian_factor(h / n, perc_damp, desc_act, label)
    grids = {m: grid_for(m.weight_quantizer.quant_desc, tuple(m.weight.shape), names[m]) for m in group}
    stacks: dict = {}
    for m in group:
        stacks.setdefault(_stack_key(m, grids[m]), []).append(m)
    for mods in stacks.values():
        w = torch.cat([m.weight.detach().to("cpu", torch.float32) for m in mods], 0)
        rows = [m.weight.shape[0] for m in mods]
        grid = grids[mods[0]]
        if len(mods) > 1:  # one scale per row: the stacked amax is (rows, column groups)
            n_cg = grid.n_groups(w.shape[0], w.shape[1])[1]
            grid = Grid(grid.e4m3, grid.qmin, grid.qmax, grid.bound, 1, grid.col_group, (w.shape[0], n_cg))
        if cross is not None:
            w = float_target(w, h / n, cross / n, perc_damp).float()

        def solve(fixed, w=w, grid=grid):
            return gptq_quantize(
                w,
                h,
                grid,
                block_size=block_size,
                perc_damp=perc_damp,
                desc_act=desc_act,
                clip_search=clip_search,
                label=label,
                factor=factor,
                amax=fixed,
            )

        q, amax = solve(None)
        if scale_refit:
            q, amax = refine(w, h / n, grid, q, amax, scale_refit, solve)
        parts = amax.split(rows, 0) if len(mods) > 1 else [amax]
        for m, qm, am in zip(mods, q.split(rows, 0), parts):
            with torch.no_grad():
                m.weight.copy_(qm.to(m.weight.device, m.weight.dtype))
            m.weight_quantizer.amax = am.reshape(grids[m].amax_shape).to(m.weight.device)


class _FloatTwin:
    """A copy of the model taken before GPTQ changes any weight, its GPTQ layers' weight quantizers disabled: it
    gives each group's inputs as the float model sees them (``float_target``)."""

    def __init__(self, model: nn.Module, mods: dict[nn.Module, str]):
        self.model = copy.deepcopy(model)
        self.by_name = dict(self.model.named_modules())
        for name in mods.values():
            self.by_name[name].weight_quantizer.disable()
        twin_mods = {self.by_name[name]: name for name in mods.values()}
        self.block_of = {twin_mods[m]: blk for m, blk in blocks_of(self.model, twin_mods).items()}
        self.cache = Feed()

    def inputs(self, name: str, forward_loop) -> list[torch.Tensor]:
        layer = self.by_name[name]
        return collect_inputs(self.model, layer, forward_loop, self.block_of[name], self.cache)


@register_algorithm(
    "gptq",
    params=PARAMS,
    check=check_params,
    hint=' ({"method": "gptq"} with a weight config such as INT4_BLOCKWISE_WEIGHT_ONLY_CFG)',
)
def run_gptq(
    model: nn.Module,
    forward_loop,
    calibrate,
    *,
    perc_damp: float = 0.01,
    block_size: int = 128,
    desc_act: bool = False,
    clip_search: bool = False,
    scale_refit: int = 0,
    float_target: bool = False,
) -> None:
    """The config algorithm (see the module docstring)."""
    check_params(
        {
            "perc_damp": perc_damp,
            "block_size": block_size,
            "desc_act": desc_act,
            "clip_search": clip_search,
            "scale_refit": scale_refit,
            "float_target": float_target,
        }
    )
    mods = candidates(model)
    for m, name in mods.items():  # fail before any pass for a grid GPTQ cannot honour
        grid_for(cast(TensorQuantizer, m.weight_quantizer).quant_desc, tuple(cast(torch.Tensor, m.weight).shape), name)
    groups = _record_groups(model, mods, calibrate)
    block_of = blocks_of(model, mods)
    cache = Feed()
    twin = _FloatTwin(model, mods) if float_target else None
    bar = _progress(len(groups))
    try:
        for group in groups:
            label = ", ".join(mods[m] for m in group)
            if bar is not None:
                bar.set_postfix_str(label[-60:], refresh=False)
            cross = None if twin is None else {"inputs": twin.inputs(mods[group[0]], forward_loop)}
            h, n = collect_hessian(model, group, forward_loop, label, block_of[group[0]], cache, cross)
            solve_group(
                group,
                mods,
                h,
                n,
                perc_damp=float(perc_damp),
                block_size=int(block_size),
                desc_act=desc_act,
                clip_search=clip_search,
                scale_refit=int(scale_refit),
                cross=None if cross is None else cross["m"],
            )
            cache.note_changed(group)
            del h, cross
            if bar is not None:
                bar.update(1)
    finally:
        cache.clear()
        if twin is not None:
            twin.cache.clear()
        if bar is not None:
            bar.close()
    log.info("gptq: %d layer(s) in %d group(s) quantized", sum(map(len, groups)), len(groups))


def _progress(total: int):
    """A tqdm bar over the layer groups (None without tqdm; tqdm hides itself when not on a terminal)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc="gptq", leave=False, disable=None)
