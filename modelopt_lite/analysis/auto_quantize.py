"""``auto_quantize``: pick a quantization format per layer under an effective-bits budget (ModelOpt 0.47's API).

Phases, as ModelOpt's:

1. Candidates: for every format, a copy of the model quantized with it everywhere and calibrated with its own
   algorithm (calibration sees float activations, as in :func:`modelopt_lite.quantize`). "Keep float" (ModelOpt's
   ``"NONE"`` recipe) is always a candidate; a ``None`` entry of ``quantization_formats`` is ignored, as there.
2. Scores: per group of layers and format, the estimated loss increase (:mod:`.auto_quantize_scores`:
   ``method="gradient"`` as ModelOpt, ``"layer_error"`` and ``"sensitivity"`` from our analysis tools). As
   ModelOpt, the scores of a group are made non-increasing in bits (formats sorted by bits, each score the min of
   its own and the previous one's; float scores 0).
3. Search: the exact minimum of the total score with effective bits <= the constraint (:mod:`.auto_quantize_search`).
4. The caller's model is converted in place: every quantizer off, then each searched layer gets the calibrated
   quantizers of its chosen format.

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
import fnmatch
import logging
import re
import warnings
from collections.abc import Callable, Iterable
from itertools import islice

import torch
from torch import nn

from ..conversion.algorithm_registry import ALGORITHMS
from ..conversion.config import QuantConfigError, normalize_config
from ..conversion.model_quant import calibrate, quantize
from ..conversion.presets import INT4_BLOCKWISE_WEIGHT_ONLY_CFG, PRESETS
from ..conversion.utils import is_quantizer, named_quantizers
from .auto_quantize_scores import METHODS, ScoreContext
from .auto_quantize_search import solve

log = logging.getLogger(__name__)

#: ModelOpt's name for "keep the layer float" (always a candidate; 16 bits in the cost model)
NONE = "NONE"
FLOAT_BITS = 16

#: layers that must share one format (ModelOpt 0.47's default rules: fused QKV, gate/up and MoE experts)
QUANT_GROUPING_RULES: list = [
    r"^(.*?)\.(q_proj|k_proj|v_proj)$",
    r"^(.*?\.mlp\.experts)\.\d+\.(gate_proj|up_proj|down_proj)$",
    r"^(.*?\.mixer\.experts)\.\d+\.(up_proj|down_proj)$",
    r"^(.*?\.mlp\.experts\.local_experts)\.\d+\.(linear_fc1|linear_fc2)$",
    r"^(.*?)\.(gate_proj|up_proj)$",
    r"^(.*?)\.(\d+\.(w1|w2|w3))$",
    r"^(.*?)\.((w1_linear|w2_linear|w3_linear)\.\d+)$",
]

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


def _format_name(cfg, i: int) -> tuple[str, dict]:
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise QuantConfigError(
                f"auto_quantize: quantization_formats[{i}] {cfg!r} is not a preset name; known: {sorted(PRESETS)}"
            )
        return cfg, PRESETS[cfg]
    if not isinstance(cfg, dict):
        raise QuantConfigError(
            f"auto_quantize: quantization_formats[{i}] must be a config dict, a preset name or None, "
            f"got {type(cfg).__name__}"
        )
    for name, preset in PRESETS.items():
        if cfg == preset:
            return name, cfg
    name = f"CUSTOM_{i}"
    warnings.warn(
        f"auto_quantize: received a custom quantization format; it is shown as {name}", UserWarning, stacklevel=3
    )
    return name, cfg


def _check_formats(quantization_formats) -> dict[str, dict]:
    """``{name: config}`` of the formats to search (None entries dropped, duplicates once)."""
    if quantization_formats is None:
        quantization_formats = [INT4_BLOCKWISE_WEIGHT_ONLY_CFG, PRESETS["FP8_DEFAULT_CFG"]]
    if not isinstance(quantization_formats, list):
        raise QuantConfigError(
            f"auto_quantize: quantization_formats must be a list, got {type(quantization_formats).__name__}"
        )
    if not quantization_formats:
        raise QuantConfigError("auto_quantize: quantization_formats must be a non-empty list")
    out: dict[str, dict] = {}
    for i, cfg in enumerate(quantization_formats):
        if cfg is None:
            continue
        name, cfg = _format_name(cfg, i)
        parsed = normalize_config(cfg, enable_by_default=True)  # raises on a malformed config
        method = parsed.algorithm[0] if parsed.algorithm else None
        if method in ALGORITHMS:
            raise QuantConfigError(
                f"auto_quantize: format {name!r} uses the algorithm {method!r}, which changes the weights; "
                "auto_quantize supports calibration-only algorithms (max, histogram, percentile, mse, entropy)"
            )
        out.setdefault(name, cfg)
    if not out:
        raise QuantConfigError("auto_quantize: quantization_formats must contain at least one non-None format")
    return out


# --- layers, bits and groups ---------------------------------------------------------------------------------------
def _is_quantizer_child(m: nn.Module) -> bool:
    return is_quantizer(m) or (any(True for _ in m.children()) and all(is_quantizer(c) for c in m.children()))


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    """The searchable layers: modules with a ``weight`` tensor whose children are all quantizers (at least one)."""
    out = {}
    for name, m in model.named_modules():
        kids = list(m.children())
        if name and isinstance(getattr(m, "weight", None), torch.Tensor) and kids:
            if all(_is_quantizer_child(k) for k in kids):
                out[name] = m
    return out


def _bits(num_bits) -> int:
    return sum(num_bits) + 1 if isinstance(num_bits, tuple) else int(num_bits)


def layer_bits(layer: nn.Module) -> int:
    """The cost-model bits of a quantized layer: the least ``num_bits`` of its enabled quantizers (16 if none)."""
    bits = [_bits(q.quant_desc.num_bits) for _, q in named_quantizers(layer) if q.is_enabled]
    return min(bits, default=FLOAT_BITS)


def _group_key(name: str) -> str:
    for rule in QUANT_GROUPING_RULES:
        if callable(rule):
            key = rule(name)
        else:
            m = re.match(rule, name)
            key = m.group(1) if m else None
        if key is not None:
            return f"{key}.*"
    return name


def _disabled(name: str, disabled_layers) -> bool:
    pats = [disabled_layers] if isinstance(disabled_layers, str) else list(disabled_layers or [])
    return any(fnmatch.fnmatchcase(name, p) for p in pats)


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
            format.
        quantization_formats: configs (e.g. ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``, ``INT8_DEFAULT_CFG``,
            ``FP8_DEFAULT_CFG``) or preset names; None entries are ignored and "keep float" is always added.
            Default: INT4 blocks of 128 (weight only) and FP8. Algorithms that change weights (smoothquant, ...)
            are refused, as ModelOpt refuses all but max/mse.
        data_loader: batches; the first ``num_calib_steps`` calibrate, the first ``num_score_steps`` score.
        forward_step: ``forward_step(model, batch) -> output``.
        loss_func: ``loss_func(output, batch) -> scalar tensor`` (gradient and sensitivity methods).
        forward_backward_step: ``fn(model, batch)`` running forward and ``backward()`` itself (gradient method,
            instead of ``loss_func``).
        disabled_layers: wildcard(s) of layer names kept float and left out of the search and the cost.
        verbose: log the per-layer table at INFO (library code never prints).
        method: ``"gradient"`` (ModelOpt's), ``"layer_error"`` or ``"sensitivity"`` (see
            :mod:`.auto_quantize_scores`).
        checkpoint, module_search_spaces, fixed_quantization_config: ModelOpt options not supported here (must
            be None).

    Returns:
        ``(model, search_state)``; ``search_state`` holds ``candidate_stats`` (per group: ``formats``, ``bits``,
        ``costs``, ``scores`` (as searched), ``raw_scores``, ``module_names``, ``params``), ``best`` (``recipe``:
        group -> format name, ``layer_recipe``: layer -> format name, ``constraints``: the effective bits reached,
        ``score``, ``is_satisfied``, ``exact``) and ``table`` (one row per group, see :func:`format_table`).

    Raises:
        ValueError: bad constraints, formats, arguments or an unreachable budget (before any calibration).
    """
    for opt, v in (
        ("checkpoint", checkpoint),
        ("module_search_spaces", module_search_spaces),
        ("fixed_quantization_config", fixed_quantization_config),
    ):
        if v is not None:
            raise NotImplementedError(f"auto_quantize: {opt} is not supported by modelopt_lite (give None)")
    eff_bits = _check_constraints(constraints)
    formats = _check_formats(quantization_formats)
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
    if data_loader is None:
        raise ValueError("auto_quantize: data_loader must be given")
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_quantize expects an nn.Module, got {type(model).__name__}")
    batches = list(islice(iter(data_loader), max(num_calib_steps, num_score_steps)))
    if not batches:
        raise ValueError("auto_quantize: data_loader yielded no batch")

    ref = quantize(copy.deepcopy(model), _ALL_OFF).eval()
    cands = {f: quantize(copy.deepcopy(ref), {**cfg, "algorithm": None}) for f, cfg in formats.items()}
    groups, gformats, stats = _candidate_setup(ref, cands, disabled_layers)
    total = sum(s["params"] for s in stats.values())
    min_bits = sum(min(s["costs"]) for s in stats.values()) / total
    if eff_bits < min_bits - 1e-12:
        raise ValueError(
            f"auto_quantize: effective_bits {eff_bits} is below the least reachable, {min_bits:.4f} "
            f"(every layer in its cheapest format)"
        )
    for f, cfg in formats.items():
        _calibrate(cands[f], cfg, forward_step, batches[:num_calib_steps])
    ctx = ScoreContext(
        ref, cands, groups, gformats, batches[:num_score_steps], forward_step, loss_func, forward_backward_step
    )
    raw = score_fn(ctx)
    for g, s in stats.items():
        s["raw_scores"] = [raw[g].get(f, 0.0) for f in s["formats"]]
        s["scores"], prev = [], float("inf")
        for v in s["raw_scores"]:  # formats by bits, float last: non-increasing scores (as ModelOpt)
            prev = min(v, prev)
            s["scores"].append(prev)
    sol = solve([s["scores"] for s in stats.values()], [s["costs"] for s in stats.values()], eff_bits * total)
    recipe = {g: stats[g]["formats"][k] for g, k in zip(stats, sol.choice)}
    model = _apply(model, cands, groups, recipe)
    state = _search_state(method, eff_bits, formats, stats, recipe, sol, total)
    level = logging.INFO if verbose else logging.DEBUG
    if log.isEnabledFor(level):
        for line in format_table(state).splitlines():
            log.log(level, "auto_quantize: %s", line)
    return model, state


