"""AWQ (activation-aware weight quantization) for low-bit weights: ``awq_lite``, ``awq_clip`` and ``awq_full``.

- ``awq_lite``: per quantized ``Linear``, a per-input-channel scale ``s`` searched over an alpha grid from the
  activation and weight magnitudes (:mod:`.awq_search`); the weight becomes ``W * s`` and the input is multiplied by
  ``1 / s``: folded into the op that produces it where that op is a LayerNorm/RMSNorm/Linear whose output feeds only
  the scaled layers (:mod:`.awq_fold`), else kept as the input quantizer's ``pre_quant_scale`` (exported as a
  ``Mul``). Parameters (ModelOpt's): ``alpha_step`` (0.1), ``debug`` (False); ours: ``fold_linear`` (True; False
  keeps the scale a producing Linear would take as ``pre_quant_scale`` instead; norms still absorb theirs).
- ``awq_clip``: per block of the weight, the clipped amax (a ratio of the block max) with the least error of the
  block's partial outputs. Parameters (ModelOpt's): ``max_co_batch_size`` (1024 output rows scored at once),
  ``max_tokens_per_batch`` (None: every token; a number keeps that many evenly strided tokens of each batch, as
  ModelOpt, whose default is 64), ``min_clip_ratio`` (0.5), ``shrink_step`` (0.05), ``debug``.
- ``awq_full``: both, the clip search on the scaled weights.

Every parameter of every layer is scored on all calibration tokens at once (see :mod:`.awq_stats`), from the
activations of the float model, one block at a time (:mod:`.awq_plan`): one pass of the loop probes the model (call
order and fold groups from its first forward, which ModuleLists are chains of blocks, the inputs of each chain's
first block), then a chain of transformer blocks costs one replay of each block, every other layer group one pass;
each block's statistics are searched (:mod:`.awq_decide`) and dropped before the next block's are gathered, so at
most one block's ``X^T X`` matrices exist at once. The model changes only after every search (the decisions are
applied in order at the end), so the results are those of one float pass over the whole model. The loop runs once
more inside a max calibration only when some input or output quantizer needs calibrating (weight-only configs
calibrate the weights directly). Under ``torch.distributed`` each unit's statistics are summed over the ranks, so
ranks that split the data agree with one process. Every pass runs the loop to its end and every call of the model
returns its real (float) output to the loop. ``progress`` (ours, default True) shows a per-layer bar on a terminal. With ``debug=True`` each layer keeps its
search record as ``module.awq_lite`` / ``module.awq_clip`` (:class:`LiteRecord`, :class:`ClipRecord`).

A weight quantizer that is a :class:`~modelopt_lite.nn.SequentialQuantizer` (``W4A8_AWQ_BETA_CFG``) is searched with
its first member (as ModelOpt does); the others are calibrated on the final weight. Use through
``quantize(model, INT4_AWQ_CFG, loop)`` or :func:`awq` on a model whose quantizers are configured.
"""

from __future__ import annotations

import logging
import numbers
from typing import cast

from torch import nn

from ..conversion.algorithm_registry import register_algorithm
from ..conversion.model_quant import calibrate as _calibrate
from ..conversion.utils import named_quantizers
from ..nn import TensorQuantizer
from . import awq_fold, awq_plan, awq_search, awq_stats
from .awq_decide import ClipRecord, Decider, LiteRecord, search_quantizer  # noqa: F401 (records re-exported)

log = logging.getLogger(__name__)

LITE_PARAMS = ("alpha_step", "debug", "progress", "fold_linear")
CLIP_PARAMS = ("max_co_batch_size", "max_tokens_per_batch", "min_clip_ratio", "shrink_step", "debug", "progress")
DEFAULTS = {
    "alpha_step": 0.1,
    "max_co_batch_size": 1024,
    "max_tokens_per_batch": None,
    "min_clip_ratio": 0.5,
    "shrink_step": 0.05,
    "debug": False,
    "progress": True,
    "fold_linear": True,
}


# --- parameters ----------------------------------------------------------------------------------------------------
def _number(name, v, lo, hi, lo_open, hi_open) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"awq: {name} must be a number, got {type(v).__name__} {v!r}")
    v = float(v)
    ok = (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"awq: {name} must be in {rng}, got {v!r}")
    return v


