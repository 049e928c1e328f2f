"""Validation of real checkpoints: the JSON config (every module spec) and the values of the integer tensors.

A checkpoint is untrusted input. :func:`check_config` checks the type and range of every entry of the config before
anything is built from it (so a spec cannot make the loader allocate or compute with nonsense), and
:func:`check_values` checks the codes (within the integer range the spec declares) and the scales (finite; weight
and SmoothQuant scales > 0, input scales >= 0 where 0 is a dead range). Problems raise ValueError
``load_real: <file>: <entry>: <why>`` with the bad value.
"""

from __future__ import annotations

import torch

from ..formats import int_range
from ..functional import blocks
from ..functional.checks import check_axes, first_bad
from . import fp8, microscaling
from .modules import _DTYPES
from .packing import unpack_int4
from .real_types import POOL_DIMS, REAL_CLASSES, WEIGHTED_TYPES

FORMAT, VERSION = "modelopt_lite.real", 1
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_WEIGHT_KEYS = {"num_bits", "unsigned", "narrow_range", "layout", "axis", "block_sizes", "storage", "dtype"}
_INPUT_KEYS = {"num_bits", "unsigned", "narrow_range", "num_steps", "pre_quant_scale", "elem", "dynamic"}
_SPEC_KEYS = {
    "QuantizedLinear": {"type", "weight_shape", "weight", "input", "bias", "force_dequant", "pre_quant_scale"},
    "QuantizedConv2d": {"type", "weight_shape", "weight", "input", "bias", "conv", "force_dequant"},
}
_POOL_SPEC_KEYS = {"type", "pool", "input"}
_POOL_KEYS = {"kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"}


