"""``auto_quantize``: pick a quantization format per layer under an effective-bits budget (ModelOpt 0.47's API).

Phases, as ModelOpt's:

1. Candidates: for every format, a copy of the model quantized with it everywhere and calibrated with its own
   algorithm (calibration sees float activations, as in :func:`modelopt_lite.quantize`); algorithms that change the
   weights (SmoothQuant, AWQ, SVDQuant, GPTQ) included: a layer takes its weight, buffers and quantizers from its
   format's copy (:mod:`.auto_quantize_recipes`). "Keep float" (ModelOpt's
   ``"NONE"`` recipe) is always a candidate; a ``None`` entry of ``quantization_formats`` is ignored, as there.
   Which groups may use which formats, and a fixed PTQ baseline for the others: :mod:`.auto_quantize_spaces`
   (``module_search_spaces``, ``fixed_quantization_config``).
2. Scores: per group of layers and format, the estimated loss increase (:mod:`.auto_quantize_scores`:
   ``method="gradient"`` and ``"kl_div"`` as ModelOpt, ``"layer_error"`` and ``"sensitivity"`` from our analysis
   tools). As ModelOpt, the scores of a group are made non-increasing in bits (formats sorted by bits, each score
   the min of its own and the previous one's; float scores 0). ``checkpoint`` keeps them in a JSON file
   (:mod:`.auto_quantize_checkpoint`) so another budget re-solves without scoring.
3. Search: the exact minimum of the total score with effective bits <= the constraint (:mod:`.auto_quantize_search`),
   for every method (ModelOpt searches ``kl_div`` by a threshold bisection that minimises the largest score).
4. The caller's model is converted in place: every quantizer off (or set by the fixed baseline), then each
   searched layer gets the calibrated quantizers of its chosen format.

Effective bits (ModelOpt's weight cost model): over the searched layers ``l`` (those with a ``weight`` and
quantizers that at least one format enables: Linear, Conv, ...; not Embeddings, off in every preset),
``sum_l numel(W_l) * bits_l / sum_l numel(W_l)`` with ``bits_l = 16`` for a float layer and, for a quantized one,
the least ``num_bits`` of its enabled quantizers (FP8 ``(E, M)`` counts ``E + M + 1``); block scales are not
counted (INT4 blocks of 128 = 4 bits).

Groups: layers that must share a format, from :data:`QUANT_GROUPING_RULES` (ModelOpt's rules: a regex whose first
group is the key, or ``fn(name) -> key | None``); append to it to add a rule.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable
from itertools import islice

from torch import nn

from ..conversion.model_quant import quantize
from .auto_quantize_checkpoint import load_checkpoint, save_checkpoint
from .auto_quantize_recipes import (
    Fold,
    Key,
    calibrate_candidate,
    check_changes,
    folds_into_layers,
    install,
    place,
    scoring_views,
)
from .auto_quantize_scores import METHODS, ScoreContext
from .auto_quantize_search import solve
from .auto_quantize_spaces import (
    FLOAT_BITS,
    NONE,
    QUANT_GROUPING_RULES,
    check_options,
    layer_bits,
    resolve_groups,
    searchable_layers,
    signature,
)

__all__ = ["NONE", "QUANT_GROUPING_RULES", "auto_quantize", "format_table", "layer_bits"]

log = logging.getLogger(__name__)

_CONSTRAINT_KEYS = {"effective_bits", "cost_model", "cost"}
_ALL_OFF = {"quant_cfg": {"*": {"enable": False}}, "algorithm": None}


# --- inputs --------------------------------------------------------------------------------------------------------
def _check_constraints(constraints) -> float:
    if constraints is None:
        constraints = {"effective_bits": 4.8}
    if not isinstance(constraints, dict) or "effective_bits" not in constraints:
        raise ValueError(f"auto_quantize: constraints must be a dict with 'effective_bits', got {constraints!r}")
    extra = sorted(map(str, set(constraints) - _CONSTRAINT_KEYS))
    if extra:
        raise ValueError(f"auto_quantize: unknown constraint key(s) {extra}; allowed: {sorted(_CONSTRAINT_KEYS)}")
    if constraints.get("cost_model", "weight") != "weight":
        raise ValueError(f"auto_quantize: cost_model {constraints['cost_model']!r} is not supported (only 'weight')")
    eb = constraints["effective_bits"]
    if isinstance(eb, bool) or not isinstance(eb, (int, float)) or not 0 < eb <= FLOAT_BITS:
        raise ValueError(f"auto_quantize: constraints['effective_bits'] must be a number in (0, 16], got {eb!r}")
    return float(eb)


# --- the API -------------------------------------------------------------------------------------------------------
def auto_quantize(
    model: nn.Module,
    constraints: dict | None = None,
    quantization_formats: list | None = None,
    data_loader: Iterable | None = None,
    forward_step: Callable | None = None,
    loss_func: Callable | None = None,
    forward_backward_step: Callable | None = None,
    disabled_layers: list[str] | str | None = None,
    num_calib_steps: int = 512,
    num_score_steps: int = 128,
    verbose: bool = False,
    method: str = "gradient",
    checkpoint: str | None = None,
    module_search_spaces: list | None = None,
    fixed_quantization_config: dict | None = None,
):
    """Search the best quantization format per layer under ``constraints["effective_bits"]`` (ModelOpt's API).

    Args:
        model: a float model; converted in place (as :func:`modelopt_lite.quantize`) and returned.
        constraints: ``{"effective_bits": b}`` with ``0 < b <= 16`` (default 4.8); ``"cost_model"`` may only be
            ``"weight"``. ``b`` must be reachable: at least the effective bits with every layer in its cheapest
            allowed format.
        quantization_formats: configs (e.g. ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``, ``INT8_DEFAULT_CFG``,
            ``FP8_DEFAULT_CFG``) or preset names; None entries are ignored and "keep float" is always added.
            Default: INT4 blocks of 128 (weight only) and FP8 (none with ``fixed_quantization_config``).
            A format's algorithm may change weights (SmoothQuant, AWQ, SVDQuant, GPTQ): each format is calibrated
            on its own copy and a layer takes all its state from its format's (:mod:`.auto_quantize_recipes`).
        data_loader: batches; the first ``num_calib_steps`` calibrate, the first ``num_score_steps`` score.
        forward_step: ``forward_step(model, batch) -> output`` (the logits for ``method="kl_div"``).
        loss_func: ``loss_func(output, batch) -> scalar tensor`` (gradient and sensitivity methods).
        forward_backward_step: ``fn(model, batch)`` running forward and ``backward()`` itself (gradient method,
            instead of ``loss_func``).
        disabled_layers: wildcard(s) of layer names kept float and left out of the search and the cost.
        verbose: log the per-layer table at INFO (library code never prints).
        method: ``"gradient"`` or ``"kl_div"`` (ModelOpt's), ``"layer_error"`` or ``"sensitivity"`` (see
            :mod:`.auto_quantize_scores`). Every method is searched exactly (minimum total score in budget).
        checkpoint: a JSON file: loaded instead of scoring when it exists, written after scoring otherwise
            (:mod:`.auto_quantize_checkpoint`; it must match this search, else ValueError).
        module_search_spaces, fixed_quantization_config: per-layer candidates and a fixed PTQ baseline, with
            ModelOpt's meaning (:mod:`.auto_quantize_spaces`).

    Returns:
        ``(model, search_state)``; ``search_state`` holds ``candidate_stats`` (per group: ``formats``, ``bits``,
        ``costs``, ``scores`` (as searched), ``raw_scores``, ``module_names``, ``params``, ``fixed``,
        ``allow_no_quant``, ``search_space``), ``best`` (``recipe``: group -> format name, ``layer_recipe``:
        layer -> format name, ``constraints``: the effective bits reached, ``score``, ``is_satisfied``,
        ``exact``), ``restored`` (the scores came from ``checkpoint``) and ``table`` (see :func:`format_table`).

    Raises:
        ValueError: bad constraints, formats, arguments, a corrupted checkpoint or one of another search, or an
            unreachable budget (before any calibration or scoring); a format whose algorithm changes a module
            other than the searched layers (AWQ's folds excepted) or a layer's tensor layout (at its calibration).
    """
    eff_bits = _check_constraints(constraints)
    opts = check_options(quantization_formats, module_search_spaces, fixed_quantization_config)
    if method not in METHODS:
        raise ValueError(f"auto_quantize: invalid method {method!r}; valid options: {sorted(METHODS)}")
    score_fn, needs_loss = METHODS[method]
    if not callable(forward_step):
        raise ValueError("auto_quantize: forward_step(model, batch) must be given")
    if needs_loss and loss_func is None and forward_backward_step is None:
        raise ValueError(f"auto_quantize: method {method!r} needs loss_func or forward_backward_step")
    for opt, n in (("num_calib_steps", num_calib_steps), ("num_score_steps", num_score_steps)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"auto_quantize: {opt} must be an int >= 1, got {n!r}")
    if checkpoint is not None and (not isinstance(checkpoint, (str, os.PathLike)) or os.path.isdir(checkpoint)):
        raise ValueError(f"auto_quantize: checkpoint must be a file path, got {checkpoint!r}")
    if data_loader is None:
        raise ValueError("auto_quantize: data_loader must be given")
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_quantize expects an nn.Module, got {type(model).__name__}")
    batches = list(islice(iter(data_loader), max(num_calib_steps, num_score_steps)))
    if not batches:
        raise ValueError("auto_quantize: data_loader yielded no batch")

    ref = quantize(copy.deepcopy(model), _ALL_OFF).eval()
    cands = {f: quantize(copy.deepcopy(ref), {**cfg, "algorithm": None}) for f, cfg in opts.candidates.items()}
    fixed_model = quantize(copy.deepcopy(ref), {**opts.fixed[1], "algorithm": None}) if opts.fixed else None
    groups, gformats, stats = resolve_groups(ref, cands, fixed_model, opts, disabled_layers)
    total = sum(s["params"] for s in stats.values())
    min_bits = sum(min(s["costs"]) for s in stats.values()) / total
    if eff_bits < min_bits - 1e-12:
        raise ValueError(
            f"auto_quantize: effective_bits {eff_bits} is below the least reachable, {min_bits:.4f} "
            f"(every layer in its cheapest allowed format)"
        )
    calib = _Calibrator(ref, cands, opts, fixed_model, {n for g in stats for n in groups[g]})
    calib.data = (forward_step, batches[:num_calib_steps])
    sigs = {f: signature(cfg) for f, cfg in opts.candidates.items()}
    fixed_sig = (opts.fixed[0], signature(opts.fixed[1])) if opts.fixed else None
    restored = checkpoint is not None and os.path.exists(checkpoint)
    if restored:
        raw = load_checkpoint(checkpoint, method, sigs, fixed_sig, stats)
        log.info("auto_quantize: scores restored from %s", checkpoint)
    else:
        calib.run({f for fs in gformats.values() for f in fs} | _fixed_formats(stats))
        base = _base(ref, calib, groups, stats)
        ctx = ScoreContext(
            base,
            cands,
            {g: groups[g] for g in gformats},
            gformats,
            batches[:num_score_steps],
            forward_step,
            loss_func,
            forward_backward_step,
            scoring_views(cands, calib.folds),
        )
        scores = score_fn(ctx)
        raw = {g: [scores.get(g, {}).get(f, 0.0) for f in s["formats"]] for g, s in stats.items()}
    for g, s in stats.items():
        s["raw_scores"] = raw[g]
        s["scores"], prev = [], float("inf")
        for v in s["raw_scores"]:  # formats by bits, float last: non-increasing scores (as ModelOpt)
            prev = min(v, prev)
            s["scores"].append(prev)
    if checkpoint is not None and not restored:
        save_checkpoint(checkpoint, method, sigs, fixed_sig, stats)
    sol = solve([s["scores"] for s in stats.values()], [s["costs"] for s in stats.values()], eff_bits * total)
    recipe = {g: stats[g]["formats"][k] for g, k in zip(stats, sol.choice)}
    calib.run({f for g, f in recipe.items() if f in cands and not _by_config(stats[g])})
    model = _apply(model, opts, ref, calib, groups, stats, recipe)
    state = _search_state(method, eff_bits, opts, stats, recipe, sol, total)
    state["restored"] = restored
    level = logging.INFO if verbose else logging.DEBUG
    if log.isEnabledFor(level):
        for line in format_table(state).splitlines():
            log.log(level, "auto_quantize: %s", line)
    return model, state


def _by_config(s: dict) -> bool:
    """A group fixed by ``fixed_quantization_config`` (not by a one-format search space)."""
    return s["fixed"] and s["search_space"] is None


def _fixed_formats(stats) -> set[str]:
    return {s["formats"][0] for s in stats.values() if s["fixed"] and not _by_config(s)}


class _Calibrator:
    """Calibrates each candidate (and the fixed baseline, first) once, when first needed, with its own algorithm
    (:mod:`.auto_quantize_recipes`); keeps the AWQ folds of each and the models as ``srcs`` (None: the baseline).

    A format whose AWQ folded a scale into a searched Linear is calibrated again on a fresh copy with
    ``fold_linear=False`` (that scale kept as the consumer's ``pre_quant_scale``): a layer's state must not hold
    another layer's scale."""

    def __init__(self, ref, cands, opts, fixed_model, grouped: set[str]):
        self.ref, self.cands, self.opts, self.grouped, self.fixed_model = ref, cands, opts, grouped, fixed_model
        self.folds: dict[Key, dict[str, Fold]] = {}
        self.data: tuple[Callable, list] = (lambda m, b: None, [])  # (forward_step, calibration batches)

    @property
    def srcs(self) -> dict[Key, nn.Module]:
        return {**self.cands, **({None: self.fixed_model} if self.fixed_model is not None else {})}

    def run(self, formats: set[str]) -> None:
        todo: list[Key] = [None] if self.fixed_model is not None and None not in self.folds else []
        for key in [*todo, *sorted(formats - set(self.folds))]:
            name, cfg = self.opts.fixed if key is None else (key, self.opts.candidates[key])
            what = f"fixed_quantization_config {name!r}" if key is None else f"format {name!r}"
            q = self.srcs[key]
            folds = calibrate_candidate(q, cfg, *self.data)
            if folds_into_layers(folds, self.grouped):
                q = quantize(copy.deepcopy(self.ref), {**cfg, "algorithm": None})
                folds = calibrate_candidate(q, cfg, *self.data, fold_linear=False)
                if key is None:
                    self.fixed_model = q
                else:
                    self.cands[key] = q
            check_changes(self.ref, q, folds, self.grouped, what)
            self.folds[key] = folds


def _base(ref, calib: _Calibrator, groups, stats) -> nn.Module:
    """The model scores are measured on: float layers, except the fixed groups in their fixed format."""
    base = copy.deepcopy(calib.srcs.get(None, ref))
    by_config = {n for g, s in stats.items() if _by_config(s) for n in groups[g]}
    for name in searchable_layers(ref):
        if name not in by_config:
            install(base, ref, name)  # searched, space-fixed and disabled layers start float
    place(base, ref, calib.srcs, calib.folds, _layer_src(groups, stats, None))
    return base


def _layer_src(groups, stats, recipe) -> dict[str, Key]:
    """layer -> the model it takes its state from: the baseline (None) for the config-fixed groups, the format for
    the space-fixed ones and (``recipe`` given) the chosen format of the searched ones (float: not listed)."""
    out: dict[str, Key] = {}
    for g, s in stats.items():
        key = None if _by_config(s) else s["formats"][0] if s["fixed"] else recipe.get(g) if recipe else NONE
        if key != NONE:
            out.update(dict.fromkeys(groups[g], key))
    return out


def _apply(model: nn.Module, opts, ref, calib: _Calibrator, groups, stats, recipe) -> nn.Module:
    """Convert ``model`` in place like the baseline, copy its quantizers, then each layer's chosen state."""
    model = quantize(model, _ALL_OFF)
    if opts.fixed:
        model = quantize(model, {**opts.fixed[1], "algorithm": None})
    install(model, _base(ref, calib, groups, stats))  # the quantizers only (attention matmuls of the baseline, ...)
    place(model, ref, calib.srcs, calib.folds, _layer_src(groups, stats, recipe))
    return model


def _search_state(method, eff_bits, opts, stats, recipe, sol, total) -> dict:
    rows = []
    for g, s in stats.items():
        k = s["formats"].index(recipe[g])
        rows.append(
            {
                "group": g,
                "modules": s["module_names"],
                "params": s["params"],
                "format": recipe[g],
                "bits": s["costs"][k] / s["params"],
                "scores": dict(zip(s["formats"], s["raw_scores"])),
            }
        )
    return {
        "method": method,
        "constraints": {"effective_bits": eff_bits},
        "quantization_formats": list(opts.candidates),
        "fixed_quantization_config": opts.fixed[0] if opts.fixed else None,
        "candidate_stats": stats,
        "best": {
            "recipe": dict(recipe),
            "layer_recipe": {n: recipe[g] for g, s in stats.items() for n in s["module_names"]},
            "constraints": {"effective_bits": sol.cost / total},
            "score": sol.score,
            "is_satisfied": sol.cost <= eff_bits * total,
            "exact": sol.exact,
        },
        "total_params": total,
        "table": rows,
    }


def format_table(search_state: dict) -> str:
    """The per-group table of an ``auto_quantize`` search state: name, chosen format, bits, score per format."""
    rows = search_state["table"]
    fixed = search_state.get("fixed_quantization_config")
    fmts = [*search_state["quantization_formats"], *([fixed] if fixed else []), NONE]
    fmts = list(dict.fromkeys(fmts))
    head = ["layer", "params", "format", "bits", *(f"score[{f}]" for f in fmts)]
    table = [head] + [
        [
            r["group"],
            str(r["params"]),
            r["format"],
            f"{r['bits']:.3g}",
            *(f"{r['scores'][f]:.4g}" if f in r["scores"] else "-" for f in fmts),
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    best = search_state["best"]
    lines.append(
        f"effective bits {best['constraints']['effective_bits']:.4f} (constraint "
        f"{search_state['constraints']['effective_bits']}), total score {best['score']:.6g}"
        + ("" if best["exact"] else " (costs rounded: near-optimal)")
    )
    return "\n".join(lines)