def _count(name, v, allow_none=False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or int(v) < 1:
        raise ValueError(f"awq: {name} must be an integer >= 1{' or None' if allow_none else ''}, got {v!r}")
    return int(v)


def check_params(params: dict) -> dict:
    """The parameters with defaults filled in and types checked (ValueError/TypeError naming the bad one)."""
    p = {**DEFAULTS, **params}
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"awq: unknown parameter(s) {sorted(unknown)}; accepted: {sorted(DEFAULTS)}")
    p["alpha_step"] = _number("alpha_step", p["alpha_step"], 0.0, 1.0, True, False)
    p["min_clip_ratio"] = _number("min_clip_ratio", p["min_clip_ratio"], 0.0, 1.0, True, True)
    p["shrink_step"] = _number("shrink_step", p["shrink_step"], 0.0, 1.0, True, False)
    p["max_co_batch_size"] = _count("max_co_batch_size", p["max_co_batch_size"])
    p["max_tokens_per_batch"] = _count("max_tokens_per_batch", p["max_tokens_per_batch"], allow_none=True)
    for flag in ("debug", "progress", "fold_linear"):
        if not isinstance(p[flag], bool):
            raise TypeError(f"awq: {flag} must be True or False, got {p[flag]!r}")
    return p


# --- which layers --------------------------------------------------------------------------------------------------
def candidates(model: nn.Module, clip: bool) -> dict[str, nn.Module]:
    """Quantized Linears AWQ can work on: an enabled fake-quant weight quantizer on a 2-D weight (clip: static blocks
    along the input axis). Others are left to the plain max calibration (logged)."""
    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not hasattr(m, "weight_quantizer") or not hasattr(m, "input_quantizer"):
            continue
        wq = search_quantizer(m)
        if not isinstance(wq, TensorQuantizer) or not wq.is_enabled or m.weight.dim() != 2:
            continue
        if not wq.quant_desc.fake_quant:
            log.info("awq: %s skipped: its weight quantizer returns integer codes (fake_quant=False)", name)
            continue
        bs = awq_search.block_size(wq, name)
        if clip and (bs is None or wq.dynamic):
            log.info("awq_clip: %s skipped: its weight quantizer has no static blocks", name)
            continue
        out[name] = m
    return out


# --- the algorithm -------------------------------------------------------------------------------------------------
def awq(
    model: nn.Module,
    forward_loop,
    algorithm: str = "awq_lite",
    *,
    calibrate=None,
    holder: awq_stats.StatsHolder | None = None,
    **params,
) -> dict:
    """Run AWQ (``"awq_lite"``, ``"awq_clip"`` or ``"awq_full"``) on ``model``'s quantized Linears, then calibrate.

    ``forward_loop(model)`` runs the calibration data. ``calibrate`` (a no-argument callable running the loop inside
    a max calibration) defaults to ``modelopt_lite.calibrate(model, None, forward_loop)``. Returns
    ``{layer path: {"awq_lite": LiteRecord, "awq_clip": ClipRecord}}`` for the layers it changed. The model's float
    weights (and folded norms) change in place; :func:`modelopt_lite.quantize` puts everything back if this raises.
    ``holder``: the :class:`~.awq_stats.StatsHolder` that keeps the statistics (its ``peak`` tells the most
    statistic numbers alive at once); a new one by default.
    """
    if algorithm not in ("awq_lite", "awq_clip", "awq_full"):
        raise ValueError(f"awq: algorithm must be 'awq_lite', 'awq_clip' or 'awq_full', got {algorithm!r}")
    if not callable(forward_loop):
        raise TypeError(f"awq needs a forward_loop callable, got {type(forward_loop).__name__}")
    p = check_params(params)
    lite, clip = algorithm in ("awq_lite", "awq_full"), algorithm in ("awq_clip", "awq_full")
    mods = candidates(model, clip=clip and not lite)
    records: dict[str, dict] = {}
    if mods:
        records = _search(model, mods, forward_loop, p, lite, clip, holder or awq_stats.StatsHolder())
        _reset(mods, records)
    else:
        log.info("awq: no quantized Linear with an enabled weight quantizer")
    _calibrate_after(model, forward_loop, calibrate)
    for name, rec in records.items():
        if "awq_clip" in rec:
            search_quantizer(mods[name]).amax = rec["awq_clip"].amax
        if p["debug"]:
            for k, v in rec.items():
                setattr(mods[name], k, v)
    log.info("%s: %d layer(s) changed", algorithm, len(records))
    return records


