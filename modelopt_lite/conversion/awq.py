"""AWQ (activation-aware weight quantization) for low-bit weights: ``awq_lite``, ``awq_clip`` and ``awq_full``.

- ``awq_lite``: per quantized ``Linear``, a per-input-channel scale ``s`` searched over an alpha grid from the
  activation and weight magnitudes (:mod:`.awq_search`); the weight becomes ``W * s`` and the input is multiplied by
  ``1 / s``: folded into the op that produces it where that op is a LayerNorm/RMSNorm/Linear whose output feeds only
  the scaled layers (:mod:`.awq_fold`), else kept as the input quantizer's ``pre_quant_scale`` (exported as a
  ``Mul``). Parameters (ModelOpt's): ``alpha_step`` (0.1), ``debug`` (False).
- ``awq_clip``: per block of the weight, the clipped amax (a ratio of the block max) with the least error of the
  block's partial outputs. Parameters (ModelOpt's): ``max_co_batch_size`` (1024 output rows scored at once),
  ``max_tokens_per_batch`` (None: every token; a number keeps that many evenly strided tokens of each batch, as
  ModelOpt, whose default is 64), ``min_clip_ratio`` (0.5), ``shrink_step`` (0.05), ``debug``.
- ``awq_full``: both, the clip search on the scaled weights.

Every parameter of every layer is scored on all calibration tokens at once (see :mod:`.awq_stats`): the forward
loop runs once in float to gather the statistics, then once more inside a max calibration only when some input or
output quantizer needs calibrating (weight-only configs calibrate the weights directly). Under
``torch.distributed`` the statistics are summed over the ranks, so ranks that split the data agree with one process.
``progress`` (ours, default True) shows a per-layer bar on a terminal. With ``debug=True`` each layer keeps its
search record as ``module.awq_lite`` / ``module.awq_clip`` (:class:`LiteRecord`, :class:`ClipRecord`).

A weight quantizer that is a :class:`~modelopt_lite.nn.SequentialQuantizer` (``W4A8_AWQ_BETA_CFG``) is searched with
its first member (as ModelOpt does); the others are calibrated on the final weight. Use through
``quantize(model, INT4_AWQ_CFG, loop)`` or :func:`awq` on a model whose quantizers are configured.
"""

from __future__ import annotations

import logging
import numbers
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..nn import SequentialQuantizer, TensorQuantizer
from . import awq_fold, awq_search, awq_stats
from .algorithm_registry import register_algorithm
from .model_quant import calibrate as _calibrate
from .utils import named_quantizers

log = logging.getLogger(__name__)

LITE_PARAMS = ("alpha_step", "debug", "progress")
CLIP_PARAMS = ("max_co_batch_size", "max_tokens_per_batch", "min_clip_ratio", "shrink_step", "debug", "progress")
DEFAULTS = {
    "alpha_step": 0.1,
    "max_co_batch_size": 1024,
    "max_tokens_per_batch": None,
    "min_clip_ratio": 0.5,
    "shrink_step": 0.05,
    "debug": False,
    "progress": True,
}


@dataclass
class LiteRecord:
    """The scale search of one layer: ``best_alpha``, ``scale`` (the ``s`` applied), ``loss`` per alpha (key None:
    the unscaled weight), where ``1 / s`` went (``"pre_quant_scale"`` or the producing module's path). ``best_alpha``
    None: no alpha beat the unscaled weight, nothing was changed (``scale`` None, ``folded_into`` "")."""

    best_alpha: float | None
    scale: torch.Tensor | None
    loss: dict
    folded_into: str = "pre_quant_scale"


@dataclass
class ClipRecord:
    """The clip search of one layer: ``ratio`` per block (out, n_blocks), ``amax`` loaded, ``loss`` per ratio."""

    ratio: torch.Tensor
    amax: torch.Tensor
    loss: dict


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
    for flag in ("debug", "progress"):
        if not isinstance(p[flag], bool):
            raise TypeError(f"awq: {flag} must be True or False, got {p[flag]!r}")
    return p


# --- which layers --------------------------------------------------------------------------------------------------
def _search_quantizer(m: nn.Module) -> TensorQuantizer:
    wq = m.weight_quantizer
    return wq[0] if isinstance(wq, SequentialQuantizer) else wq


