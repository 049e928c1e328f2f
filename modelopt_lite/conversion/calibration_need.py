"""``need_calibration(config)``: whether quantizing with ``config`` needs calibration data (ModelOpt's function).

True when the config's algorithm is anything but ``"max"`` / None (AWQ, SmoothQuant, GPTQ, ... read activations),
or when some enabled quantizer that is not a weight quantizer keeps a static amax (it is calibrated from the
activations a ``forward_loop`` feeds). Weight quantizers are calibrated from the weights themselves, and dynamic
quantizers (``"dynamic": True`` / ModelOpt's ``"type": "dynamic"``, and the OCP MX formats, whose block scales come
from every input) store no amax, so neither needs data.

One difference from ModelOpt 0.47, on purpose: ModelOpt reads only the top-level ``"type"`` and so reports True for
the MX presets (MXFP8_DEFAULT_CFG, ...), whose quantizers have nothing to calibrate; this reads the descriptor's
own ``dynamic`` (NVFP4, whose per-tensor global amax is calibrated, stays True).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..descriptor import QuantDescriptor
from .config import DESCRIPTOR_KEYS, QuantConfigError, Rule, normalize_config


def _dynamic(attrs: Mapping) -> bool:
    """Whether a quantizer configured by ``attrs`` (one normalized entry) recomputes its amax from every input."""
    if attrs.get("dynamic"):
        return True
    bs = attrs.get("block_sizes")
    if not (isinstance(bs, Mapping) and bs.get("type") == "dynamic"):
        return False
    try:  # dynamic blocks: MX is dynamic, NVFP4 calibrates a per-tensor global amax (the descriptor knows which)
        return QuantDescriptor(**{k: attrs[k] for k in DESCRIPTOR_KEYS if k in attrs}).dynamic
    except (TypeError, ValueError):  # a partial entry (completed by another one): not provably dynamic
        return False


def _needs_data(rule: Rule) -> bool:
    if isinstance(rule.pattern, str) and "weight_quantizer" in rule.pattern:
        return False  # weights are calibrated from the weights themselves
    steps = rule.attrs if isinstance(rule.attrs, list) else [rule.attrs]
    return any(a.get("enable", True) and not _dynamic(a) for a in steps)


def _algorithm_reads_data(algorithm: Any) -> bool:
    """Anything but None / ``"max"`` (a name, a ``{"method": ...}`` dict, or a list of those) reads activations.
    The algorithm is not validated here (an unregistered method still reads data); :func:`quantize` validates it."""
    if algorithm is None:
        return False
    if isinstance(algorithm, (list, tuple)):
        return any(_algorithm_reads_data(a) for a in algorithm)
    method = algorithm.get("method") if isinstance(algorithm, Mapping) else algorithm
    return method not in (None, "max")


def need_calibration(config: Mapping[str, Any]) -> bool:
    """Whether :func:`modelopt_lite.quantize` with ``config`` needs a ``forward_loop`` (calibration data).

    ``config`` is a preset or any config :func:`modelopt_lite.quantize` accepts (dict or ModelOpt's list form of
    ``quant_cfg``); its ``quant_cfg`` and ``algorithm`` (default ``"max"``) are read. See the module docstring.

    Raises:
        QuantConfigError: ``config`` is not a dict, or its ``quant_cfg`` is malformed (as :func:`quantize` says).
    """
    if not isinstance(config, Mapping):
        raise QuantConfigError(f"need_calibration: config must be a dict, got {type(config).__name__}")
    if _algorithm_reads_data(config.get("algorithm", "max")):
        return True
    rules = normalize_config({"quant_cfg": config.get("quant_cfg", {}), "algorithm": None}, enable_by_default=True)
    return any(_needs_data(r) for r in rules.rules)
