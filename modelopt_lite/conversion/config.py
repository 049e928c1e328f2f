"""Quantization configs: the presets and the validation of ``{"quant_cfg": {...}, "algorithm": ...}``.

A config is a plain dict::

    {"quant_cfg": {pattern: attrs, ...}, "algorithm": "max" | "histogram" | "percentile" | "mse" | "entropy"
                                                      | "smoothquant" | {"method": ..., **params} | None
                                                      | [any of those, ...]  (applied in order, as ModelOpt)}

``quant_cfg`` keys (applied in this order: ``"default"`` first, then the others in dict order; later ones win):

- ``"default"``: attributes for every quantizer.
- an fnmatch pattern on the quantizer's module path, such as ``"*weight_quantizer"`` or ``"*lm_head*"``.
- a callable ``f(name) -> bool`` on the quantizer's module path.
- a class key: ``"nn.Conv2d"`` (a ``torch.nn`` class), a class object, or the (qualified) name of a module class
  in the model, mapping to ``{pattern: attrs}``. It applies to quantizers owned directly by modules of that class
  (a quantized module counts as its float class); its patterns match the quantizer's local name (``"*input_quantizer"``)
  or its full path.

``attrs`` patch :meth:`TensorQuantizer.set_from_attribute_config`: any descriptor field (``num_bits``, ``axis``,
``block_sizes``, ``unsigned``, ``narrow_range``, ``fake_quant``, ``learn_amax``, ``calib_method``, ``dynamic``,
``amax``, ``scale_amax``) plus ``enable`` and ``num_steps``. Granularity is one setting: an entry that sets
``block_sizes`` without ``axis`` also clears ``axis`` and vice versa. A pattern that matches nothing is fine.
ModelOpt's attribute names work too: ``"type": "static" | "dynamic"`` (our ``dynamic``) and ``"calibrator"``
(``"max"``, ``"histogram"``, or the class ``MaxCalibrator`` / ``HistogramCalibrator``; our ``calib_method``; a
string is a name, never an import path). ``attrs`` may also be a *list* of dicts: the selected quantizer becomes a
:class:`~modelopt_lite.nn.SequentialQuantizer` with one fresh quantizer per dict (ModelOpt's W4A8 AWQ weight
entry ``[{"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}, {"num_bits": (4, 3), "axis": None}]``); a
later dict entry matching it patches every quantizer of the sequence.

``algorithm`` is the calibration method used when :func:`modelopt_lite.quantize` gets a ``forward_loop`` (see
:func:`modelopt_lite.calibrate` for what each method does). As in ModelOpt's ``max_calibrate``, the algorithm
``"max"`` runs each quantizer's own calibrator (``calibrate(model, None)``): quantizers configured with
``calib_method="histogram"`` then use their default, the 99.99th percentile, while ``calibrate(model, "max")``
itself always loads the max. ``"smoothquant"``
(``alpha=``, default 0.5) first rescales every quantized Linear (see :mod:`.smoothquant`), then calibrates with
max. None: no calibration.

Presets (INT8_DEFAULT_CFG, INT8_HISTOGRAM_CFG, FP8_DEFAULT_CFG, INT4_BLOCKWISE_WEIGHT_ONLY_CFG, W4A8_CFG,
INT8_ORT_CFG, INT8_ORT_REDUCED_RANGE_CFG) start with ``"default": {"enable": False}`` (output quantizers and
hand-made quantizers stay off unless a pattern enables them) and end with the default-disabled entries (BatchNorm, LeakyReLU, ``*lm_head*``,
``*output_layer*``, routers and MoE gates), so those win. They are plain dicts; :func:`modelopt_lite.quantize`
deep-copies the config it is given and never mutates it.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from torch import nn

from ..calib import HistogramCalibrator, MaxCalibrator
from ..descriptor import _DEFAULTS as _DESC_DEFAULTS
from ..nn._quantizer_config import PEER_DEFAULTS, check_calibrator_factory, translate_peer
from ..nn.modules._integer_requant import REQUANT_MODES
from ..presets import (  # noqa: F401  (re-exported: the presets used to live here)
    CONVTRANSPOSE_WEIGHT_AXIS,
    FP8_DEFAULT_CFG,
    INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    INT8_DEFAULT_CFG,
    INT8_HISTOGRAM_CFG,
    INT8_ORT_CFG,
    INT8_ORT_REDUCED_RANGE_CFG,
    INT8_SMOOTHQUANT_CFG,
    PRESETS,
    W4A8_CFG,
)
from .algorithm_registry import ALGORITHMS

#: why a weight algorithm may be missing: :mod:`modelopt_lite.algorithms` (a layer above this one) registers them
NOT_REGISTERED_HINT = (
    " (the weight algorithms awq_lite, gptq, smoothquant, svdquant, ... register when modelopt_lite.algorithms is"
    " imported, which modelopt_lite.quantize/calibrate do; import modelopt_lite.algorithms before calling"
    " modelopt_lite.conversion directly)"
)

#: attributes a quant_cfg entry may set
DESCRIPTOR_KEYS = tuple(k for k in _DESC_DEFAULTS if k != "name")
ATTR_KEYS = (
    frozenset(DESCRIPTOR_KEYS) | {"enable", "num_steps", "bias", "calibrator"} | frozenset(PEER_DEFAULTS)
)  # bias: affine
#: ModelOpt attribute names, translated on normalization: ``type`` -> ``dynamic``, ``calibrator`` -> ``calib_method``
MODELOPT_KEYS = frozenset({"type", "calibrator"})
#: the calibrators a config may name (``"calibrator": "max"`` or ``"calibrator": MaxCalibrator``)
CALIBRATORS: dict[str, type] = {"max": MaxCalibrator, "histogram": HistogramCalibrator}

#: calibration methods and the parameters each accepts
METHOD_PARAMS: dict[str | None, frozenset] = {
    None: frozenset(),
    "max": frozenset(),
    "histogram": frozenset({"percentile"}),
    "percentile": frozenset({"percentile"}),
    "mse": frozenset({"start_bin", "stride"}),
    "entropy": frozenset({"start_bin", "stride"}),
}
CALIB_METHODS = tuple(k for k in METHOD_PARAMS if k is not None)

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class QuantConfigError(ValueError, TypeError):
    """A malformed quantization config (an unknown attribute is both a ValueError and a TypeError)."""


# --- validation ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """One normalized quant_cfg entry: which quantizers it selects and the attributes it patches."""

    label: str
    pattern: str | Callable[[str], bool]
    owner_cls: type | str | None
    attrs: dict | list[dict] = field(hash=False)

    def matches(self, name: str, local: str, owner: nn.Module | None, float_cls: type | None = None) -> bool:
        """Whether the quantizer at ``name`` (``local`` inside ``owner``; owner's float class) is selected."""
        if self.owner_cls is not None:
            if owner is None or not _class_matches(self.owner_cls, type(owner), float_cls):
                return False
            pattern = cast(str, self.pattern)  # class rules always have a string pattern
            return fnmatch.fnmatchcase(local, pattern) or fnmatch.fnmatchcase(name, pattern)
        if callable(self.pattern):
            return bool(self.pattern(name))
        return fnmatch.fnmatchcase(name, self.pattern)


def _class_matches(spec: type | str, owner_type: type, float_cls: type | None) -> bool:
    types = [owner_type] + ([float_cls] if float_cls is not None else [])
    for t in types:
        if isinstance(spec, type):
            if issubclass(t, spec):
                return True
            continue
        for c in t.__mro__:
            if spec in (c.__name__, c.__qualname__, f"{c.__module__}.{c.__qualname__}"):
                return True
    return False


@dataclass(frozen=True)
class QuantConfig:
    """A validated config: rules in application order, the algorithm ``(method, params)`` or None, and the
    ``requant`` mode of the quantized Linear/Conv layers (None: leave it)."""

    rules: tuple[Rule, ...]
    algorithm: tuple[str | None, dict] | None
    requant: str | None = None


def _modelopt_type(label: str, attrs: dict) -> None:
    """ModelOpt's ``type: "static" | "dynamic"`` -> our ``dynamic`` (in place)."""
    t = attrs.pop("type")
    if t not in ("static", "dynamic"):
        raise QuantConfigError(f"quant_cfg[{label}]: 'type' must be 'static' or 'dynamic', got {t!r}")
    dynamic = t == "dynamic"
    if "dynamic" in attrs and attrs["dynamic"] != dynamic:
        raise QuantConfigError(f"quant_cfg[{label}]: 'type': {t!r} contradicts 'dynamic': {attrs['dynamic']!r}")
    attrs["dynamic"] = dynamic


def _modelopt_calibrator(label: str, attrs: dict) -> None:
    """ModelOpt's ``calibrator`` (a name or one of our calibrator classes) -> our ``calib_method`` (in place).

    Strings are looked up in :data:`CALIBRATORS` and never imported: a dotted path is rejected, as is any other
    class or a ModelOpt constructor tuple (a quantizer builds its calibrator from ``calib_method``).
    """
    c = attrs.pop("calibrator")
    if (isinstance(c, type) and c not in CALIBRATORS.values()) or isinstance(c, (tuple, list)):
        try:  # a user calibrator class, or ModelOpt's (cls, args, kwargs): built by each quantizer
            attrs["calibrator"] = check_calibrator_factory(c, f"quant_cfg[{label}]")
        except TypeError as e:
            raise QuantConfigError(str(e)) from e
        return
    if isinstance(c, str):
        name = c if c in CALIBRATORS else None
    else:
        name = next((k for k, cls in CALIBRATORS.items() if c is cls), None)
    if name is None:
        what = f"{c.__module__}.{c.__qualname__}" if isinstance(c, type) else repr(c)
        raise QuantConfigError(
            f"quant_cfg[{label}]: calibrator {what} is not supported: give one of {sorted(CALIBRATORS)} or "
            f"{', '.join(cls.__name__ for cls in CALIBRATORS.values())} (names are never imported)"
        )
    if "calib_method" in attrs and attrs["calib_method"] != name:
        raise QuantConfigError(
            f"quant_cfg[{label}]: 'calibrator': {c!r} contradicts 'calib_method': {attrs['calib_method']!r}"
        )
    attrs["calib_method"] = name


def _check_attr_dict(label: str, attrs: Any) -> dict:
    if not isinstance(attrs, dict):
        raise QuantConfigError(f"quant_cfg[{label}]: attributes must be a dict, got {type(attrs).__name__} {attrs!r}")
    try:
        attrs = translate_peer(attrs, f"quant_cfg[{label}]")  # ModelOpt's extra keys (rotate, constant_amax, ...)
    except (TypeError, ValueError) as e:
        raise QuantConfigError(str(e)) from e
    for k in attrs:
        if k not in ATTR_KEYS and k not in MODELOPT_KEYS:
            raise QuantConfigError(
                f"quant_cfg[{label}]: unknown quantizer attribute {k!r}; allowed: {sorted(ATTR_KEYS | MODELOPT_KEYS)}"
            )
    if "enable" in attrs and not isinstance(attrs["enable"], bool):
        raise QuantConfigError(f"quant_cfg[{label}]: 'enable' must be a bool, got {attrs['enable']!r}")
    if "num_steps" in attrs:
        n = attrs["num_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise QuantConfigError(f"quant_cfg[{label}]: 'num_steps' must be an int >= 1, got {n!r}")
    calibrator = attrs.get("calibrator")
    out = copy.deepcopy({k: v for k, v in attrs.items() if k != "calibrator"})
    if "calibrator" in attrs:
        out["calibrator"] = calibrator  # a class: kept as is (deep-copying a class is the class anyway)
        _modelopt_calibrator(label, out)
    if "type" in out:
        _modelopt_type(label, out)
    if out.get("block_sizes") is not None and "axis" not in out:
        out["axis"] = None
    if out.get("axis") is not None and "block_sizes" not in out:
        out["block_sizes"] = None
    return out


def _check_attrs(label: str, attrs: Any) -> dict | list[dict]:
    """One entry's attributes, validated and translated (ModelOpt's ``type``/``calibrator`` become ``dynamic``/
    ``calib_method``); a list of dicts (one per quantizer of a :class:`SequentialQuantizer`) gives a list."""
    if isinstance(attrs, (list, tuple)):
        if not attrs:
            raise QuantConfigError(f"quant_cfg[{label}]: an empty list of attribute dicts")
        return [_check_attr_dict(f"{label}][{i}", a) for i, a in enumerate(attrs)]
    return _check_attr_dict(label, attrs)


def _looks_nested(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(v, (dict, list)) for v in value.values())
        and not any(isinstance(k, str) and (k in ATTR_KEYS or k in MODELOPT_KEYS) for k in value)
    )


def _resolve_class(key: str) -> type:
    import torch.nn.modules as defining  # torch.nn attributes may be patched by quant_modules.enable()

    obj = getattr(defining, key[3:], None) or getattr(nn, key[3:], None)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise QuantConfigError(f"quant_cfg[{key!r}]: torch.nn has no module class {key[3:]!r}")
    return obj


def _class_rules(key, label: str, value: Any) -> list[Rule]:
    owner = key if isinstance(key, type) else (_resolve_class(key) if key.startswith("nn.") else key)
    if not isinstance(value, dict) or not value:
        raise QuantConfigError(
            f"quant_cfg[{label}]: a class key needs a non-empty dict {{pattern: attrs}}, got {value!r}"
        )
    rules = []
    for sub, attrs in value.items():
        if not isinstance(sub, str):
            raise QuantConfigError(f"quant_cfg[{label}]: patterns under a class key must be strings, got {sub!r}")
        sub_label = f"{label}][{sub!r}"
        rules.append(Rule(sub_label, sub, owner, _check_attrs(sub_label, attrs)))
    return rules


def _sequence(steps: list) -> tuple[str, dict]:
    """ModelOpt's list of algorithms (applied in order) as the registered ``"sequence"`` algorithm
    (:mod:`.algorithm_sequence`): every entry validated here, before anything runs."""
    if not steps:
        raise QuantConfigError("algorithm list must not be empty")
    for i, a in enumerate(steps):
        if isinstance(a, list):
            raise QuantConfigError(f"algorithm list entry {i} is itself a list (nested lists are not allowed): {a!r}")
    return "sequence", {"steps": tuple(normalize_algorithm(a) for a in steps)}


#: ModelOpt's ``"mse"`` is a search on the weight amaxes (its ``MseCalibConfig`` fields ``step_size``, ...); ours is
#: the histogram MSE of the per-tensor quantizers. A ``"mse"`` dict with ModelOpt's fields only runs the registered
#: ModelOpt algorithm instead (``weight_mse``, :mod:`modelopt_lite.algorithms.weight_mse`).
MODELOPT_ALIASES = {"mse": "weight_mse"}


def _modelopt_alias(method: Any, params: dict) -> Any:
    target = MODELOPT_ALIASES.get(method) if isinstance(method, str) else None
    if target is None or target not in ALGORITHMS or not params:
        return method
    return target if set(params) <= ALGORITHMS[target].params else method


def _layerwise(method: Any, params: dict) -> tuple[str | None, dict] | None:
    """ModelOpt's ``"layerwise": {"enable": True, ...}`` in an algorithm dict: the registered ``"layerwise"``
    algorithm running ``method`` decoder layer by decoder layer (``enable`` False or absent: ``method`` as usual)."""
    params = dict(params)
    lw = params.pop("layerwise")
    inner = normalize_algorithm({"method": method, **params})
    if lw is None:
        return inner
    if not isinstance(lw, dict):
        raise QuantConfigError(f"algorithm 'layerwise' must be a dict such as {{'enable': True}}, got {lw!r}")
    if not lw.get("enable", False):
        return inner
    if "layerwise" not in ALGORITHMS:
        raise QuantConfigError(f"layerwise calibration is not registered{NOT_REGISTERED_HINT}")
    if inner is None or inner[0] in (None, "sequence"):
        raise QuantConfigError(f"layerwise needs one calibration method or algorithm, got {method!r}")
    opts = {k: v for k, v in lw.items() if k != "enable"}
    return normalize_algorithm({"method": "layerwise", "calib": inner, **opts})


def normalize_algorithm(algorithm: Any) -> tuple[str | None, dict] | None:
    """``(method, params)`` from ``"max"``, ``{"method": "percentile", "percentile": 99.9}``, ... or None; a list
    (ModelOpt's sequential form) gives ``("sequence", {"steps": (each entry normalized, ...)})``."""
    if algorithm is None:
        return None
    if isinstance(algorithm, list):
        return _sequence(algorithm)
    if isinstance(algorithm, dict) and set(algorithm) == {"method", "steps"} and algorithm["method"] == "sequence":
        if isinstance(algorithm["steps"], list):
            return _sequence(algorithm["steps"])
    if isinstance(algorithm, str):
        method, params = algorithm, {}
    elif isinstance(algorithm, dict):
        if "method" not in algorithm:
            raise QuantConfigError(f"algorithm dict needs a 'method' key, got {algorithm!r}")
        params = {k: v for k, v in algorithm.items() if k != "method"}
        method = algorithm["method"]
        if "layerwise" in params:
            return _layerwise(method, params)
    else:
        raise QuantConfigError(
            f"algorithm must be None, a method name or a dict with 'method' (or a list of those), got {algorithm!r}"
        )
    method = _modelopt_alias(method, params)
    if method in ALGORITHMS:
        alg = ALGORITHMS[method]
        unknown = sorted(set(params) - alg.params)
        if unknown:
            raise QuantConfigError(
                f"algorithm {method!r} got unknown parameter(s) {unknown}; allowed: {sorted(alg.params)}"
            )
        if alg.check is not None:
            try:
                alg.check(params)
            except (TypeError, ValueError) as e:
                raise QuantConfigError(str(e)) from None
        return method, copy.deepcopy(params)
    if method not in METHOD_PARAMS:
        hint = "" if "modelopt_lite.algorithms" in sys.modules else NOT_REGISTERED_HINT
        raise QuantConfigError(
            f"unknown calibration method {method!r}; choose one of {list(CALIB_METHODS) + sorted(ALGORITHMS)}{hint}"
        )
    check_method(method, params)
    return method, copy.deepcopy(params)


def check_method(method: Any, params: dict) -> None:
    """Validate a calibration method and its parameters before any data is run (ValueError naming the problem)."""
    if method in ALGORITHMS:
        raise QuantConfigError(
            f"{method!r} is an algorithm of quantize() (a config's 'algorithm'), not a calibration "
            f"method: use quantize(model, {{'quant_cfg': ..., 'algorithm': {{'method': {method!r}}}}}, forward_loop)"
            f"{ALGORITHMS[method].hint}"
        )
    if method not in METHOD_PARAMS:
        raise QuantConfigError(f"unknown calibration method {method!r}; choose one of {list(CALIB_METHODS)}")
    unknown = sorted(set(params) - METHOD_PARAMS[method])
    if unknown:
        allowed = sorted(METHOD_PARAMS[method]) or "none"
        raise QuantConfigError(f"calibration method {method!r} got unknown parameter(s) {unknown}; allowed: {allowed}")
    if "percentile" in params:
        p = params["percentile"]
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 100:
            raise QuantConfigError(f"percentile must be a number in (0, 100], got {p!r}")
    for k, lo in (("start_bin", 0), ("stride", 1)):
        if k in params:
            v = params[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise QuantConfigError(f"{k} must be an int >= {lo}, got {v!r}")


def _enabled(attrs: dict | list[dict]) -> dict | list[dict]:
    if isinstance(attrs, list):
        return [{"enable": True, **a} for a in attrs]
    return {"enable": True, **attrs}


_LIST_ENTRY_KEYS = frozenset({"quantizer_name", "cfg", "enable", "parent_class"})


def _list_rules(entries) -> list[Rule]:
    """Rules from ModelOpt 0.47's list form of ``quant_cfg``, in order: each entry ``{"quantizer_name": pattern,
    "cfg": attrs (a dict, or a list of dicts for a SequentialQuantizer), "enable": bool, "parent_class": class key}``
    means what the dict entry ``{pattern: {**cfg, "enable": enable}}`` (under ``{parent_class: {...}}``) means."""
    rules: list[Rule] = []
    for i, e in enumerate(entries):
        label = f"[{i}]"
        if not isinstance(e, dict):
            raise QuantConfigError(f"quant_cfg{label}: a list entry must be a dict, got {type(e).__name__} {e!r}")
        extra = sorted(map(str, set(e) - _LIST_ENTRY_KEYS))
        if extra:
            raise QuantConfigError(f"quant_cfg{label}: unknown key(s) {extra}; allowed: {sorted(_LIST_ENTRY_KEYS)}")
        name = e.get("quantizer_name")
        if not isinstance(name, str) or not name:
            raise QuantConfigError(f"quant_cfg{label}: 'quantizer_name' must be a non-empty pattern, got {name!r}")
        cfg = e.get("cfg", {})
        if isinstance(cfg, (list, tuple)):
            attrs: Any = [dict(c, enable=e["enable"]) if "enable" in e else c for c in cfg]
        elif isinstance(cfg, dict):
            attrs = dict(cfg, enable=e["enable"]) if "enable" in e else dict(cfg)
        else:
            raise QuantConfigError(f"quant_cfg{label}: 'cfg' must be a dict or a list of dicts, got {cfg!r}")
        label = f"{i}: {name!r}"
        parent = e.get("parent_class")
        if parent is None:
            rules.append(Rule(label, name, None, _check_attrs(label, attrs)))
        elif isinstance(parent, type) or (isinstance(parent, str) and parent):
            rules += _class_rules(parent, label, {name: attrs})
        else:
            raise QuantConfigError(
                f"quant_cfg[{label}]: 'parent_class' must be a class or a class name, got {parent!r}"
            )
    return rules


def normalize_config(config: Any, *, enable_by_default: bool = False) -> QuantConfig:
    """Validate ``config`` and return its rules (``"default"`` first) and algorithm; never mutates ``config``.

    ``enable_by_default`` (what :func:`modelopt_lite.quantize` uses, as ModelOpt's ``mtq.quantize`` does): an
    entry that does not say ``"enable"`` turns the quantizers it selects on, so ModelOpt's own preset literals such
    as ``{"*weight_quantizer": {"num_bits": 8, "axis": 0}, ..., "default": {"enable": False}}`` mean the same here.
    Without it (``set_quantizer_by_cfg``), an entry patches only the keys it names.

    Raises:
        QuantConfigError (a ValueError): what is wrong and where (the pattern and the key).
    """
    if not isinstance(config, dict):
        raise QuantConfigError(
            f"config must be a dict {{'quant_cfg': ..., 'algorithm': ...}}, got {type(config).__name__}"
        )
    extra = sorted(map(str, set(config) - {"quant_cfg", "algorithm", "requant"}))
    if extra:
        raise QuantConfigError(
            f"config has unknown key(s) {extra}; expected 'quant_cfg', 'algorithm' and optionally 'requant'"
        )
    requant = config.get("requant")
    if requant is not None and requant not in REQUANT_MODES:
        raise QuantConfigError(f"config['requant'] must be one of {REQUANT_MODES}, got {requant!r}")
    quant_cfg = config.get("quant_cfg", {})
    default_rules: list[Rule] = []
    rules: list[Rule] = []
    if isinstance(quant_cfg, (list, tuple)):  # ModelOpt 0.47's form: ordered entries
        rules = _list_rules(quant_cfg)
        quant_cfg = {}
    if not isinstance(quant_cfg, dict):
        raise QuantConfigError(
            f"config['quant_cfg'] must be a dict {{pattern: attrs}} or a list of ModelOpt entries "
            f"{{'quantizer_name': ..., 'cfg': ..., 'enable': ..., 'parent_class': ...}}, got {type(quant_cfg).__name__}"
        )
    for key, value in quant_cfg.items():
        label = repr(key) if isinstance(key, str) else getattr(key, "__name__", repr(key))
        if key == "default":
            default_rules.append(Rule(label, "*", None, _check_attrs(label, value)))
        elif isinstance(key, type):
            if not issubclass(key, nn.Module):
                raise QuantConfigError(f"quant_cfg[{label}]: a class key must be an nn.Module subclass")
            rules += _class_rules(key, label, value)
        elif isinstance(key, str):
            if not key:
                raise QuantConfigError("quant_cfg: empty pattern ''")
            if key.startswith("nn.") or (_DOTTED.fullmatch(key) and _looks_nested(value)):
                rules += _class_rules(key, label, value)
            else:
                rules.append(Rule(label, key, None, _check_attrs(label, value)))
        elif callable(key):
            rules.append(Rule(label, key, None, _check_attrs(label, value)))
        else:
            raise QuantConfigError(
                f"quant_cfg key must be a pattern string, 'default', a class or a callable, got {key!r}"
            )
    all_rules = default_rules + rules
    if enable_by_default:
        all_rules = [dataclasses.replace(r, attrs=_enabled(r.attrs)) for r in all_rules]
    return QuantConfig(tuple(all_rules), normalize_algorithm(config.get("algorithm", "max")), requant)