def _search(model, mods, forward_loop, p, lite: bool, clip: bool, holder) -> dict[str, dict]:
    """Probe, plan, gather unit by unit while searching, then apply every decision (see :mod:`.awq_plan`)."""
    trace = awq_fold.Tracer(model, mods, fold_linear=p["fold_linear"]) if lite else None
    pr = awq_plan.probe(model, mods, forward_loop, trace)
    found = trace.groups() if trace is not None else [([n], None) for n in mods]
    plan = awq_plan.make_plan(model, mods, [(names, prod and prod[0]) for names, prod in found], pr)
    plan = awq_plan.agree(plan)
    producers = trace.producers if trace is not None else {}
    groups = [(list(names), None if pn is None else (pn, *producers[pn])) for names, pn in plan.groups]
    decider = Decider(mods, groups, p, lite, clip, holder)
    mt = p["max_tokens_per_batch"] if clip else None
    units = awq_plan.gather(model, mods, forward_loop, plan, holder, mt, probed=pr)
    for _names, stats in _progress(units, p["progress"], decider.desc, sum(len(it.units) for it in plan.items)):
        decider.add(stats)
    return decider.apply()


def _progress(items, enabled: bool, desc: str, total: int):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=f"{desc}: blocks", leave=False, disable=None, total=total)


def _reset(mods, records) -> None:
    """Forget the amax of the changed layers' weight and input quantizers (their tensors changed)."""
    for n in records:
        m = mods[n]
        m.weight_quantizer.reset_amax()
        if "awq_lite" in records[n] and m.input_quantizer.is_enabled and m.input_quantizer.amax is not None:
            if m.input_quantizer.quant_desc.amax is None:
                m.input_quantizer.reset_amax()


def _weight_owner(model: nn.Module) -> dict[int, nn.Module]:
    """id(quantizer) -> its Linear for every weight quantizer (members of a SequentialQuantizer included)."""
    out: dict[int, nn.Module] = {}
    for m in model.modules():
        wq = getattr(m, "weight_quantizer", None)
        if isinstance(m, nn.Linear) and wq is not None:
            for q in wq.modules():
                out[id(q)] = m
    return out


def _calibrate_after(model: nn.Module, forward_loop, calibrate) -> None:
    """The max calibration of every quantizer that needs one: without the data when only Linear weights do."""
    owners = _weight_owner(model)
    todo: list[TensorQuantizer] = []
    for _, q in named_quantizers(model):
        assert isinstance(q, TensorQuantizer)
        if q.is_enabled and not q.quant_desc.dynamic and q.amax is None and q.quant_desc.amax is None:
            todo.append(q)
    if all(id(q) in owners for q in todo):
        linears = {id(owners[id(q)]): owners[id(q)] for q in todo}

        def feed(_m):
            for lin in linears.values():
                cast(nn.Module, lin.weight_quantizer)(lin.weight)

        if todo:
            _calibrate(model, None, forward_loop=feed)
        return
    if calibrate is not None:
        calibrate()
    else:
        _calibrate(model, None, forward_loop=forward_loop)


def _run(algorithm: str):
    def run(model: nn.Module, forward_loop, calibrate, **params) -> None:
        awq(model, forward_loop, algorithm, calibrate=calibrate, **params)

    return run


def _checker(allowed: tuple[str, ...], algorithm: str):
    def check(params: dict) -> None:
        extra = set(params) - set(allowed)
        if extra:
            raise ValueError(f"{algorithm}: unknown parameter(s) {sorted(extra)}; accepted: {sorted(allowed)}")
        check_params(params)

    return check


_HINT = " (INT4_AWQ_CFG), or awq(model, forward_loop, algorithm) on a configured model"
for _name, _params in (
    ("awq_lite", LITE_PARAMS),
    ("awq_clip", CLIP_PARAMS),
    ("awq_full", tuple(dict.fromkeys(LITE_PARAMS + CLIP_PARAMS))),
):
    register_algorithm(_name, params=_params, check=_checker(_params, _name), hint=_HINT)(_run(_name))