def bad(path, entry: str, why: str) -> ValueError:
    """The error of a malformed checkpoint: ``load_real: <file>: <entry>: <why>``."""
    return ValueError(f"load_real: {path}: {entry}: {why}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v, n: int | None, lo: int) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and all(_is_int(x) and x >= lo for x in v)


def _keys(path, entry: str, d, allowed: set, required: set) -> None:
    if not isinstance(d, dict):
        raise bad(path, entry, f"must be an object, got {type(d).__name__} {d!r}")
    extra, missing = sorted(set(d) - allowed), sorted(required - set(d))
    if extra:
        raise bad(path, entry, f"has unknown key(s) {extra}")
    if missing:
        raise bad(path, entry, f"is missing key(s) {missing}")


def _bools(path, entry: str, d: dict, keys) -> None:
    for k in keys:
        if k in d and not isinstance(d[k], bool):
            raise bad(path, f"{entry}.{k}", f"must be true or false, got {d[k]!r}")


def _int_format(path, entry: str, d: dict) -> None:
    nb = d["num_bits"]
    if not _is_int(nb) or not 2 <= nb <= 8:
        raise bad(path, f"{entry}.num_bits", f"must be an int in 2..8, got {nb!r}")
    _bools(path, entry, d, ("unsigned", "narrow_range"))


def _check_microscaling(path, entry: str, d, weight: bool) -> None:
    keys = microscaling.WEIGHT_KEYS if weight else microscaling.INPUT_KEYS
    _keys(path, entry, d, keys, keys)
    why = microscaling.check_entry(d, weight)
    if why is not None:
        raise bad(path, entry, why)
    if weight and d["dtype"] not in _DTYPES:
        raise bad(path, f"{entry}.dtype", f"must be one of {sorted(_DTYPES)}, got {d['dtype']!r}")


def _check_input(path, entry: str, inp) -> None:
    if isinstance(inp, dict) and "format" in inp:
        _check_microscaling(path, entry, inp, weight=False)
        return
    _keys(path, entry, inp, _INPUT_KEYS, _INPUT_KEYS - {"pre_quant_scale", "elem", "dynamic"})
    _int_format(path, entry, inp)
    _bools(path, entry, inp, ("pre_quant_scale",))
    if not _is_int(inp["num_steps"]) or inp["num_steps"] < 1:
        raise bad(path, f"{entry}.num_steps", f"must be an int >= 1, got {inp['num_steps']!r}")
    elem, dyn = inp.get("elem", "int"), inp.get("dynamic")
    if elem not in ("int", "e4m3"):
        raise bad(path, f"{entry}.elem", f"must be 'int' or 'e4m3', got {elem!r}")
    if elem == "e4m3" and (inp["num_bits"] != 8 or inp["unsigned"] or inp["narrow_range"]):
        raise bad(path, entry, "E4M3 inputs have num_bits 8, unsigned false, narrow_range false")
    if dyn not in fp8.DYNAMIC or (dyn is not None and elem != "e4m3"):
        raise bad(path, f"{entry}.dynamic", f"must be null, or 'tensor' / 'row' for E4M3 inputs, got {dyn!r}")
    if dyn is not None and inp["num_steps"] != 1:
        raise bad(path, f"{entry}.num_steps", f"must be 1 for a dynamic input, got {inp['num_steps']!r}")


def _check_weight(path, entry: str, w, shape: list) -> None:
    if isinstance(w, dict) and "format" in w:
        _check_microscaling(path, entry, w, weight=True)
        return
    _keys(path, entry, w, _WEIGHT_KEYS, _WEIGHT_KEYS)
    _int_format(path, entry, w)
    if w["unsigned"]:
        raise bad(path, f"{entry}.unsigned", "real weights are signed")
    if w["storage"] not in ("int8", "int4", "e4m3") or (w["storage"] == "int4" and w["num_bits"] > 4):
        raise bad(path, f"{entry}.storage", f"must be 'int8', 'e4m3' or (num_bits <= 4) 'int4', got {w['storage']!r}")
    if w["storage"] == "e4m3" and (w["num_bits"] != 8 or w["narrow_range"] or w["layout"] == "block"):
        raise bad(path, entry, "E4M3 weights have num_bits 8, narrow_range false and a tensor or channel layout")
    if w["storage"] == "e4m3" and w["layout"] == "channel" and w["axis"] != [0]:
        raise bad(path, f"{entry}.axis", f"E4M3 weights are per output channel (axis [0]), got {w['axis']!r}")
    if w["dtype"] not in _DTYPES:
        raise bad(path, f"{entry}.dtype", f"must be one of {sorted(_DTYPES)}, got {w['dtype']!r}")
    layout, axis, bs = w["layout"], w["axis"], w["block_sizes"]
    if layout not in ("tensor", "channel", "block"):
        raise bad(path, f"{entry}.layout", f"must be 'tensor', 'channel' or 'block', got {layout!r}")
    if (layout == "channel") != (axis is not None) or (layout == "block") != (bs is not None):
        raise bad(path, entry, f"layout {layout!r} does not fit axis={axis!r}, block_sizes={bs!r}")
    try:
        if layout == "channel":
            if not isinstance(axis, list) or not axis or not all(_is_int(a) for a in axis):
                raise ValueError(f"axis must be a non-empty list of ints, got {axis!r}")
            check_axes(tuple(axis), len(shape), "axis")
        if layout == "block":
            if not isinstance(bs, dict) or not bs:
                raise ValueError(f"block_sizes must be a non-empty object, got {bs!r}")
            sizes = {}
            for k, v in bs.items():
                if not isinstance(k, str) or not k.lstrip("-").isdigit() or not (v is None or (_is_int(v) and v > 0)):
                    raise ValueError(f"block_sizes entry {k!r}: {v!r} is not 'axis': positive size")
                sizes[int(k)] = v
            blocks.normalize(sizes, shape)
    except ValueError as e:
        raise bad(path, entry, str(e)) from None


def _check_conv(path, entry: str, c, shape: list) -> None:
    keys = {"stride", "padding", "dilation", "groups", "padding_mode"}
    _keys(path, entry, c, keys, keys)
    for k in ("stride", "dilation"):
        if not _ints(c[k], 2, 1):
            raise bad(path, f"{entry}.{k}", f"must be two ints >= 1, got {c[k]!r}")
    if c["padding"] not in ("same", "valid") and not _ints(c["padding"], 2, 0):
        raise bad(path, f"{entry}.padding", f"must be two ints >= 0, 'same' or 'valid', got {c['padding']!r}")
    g = c["groups"]
    if not _is_int(g) or g < 1 or shape[0] % g:
        raise bad(path, f"{entry}.groups", f"must be an int >= 1 dividing {shape[0]} output channels, got {g!r}")
    if c["padding_mode"] not in _PADDING_MODES:
        raise bad(path, f"{entry}.padding_mode", f"must be one of {_PADDING_MODES}, got {c['padding_mode']!r}")


def _check_pool(path, entry: str, p, dims: int) -> None:
    _keys(path, entry, p, _POOL_KEYS, _POOL_KEYS)
    for k, lo in (("kernel_size", 1), ("stride", 1), ("padding", 0), ("dilation", 1)):
        if not _ints(p[k], dims, lo):
            raise bad(path, f"{entry}.{k}", f"must be {dims} int(s) >= {lo}, got {p[k]!r}")
    _bools(path, entry, p, ("ceil_mode", "return_indices"))


def check_spec(path, name: str, spec) -> None:
    """Type and range of every entry of one module spec."""
    entry = f"modules[{name!r}]"
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in REAL_CLASSES:
        raise bad(path, f"{entry}.type", f"unknown real module type {kind!r}; expected one of {sorted(REAL_CLASSES)}")
    if kind not in WEIGHTED_TYPES:
        _keys(path, entry, spec, _POOL_SPEC_KEYS, _POOL_SPEC_KEYS)
        _check_pool(path, f"{entry}.pool", spec["pool"], POOL_DIMS[kind])
        _check_input(path, f"{entry}.input", spec["input"])
        return
    _keys(path, entry, spec, _SPEC_KEYS[kind], _SPEC_KEYS[kind] - {"force_dequant", "pre_quant_scale"})
    shape = spec["weight_shape"]
    rank = 2 if kind == "QuantizedLinear" else 4
    if not _ints(shape, rank, 1):
        raise bad(path, f"{entry}.weight_shape", f"must be {rank} ints >= 1, got {shape!r}")
    _check_weight(path, f"{entry}.weight", spec["weight"], shape)
    if spec["input"] is not None:
        _check_input(path, f"{entry}.input", spec["input"])
        if spec["input"].get("pre_quant_scale") and kind != "QuantizedLinear":
            raise bad(path, f"{entry}.input.pre_quant_scale", "only QuantizedLinear has a pre_quant_scale")
    if spec["bias"] is not None and spec["bias"] not in _DTYPES:
        raise bad(path, f"{entry}.bias", f"must be null or one of {sorted(_DTYPES)}, got {spec['bias']!r}")
    _bools(path, entry, spec, ("force_dequant", "pre_quant_scale"))
    if spec.get("pre_quant_scale") and spec["input"] is not None:
        raise bad(
            path, f"{entry}.pre_quant_scale", "is for weight-only modules; a quantized input has input.pre_quant_scale"
        )
    if kind == "QuantizedConv2d":
        _check_conv(path, f"{entry}.conv", spec["conv"], shape)


def check_config(cfg, path) -> None:
    """The whole JSON config of a checkpoint (format, version, every module spec)."""
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT or cfg.get("version") != VERSION:
        got = (cfg.get("format"), cfg.get("version")) if isinstance(cfg, dict) else type(cfg).__name__
        raise ValueError(f"load_real: {path}: unsupported checkpoint format {got!r}; expected {FORMAT!r} v{VERSION}")
    modules = cfg.get("modules")
    if not isinstance(modules, dict):
        raise bad(path, "modules", f"must be an object (module name -> spec), got {type(modules).__name__}")
    for name, spec in modules.items():
        if not name:
            raise bad(path, "modules['']", "the model itself cannot be a real module")
        check_spec(path, name, spec)


def _fail_values(path, key: str, t: torch.Tensor, ok: torch.Tensor, what: str) -> None:
    if not bool(ok.all()):
        raise bad(path, key, f"{what}, got {first_bad(t, ~ok)!r}")


def check_values(path, name: str, spec: dict, tensors: dict) -> None:
    """Codes within the declared integer range; scales finite and positive (input scales may be 0: dead range)."""
    inp = spec.get("input")
    if inp is not None and inp.get("dynamic") is None:
        key = f"{name}.input_scale"
        t = tensors[key]
        _fail_values(path, key, t, torch.isfinite(t) & (t >= 0), "input scales must be finite and >= 0")
    if inp is not None or spec.get("pre_quant_scale"):
        key = f"{name}.pre_quant_scale"
        if key in tensors:
            t = tensors[key]
            _fail_values(path, key, t, torch.isfinite(t) & (t > 0), "pre_quant_scale must be finite and > 0")
    if spec["type"] not in WEIGHTED_TYPES:
        return
    w = spec["weight"]
    if microscaling.is_microscaling(w):
        found = microscaling.check_values(spec, tensors, name)
        if found is not None:
            _fail_values(path, *found)
        return
    if w["storage"] == "e4m3":
        found = fp8.check_values(path, name, tensors)
        if found is not None:
            _fail_values(path, *found)
    else:
        _, qmin, qmax = int_range(w["num_bits"], False, w["narrow_range"])
        if w["storage"] == "int8":
            key = f"{name}.weight"
            codes = tensors[key]
        else:
            key = f"{name}.weight_packed"
            codes = unpack_int4(tensors[key], spec["weight_shape"][-1], signed=True)
        ok = (codes >= qmin) & (codes <= qmax)
        _fail_values(path, key, codes, ok, f"weight codes must lie in [{qmin}, {qmax}]")
    key = f"{name}.weight_scale"
    t = tensors[key]
    _fail_values(path, key, t, torch.isfinite(t) & (t > 0), "weight scales must be finite and > 0")
