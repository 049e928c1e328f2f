"""The candidate formats of :func:`~modelopt_lite.algorithms.auto_quantize.auto_quantize` and who may use which.

ModelOpt 0.47's options, with its meaning:

``quantization_formats``: the global candidates (configs or preset names; ``None`` entries ignored), searched with
    "keep float" for every group that no ``module_search_spaces`` entry matches.
``module_search_spaces``: a list of ``{"module_name_patterns": str | [str, ...], "quantization_formats": [...],
    "allow_no_quant": bool = True}``. An entry replaces the global candidates for the groups it matches
    (``fnmatch`` on the layer names). It must match every layer of a group or none (a fused QKV group is one
    decision), and at most one entry may match a group. ``allow_no_quant=False`` keeps float as the scoring
    baseline but not as a choice; with a single format it fixes the group to that format: the group is not
    scored, stays quantized while the others are scored, and its cost counts in the budget.
``fixed_quantization_config``: a normal PTQ config for every group no entry matches (instead of the global
    candidates, which must then be omitted; at least one entry is required). It is calibrated with its own
    algorithm, stays active while the searched groups are scored, and its layers count in the effective bits at
    their fixed bits (16 where the config leaves a layer float). Its other quantizers (e.g. attention matmuls)
    are kept as it sets them.

A layer that no format of its candidates (nor the fixed config) quantizes, e.g. an Embedding, is neither searched
nor counted, as before.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..conversion.config import QuantConfigError, normalize_config
from ..conversion.utils import is_quantizer, named_quantizers
from ..nn import SequentialQuantizer, TensorQuantizer
from ..presets import INT4_BLOCKWISE_WEIGHT_ONLY_CFG, PRESETS

#: ModelOpt's name for "keep the layer float" (always a candidate unless allow_no_quant=False; 16 bits)
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

_SPACE_KEYS = {"module_name_patterns", "quantization_formats", "allow_no_quant"}


@dataclass
class Space:
    """One ``module_search_spaces`` entry, checked: its patterns, format names and ``allow_no_quant``."""

    patterns: list[str]
    formats: list[str]
    allow_no_quant: bool


@dataclass
class Options:
    """The checked format options: ``candidates`` holds every searchable format (global and per entry)."""

    global_formats: list[str]
    spaces: list[Space]
    fixed: tuple[str, dict] | None
    candidates: dict[str, dict] = field(default_factory=dict)


def signature(cfg: dict) -> str:
    """A stable digest of a format config (to tell a checkpoint's formats from the current ones)."""
    return hashlib.sha256(repr(cfg).encode()).hexdigest()[:16]


# --- formats -------------------------------------------------------------------------------------------------------
def _format_name(cfg, where: str, custom: str) -> tuple[str, dict]:
    if isinstance(cfg, str):
        if cfg not in PRESETS:
            raise QuantConfigError(f"auto_quantize: {where} {cfg!r} is not a preset name; known: {sorted(PRESETS)}")
        return cfg, PRESETS[cfg]
    if not isinstance(cfg, dict):
        raise QuantConfigError(
            f"auto_quantize: {where} must be a config dict, a preset name or None, got {type(cfg).__name__}"
        )
    for name, preset in PRESETS.items():
        if cfg == preset:
            return name, cfg
    warnings.warn(
        f"auto_quantize: received a custom quantization format; it is shown as {custom}", UserWarning, stacklevel=5
    )
    return custom, cfg


def _parse_formats(formats: list, what: str, custom_prefix: str) -> dict[str, dict]:
    """``{name: config}`` of a list of formats (None entries dropped, duplicates once), each config checked."""
    out: dict[str, dict] = {}
    for i, cfg in enumerate(formats):
        if cfg is None:
            continue
        name, cfg = _format_name(
            cfg, f"{what}[{i}]" if what != "fixed_quantization_config" else what, f"{custom_prefix}_{i}"
        )
        normalize_config(cfg, enable_by_default=True)  # raises on a malformed config
        out.setdefault(name, cfg)
    return out


def _check_space(i: int, space) -> tuple[list[str], list, bool]:
    where = f"auto_quantize: module_search_spaces[{i}]"
    if not isinstance(space, dict):
        raise TypeError(f"{where} must be a dict, got {type(space).__name__}")
    extra = sorted(map(str, set(space) - _SPACE_KEYS))
    if extra:
        raise ValueError(f"{where} has unsupported key(s) {extra}; allowed: {sorted(_SPACE_KEYS)}")
    pats = space.get("module_name_patterns")
    pats = [pats] if isinstance(pats, str) else pats
    if not isinstance(pats, list) or not pats or not all(isinstance(p, str) for p in pats):
        raise ValueError(f"{where}: module_name_patterns must be a string or a non-empty list of strings, got {pats!r}")
    fmts = space.get("quantization_formats")
    if not isinstance(fmts, list):
        raise TypeError(f"{where}: quantization_formats must be a list, got {type(fmts).__name__}")
    if not fmts:
        raise ValueError(f"{where}: quantization_formats must be a non-empty list")
    allow = space.get("allow_no_quant", True)
    if not isinstance(allow, bool):
        raise TypeError(f"{where}: allow_no_quant must be a bool, got {allow!r}")
    return pats, fmts, allow


def check_options(quantization_formats, module_search_spaces, fixed_quantization_config) -> Options:
    """Check the three format options together, as ModelOpt's ``auto_quantize`` does (before any work)."""
    fixed_cfg = fixed_quantization_config
    if quantization_formats is None:
        quantization_formats = (
            [] if fixed_cfg is not None else [INT4_BLOCKWISE_WEIGHT_ONLY_CFG, PRESETS["FP8_DEFAULT_CFG"]]
        )
    if not isinstance(quantization_formats, list):
        raise QuantConfigError(
            f"auto_quantize: quantization_formats must be a list, got {type(quantization_formats).__name__}"
        )
    if fixed_cfg is not None and quantization_formats:
        raise ValueError(
            "auto_quantize: fixed_quantization_config cannot be combined with global quantization_formats; put "
            "every searched layer in module_search_spaces"
        )
    if fixed_cfg is None and not quantization_formats:
        raise QuantConfigError("auto_quantize: quantization_formats must be a non-empty list")
    glob = _parse_formats(quantization_formats, "quantization_formats", "CUSTOM")
    if quantization_formats and not glob:
        raise QuantConfigError("auto_quantize: quantization_formats must contain at least one non-None format")
    if module_search_spaces is not None and not isinstance(module_search_spaces, list):
        raise TypeError(
            f"auto_quantize: module_search_spaces must be a list of dicts, got {type(module_search_spaces).__name__}"
        )
    candidates = dict(glob)
    spaces = []
    for i, space in enumerate(module_search_spaces or []):
        pats, fmts, allow = _check_space(i, space)
        parsed = _parse_formats(fmts, f"module_search_spaces[{i}].quantization_formats", f"CUSTOM_MODULE_{i}")
        if not parsed:
            raise ValueError(
                f"auto_quantize: module_search_spaces[{i}].quantization_formats must contain a non-None format"
            )
        for name, cfg in parsed.items():
            candidates.setdefault(name, cfg)
        spaces.append(Space(list(pats), list(parsed), allow))
    if fixed_cfg is not None and not spaces:
        raise ValueError("auto_quantize: fixed_quantization_config requires at least one module_search_spaces entry")
    fixed = None
    if fixed_cfg is not None:
        parsed = _parse_formats([fixed_cfg], "fixed_quantization_config", "FIXED")
        fixed = next(iter(parsed.items()))
    return Options(list(glob), spaces, fixed, candidates)


# --- layers, bits and groups ---------------------------------------------------------------------------------------
def is_quantizer_child(m: nn.Module) -> bool:
    """A quantizer, or a SequentialQuantizer (never a quantized layer, though its children are all quantizers)."""
    return is_quantizer(m) or isinstance(m, SequentialQuantizer)


def searchable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The searchable layers: modules with a ``weight`` tensor whose children are all quantizers (at least one)."""
    out = {}
    for name, m in model.named_modules():
        kids = list(m.children())
        if name and isinstance(getattr(m, "weight", None), torch.Tensor) and kids:
            if all(is_quantizer_child(k) for k in kids):
                out[name] = m
    return out


def _bits(num_bits) -> int:
    return sum(num_bits) + 1 if isinstance(num_bits, tuple) else int(num_bits)


def layer_bits(layer: nn.Module) -> int:
    """The cost-model bits of a quantized layer: the least ``num_bits`` of its enabled quantizers (16 if none)."""
    bits = []
    for _, q in named_quantizers(layer):
        assert isinstance(q, TensorQuantizer)
        if q.is_enabled:
            bits.append(_bits(q.quant_desc.num_bits))
    return min(bits, default=FLOAT_BITS)


def group_key(name: str) -> str:
    """The group of a layer under :data:`QUANT_GROUPING_RULES` (its own name when no rule matches)."""
    for rule in QUANT_GROUPING_RULES:
        if callable(rule):
            key = rule(name)
        else:
            m = re.match(rule, name)
            key = m.group(1) if m else None
        if key is not None:
            return f"{key}.*"
    return name


def is_disabled(name: str, disabled_layers) -> bool:
    pats = [disabled_layers] if isinstance(disabled_layers, str) else list(disabled_layers or [])
    return any(fnmatch.fnmatchcase(name, p) for p in pats)


def match_space(group: str, names: list[str], spaces: list[Space]) -> tuple[int, Space] | None:
    """The one ``module_search_spaces`` entry matching every layer of a group (ValueError on a partial or double
    match), or None."""
    hits = []
    for i, sp in enumerate(spaces):
        m = [any(fnmatch.fnmatchcase(n, p) for p in sp.patterns) for n in names]
        if any(m) and not all(m):
            raise ValueError(
                f"auto_quantize: module_search_spaces[{i}] matches only part of the group {group!r} "
                f"(layers {names}, which share one format): make its patterns match all of them or none"
            )
        if all(m):
            hits.append((i, sp))
    if len(hits) > 1:
        raise ValueError(
            f"auto_quantize: module_search_spaces entries {[i for i, _ in hits]} all match the group {group!r}: "
            "make their module_name_patterns disjoint"
        )
    return hits[0] if hits else None


def resolve_groups(ref, cands, fixed_model, opts: Options, disabled_layers):
    """The groups to search or fix, the formats to score per searched group, and the candidate stats.

    ``stats[group]``: ``formats`` (the choices, by cost, float last when allowed), ``bits``, ``costs`` (numel x
    bits), ``module_names``, ``params``, ``fixed``, ``allow_no_quant`` and ``search_space`` (the index of the
    matching ``module_search_spaces`` entry, or None).
    """
    groups: dict[str, list[str]] = {}
    for n in searchable_layers(ref):
        if not is_disabled(n, disabled_layers):
            groups.setdefault(group_key(n), []).append(n)
    gformats: dict[str, list[str]] = {}
    stats: dict[str, dict] = {}
    for g, names in groups.items():
        numel = {n: ref.get_submodule(n).weight.numel() for n in names}
        total = sum(numel.values())
        hit = match_space(g, names, opts.spaces)
        space = hit[0] if hit else None
        fmts, allow = (hit[1].formats, hit[1].allow_no_quant) if hit else (opts.global_formats, True)
        if hit is None and fixed_model is not None:
            bits = {n: layer_bits(fixed_model.get_submodule(n)) for n in names}
            if all(b == FLOAT_BITS for b in bits.values()) and not any(
                layer_bits(c.get_submodule(n)) < FLOAT_BITS for c in cands.values() for n in names
            ):
                continue  # quantizable by no format at all: not counted
            cost = float(sum(numel[n] * bits[n] for n in names))
            assert opts.fixed is not None  # fixed_model is built from it
            fname = opts.fixed[0] if cost < FLOAT_BITS * total else NONE
            stats[g] = _stat([fname], [min(bits.values())], [cost], names, total, True, False, None)
            continue
        fbits = {f: {n: layer_bits(cands[f].get_submodule(n)) for n in names} for f in fmts}
        ok = [f for f in fmts if any(b < FLOAT_BITS for b in fbits[f].values())]
        if not ok:
            if not allow:
                raise ValueError(
                    f"auto_quantize: module_search_spaces[{space}] (allow_no_quant=False) matches {g!r}, but none "
                    f"of its formats {fmts} quantizes it"
                )
            continue  # no format quantizes it (e.g. an Embedding, off in every preset): not searched, not counted
        fcost = {f: float(sum(numel[n] * fbits[f][n] for n in names)) for f in ok}
        ok.sort(key=lambda f: (fcost[f], f))
        b = [min(fbits[f].values()) for f in ok]
        c = [fcost[f] for f in ok]
        if not allow and len(ok) == 1:
            stats[g] = _stat(ok, b, c, names, total, True, False, space)
            continue
        gformats[g] = ok
        if allow:
            ok, b, c = [*ok, NONE], [*b, FLOAT_BITS], [*c, float(FLOAT_BITS * total)]
        stats[g] = _stat(ok, b, c, names, total, False, allow, space)
    if not stats:
        raise ValueError("auto_quantize: no layer of the model is quantized by any of the formats: nothing to search")
    return {g: groups[g] for g in stats}, gformats, stats


def _stat(formats, bits, costs, names, params, fixed: bool, allow: bool, space: int | None) -> dict:
    return {
        "formats": list(formats),
        "bits": list(bits),
        "costs": list(costs),
        "module_names": list(names),
        "params": params,
        "fixed": fixed,
        "allow_no_quant": allow,
        "search_space": space,
    }