def _candidate_setup(ref, cands, disabled_layers):
    """Groups, their formats and candidate stats (formats sorted by bits, float last; costs = numel * bits)."""
    layers = [n for n in _layers(ref) if not _disabled(n, disabled_layers)]
    groups: dict[str, list[str]] = {}
    for n in layers:
        groups.setdefault(_group_key(n), []).append(n)
    gformats: dict[str, list[str]] = {}
    stats: dict[str, dict] = {}
    for g, names in groups.items():
        numel = {n: ref.get_submodule(n).weight.numel() for n in names}
        bits = {f: {n: layer_bits(c.get_submodule(n)) for n in names} for f, c in cands.items()}
        fmts = [f for f in cands if any(b < FLOAT_BITS for b in bits[f].values())]
        if not fmts:  # no format quantizes it (e.g. an Embedding, off in every preset): not searched, not counted
            continue
        fmts.sort(key=lambda f: (sum(numel[n] * bits[f][n] for n in names), f))
        gformats[g] = fmts
        stats[g] = {
            "formats": [*fmts, NONE],
            "bits": [min(bits[f].values()) for f in fmts] + [FLOAT_BITS],
            "costs": [float(sum(numel[n] * bits[f][n] for n in names)) for f in fmts]
            + [float(FLOAT_BITS * sum(numel.values()))],
            "module_names": list(names),
            "params": sum(numel.values()),
        }
    if not stats:
        raise ValueError("auto_quantize: no layer of the model is quantized by any of the formats: nothing to search")
    return {g: groups[g] for g in stats}, gformats, stats