def candidates(model: nn.Module, clip: bool) -> dict[str, nn.Module]:
    """Quantized Linears AWQ can work on: an enabled fake-quant weight quantizer on a 2-D weight (clip: static blocks
    along the input axis). Others are left to the plain max calibration (logged)."""
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not hasattr(m, "weight_quantizer") or not hasattr(m, "input_quantizer"):
            continue
        wq = _search_quantizer(m)
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
def awq(model: nn.Module, forward_loop, algorithm: str = "awq_lite", *, calibrate=None, **params) -> dict:
    """Run AWQ (``"awq_lite"``, ``"awq_clip"`` or ``"awq_full"``) on ``model``'s quantized Linears, then calibrate.

    ``forward_loop(model)`` runs the calibration data. ``calibrate`` (a no-argument callable running the loop inside
    a max calibration) defaults to ``modelopt_lite.calibrate(model, None, forward_loop)``. Returns
    ``{layer path: {"awq_lite": LiteRecord, "awq_clip": ClipRecord}}`` for the layers it changed. The model's float
    weights (and folded norms) change in place; :func:`modelopt_lite.quantize` puts everything back if this raises.
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
        trace = awq_fold.Tracer(model, mods) if lite else None
        stats = awq_stats.collect(model, mods, forward_loop, p["max_tokens_per_batch"] if clip else None, trace)
        records = _search_all(mods, stats, trace, p, lite, clip)
        _reset(mods, records)
    else:
        log.info("awq: no quantized Linear with an enabled weight quantizer")
    _calibrate_after(model, forward_loop, calibrate)
    for name, rec in records.items():
        if "awq_clip" in rec:
            _search_quantizer(mods[name]).amax = rec["awq_clip"].amax
        if p["debug"]:
            for k, v in rec.items():
                setattr(mods[name], k, v)
    log.info("%s: %d layer(s) changed", algorithm, len(records))
    return records


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=desc, leave=False, disable=None)


def _search_all(mods, stats, trace, p, lite: bool, clip: bool) -> dict[str, dict]:
    alphas = awq_search.alpha_grid(p["alpha_step"])
    ratios = awq_search.clip_ratios(p["min_clip_ratio"], p["shrink_step"])
    groups = trace.groups() if trace is not None else [([n], None) for n in mods]
    records: dict[str, dict] = {}
    desc = "awq_full" if lite and clip else ("awq_lite" if lite else "awq_clip")
    bar = _progress(list(groups), p["progress"] and lite, f"{desc}: layers")
    scales: dict[str, torch.Tensor] = {}
    skipped: set[str] = set()
    for names, producer in bar:
        if any(stats[n].count == 0 for n in names):
            warnings.warn(f"{desc}: {', '.join(names)} saw no calibration data: max calibration only", stacklevel=3)
            skipped.update(names)
        elif lite:
            _apply_scale(names, producer, mods, [stats[n] for n in names], alphas, records, scales)
    if clip:  # after every scale and fold (a fold rescales the rows of a producing Linear)
        for n in _progress([n for n in mods if n not in skipped], p["progress"], "awq_clip: layers"):
            rec = _clip_one(n, mods[n], stats[n], scales.get(n), ratios, p["max_co_batch_size"])
            if rec is not None:
                records.setdefault(n, {})["awq_clip"] = rec
    return records


def _apply_scale(names, producer, mods, st, alphas, records, scales) -> None:
    """Search one group's scale and apply it: weights times ``s``, ``1 / s`` folded or as ``pre_quant_scale``."""
    alpha, scale, losses = _search_group(names, mods, st, alphas)
    if scale is None:  # no alpha beats the unscaled weights
        for n in names:
            records.setdefault(n, {})["awq_lite"] = LiteRecord(None, None, losses, "")
        return
    with torch.no_grad():
        for n in names:
            w = mods[n].weight
            w.mul_(scale.to(w.device, w.dtype))
        where = awq_fold.fold(producer, scale) if producer is not None else None
    pq = getattr(producer[1], "weight_quantizer", None) if producer is not None else None
    if pq is not None:  # a producing Linear's rows changed: its weight is calibrated again
        pq.reset_amax()
    for n in names:
        if where is None:
            iq = mods[n].input_quantizer
            old = iq.pre_quant_scale
            inv = (1.0 / scale).to(mods[n].weight.device)
            iq.pre_quant_scale = inv if old is None else old.to(inv.device) * inv
        records.setdefault(n, {})["awq_lite"] = LiteRecord(alpha, scale.clone(), losses, where or "pre_quant_scale")
        scales[n] = scale


def _search_group(names, mods, st, alphas):
    """One scale for the layers of a group (a fold needs them to share it), on their summed errors."""
    wqs = [_search_quantizer(mods[n]) for n in names]
    return awq_search.search_scale_group(
        [mods[n].weight for n in names],
        st[0].act_mean,
        st[0].gram,
        st[0].count,
        wqs,
        alphas,
        [awq_search.block_size(q, n) for q, n in zip(wqs, names)],
    )


def _clip_one(name, m, st, scale, ratios, co_batch) -> ClipRecord | None:
    wq = _search_quantizer(m)
    bs = awq_search.block_size(wq, name)
    if bs is None or wq.dynamic:
        return None
    gram, count = (st.clip_gram, st.clip_count) if st.clip_gram is not None else (st.gram, st.count)
    if scale is not None:  # the layer now reads x / s
        inv = (1.0 / scale).double().to(gram.device)
        gram = gram * inv[:, None] * inv[None, :]
    amax, ratio, losses = awq_search.search_clip(m.weight, gram, count, wq, ratios, bs, co_batch)
    return ClipRecord(ratio, amax, losses)


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
    out = {}
    for m in model.modules():
        wq = getattr(m, "weight_quantizer", None)
        if isinstance(m, nn.Linear) and wq is not None:
            for q in wq.modules():
                out[id(q)] = m
    return out


def _calibrate_after(model: nn.Module, forward_loop, calibrate) -> None:
    """The max calibration of every quantizer that needs one: without the data when only Linear weights do."""
    owners = _weight_owner(model)
    todo = [
        q
        for _, q in named_quantizers(model)
        if q.is_enabled and not q.quant_desc.dynamic and q.amax is None and q.quant_desc.amax is None
    ]
    if all(id(q) in owners for q in todo):
        linears = {id(owners[id(q)]): owners[id(q)] for q in todo}

        def feed(_m):
            for lin in linears.values():
                lin.weight_quantizer(lin.weight)

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
