"""Layer sensitivity: quantize one layer at a time and rank layers by how much the metric drops; ``auto_skip``.

Both work on a deep copy of the float model, quantized and calibrated ONCE with the config (calibration sees float
activations, as in :func:`modelopt_lite.calibrate`); layers are then switched on and off by enabling or disabling
their quantizers, which leaves a disabled layer exactly float.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


def _forward_loop(data):
    if callable(data):
        return data
    from ..conversion.model_quant import calibrate_loop

    batches = list(data)
    if not batches:
        raise ValueError("sensitivity: data (calibration batches) is empty")
    return lambda model: calibrate_loop(model, batches, progress=False)


def _quantized_copy(model: nn.Module, config: dict, data):
    from ..conversion.model_quant import quantize

    return quantize(copy.deepcopy(model), config, _forward_loop(data))


def quant_layers(qmodel: nn.Module) -> dict[str, list]:
    """``{layer name: [its enabled quantizers]}`` of a quantized model (a layer = the module owning them)."""
    from ..conversion.utils import quantizer_sites

    out: dict[str, list] = {}
    for site in quantizer_sites(qmodel):
        if site.quantizer.is_enabled:
            out.setdefault(site.name.rpartition(".")[0], []).append(site.quantizer)
    return out


def _set(quantizers, on: bool) -> None:
    for q in quantizers:
        q.enable() if on else q.disable()


def _metric(metric, model) -> float:
    v = metric(model)
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"metric(model) must return a number, got {type(v).__name__}") from None


@dataclass
class SensitivityReport:
    """Result of :func:`sensitivity`: ``rows`` sorted from most to least sensitive layer.

    Each row: ``layer``, ``metric`` (only that layer quantized), ``drop`` (baseline minus it, sign-adjusted so a
    positive drop is always worse), ``rank`` (1 = most sensitive). ``baseline`` is the float metric,
    ``all_quantized`` the metric with every layer quantized.
    """

    baseline: float
    all_quantized: float
    rows: list[dict] = field(default_factory=list)
    higher_is_better: bool = True

    @property
    def ranking(self) -> list[str]:
        """Layer names, most sensitive first."""
        return [r["layer"] for r in self.rows]


def sensitivity(
    model: nn.Module,
    config: dict,
    data,
    metric: Callable[[nn.Module], float],
    *,
    higher_is_better: bool = True,
    layers: list[str] | None = None,
) -> SensitivityReport:
    """Rank the layers of ``model`` by the metric drop caused by quantizing each one alone.

    Args:
        model: the float model (never modified; a deep copy is quantized).
        config: a quantization config (e.g. ``modelopt_lite.INT8_DEFAULT_CFG``).
        data: calibration batches (tensors, tuples of args or dicts of kwargs) or a ``forward_loop(model)``.
        metric: ``metric(model) -> float`` (e.g. accuracy on held-out data).
        higher_is_better: the metric's direction (False for a loss).
        layers: restrict to these layer names (default: every layer with enabled quantizers).

    Returns:
        A :class:`SensitivityReport`; ties keep the model's layer order.
    """
    sign = 1.0 if higher_is_better else -1.0
    baseline = _metric(metric, model)
    qm = _quantized_copy(model, config, data)
    groups = quant_layers(qm)
    if layers is not None:
        missing = [n for n in layers if n not in groups]
        if missing:
            raise ValueError(
                f"sensitivity: layer {missing[0]!r} has no enabled quantizers after quantization; "
                f"quantized layers: {list(groups)}"
            )
        groups = {n: groups[n] for n in layers}
    all_q = _metric(metric, qm)
    for qs in groups.values():
        _set(qs, False)
    rows: list[dict[str, Any]] = []
    for i, (name, qs) in enumerate(groups.items()):
        _set(qs, True)
        try:
            v = _metric(metric, qm)
        finally:
            _set(qs, False)
        rows.append({"layer": name, "metric": v, "drop": sign * (baseline - v), "order": i})
    rows.sort(key=lambda r: (-r["drop"], r["order"]))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
        del r["order"]
    return SensitivityReport(baseline, all_q, rows, higher_is_better)


@dataclass
class AutoSkipReport:
    """Result of :func:`auto_skip`.

    ``model``: the quantized copy with the skipped layers' quantizers disabled (float); ``skipped``: layer names in
    the order they were left in float; ``steps``: ``[{"skipped": [...], "metric": m, "drop": d}, ...]`` starting
    with nothing skipped; ``final_metric`` / ``final_drop``; ``met_budget``; ``config``: the input config plus
    one ``{"<layer>.*": {"enable": False}}`` entry per skipped layer (reproduces the result with quantize()).
    """

    model: nn.Module
    baseline: float
    max_drop: float
    skipped: list[str]
    steps: list[dict]
    final_metric: float
    final_drop: float
    met_budget: bool
    config: dict
    sensitivity: SensitivityReport


def auto_skip(
    model: nn.Module,
    config: dict,
    data,
    metric: Callable[[nn.Module], float],
    max_drop: float,
    *,
    higher_is_better: bool = True,
    sensitivity_report: SensitivityReport | None = None,
) -> AutoSkipReport:
    """Leave the most sensitive layers in float, one at a time, until the metric drop is within ``max_drop``.

    Greedy: layers are taken in :func:`sensitivity` order (computed here unless ``sensitivity_report`` is given);
    after each skip the whole model is re-evaluated, and the loop stops as soon as
    ``baseline - metric <= max_drop`` (sign-adjusted for ``higher_is_better=False``) or nothing is left to skip.

    Raises:
        ValueError: ``max_drop`` is negative or not a number.
    """
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not max_drop >= 0:
        raise ValueError(f"auto_skip: max_drop must be a number >= 0, got {max_drop!r}")
    sign = 1.0 if higher_is_better else -1.0
    rep = sensitivity_report or sensitivity(model, config, data, metric, higher_is_better=higher_is_better)
    qm = _quantized_copy(model, config, data)
    groups = quant_layers(qm)
    baseline = rep.baseline
    v = _metric(metric, qm)
    steps: list[dict[str, Any]] = [{"skipped": [], "metric": v, "drop": sign * (baseline - v)}]
    skipped: list[str] = []
    for name in rep.ranking:
        if steps[-1]["drop"] <= max_drop:
            break
        _set(groups.get(name, []), False)
        skipped.append(name)
        v = _metric(metric, qm)
        steps.append({"skipped": list(skipped), "metric": v, "drop": sign * (baseline - v)})
    cfg = copy.deepcopy(config)
    cfg.setdefault("quant_cfg", {})
    for name in skipped:
        cfg["quant_cfg"][f"{name}.*"] = {"enable": False}
    final = steps[-1]
    return AutoSkipReport(
        qm,
        baseline,
        float(max_drop),
        skipped,
        steps,
        final["metric"],
        final["drop"],
        final["drop"] <= max_drop,
        cfg,
        rep,
    )