def _calibrate(q: nn.Module, cfg: dict, forward_step: Callable, batches: list) -> None:
    """Calibrate a candidate with its format's algorithm, exactly as quantize() would (calibration-only ones)."""
    alg = normalize_config(cfg, enable_by_default=True).algorithm
    if alg is None:
        return

    def loop(m):
        was = [(x, x.training) for x in m.modules()]
        m.eval()
        try:
            with torch.no_grad():
                for b in batches:
                    forward_step(m, b)
        finally:
            for x, t in was:
                x.train(t)

    method, params = alg
    calibrate(q, None if method == "max" else method, loop, **params)


def _apply(model: nn.Module, cands, groups, recipe) -> nn.Module:
    """Convert ``model`` in place with every quantizer off, then give each layer its format's calibrated ones."""
    model = quantize(model, _ALL_OFF)
    for g, f in recipe.items():
        if f == NONE:
            continue
        for n in groups[g]:
            layer, src = model.get_submodule(n), cands[f].get_submodule(n)
            for child, q in src.named_children():
                if _is_quantizer_child(q):
                    setattr(layer, child, copy.deepcopy(q))
    return model


def _search_state(method, eff_bits, formats, stats, recipe, sol, total) -> dict:
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
        "quantization_formats": list(formats),
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
    fmts = [*search_state["quantization_formats"], NONE]
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
