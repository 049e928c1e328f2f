"""``ScaledQuantDescriptor`` (alias ``QuantDescriptor``): an immutable, validated description of a quantizer.

A descriptor says *how* a tensor is quantized (format, granularity, calibration); a ``TensorQuantizer`` built
from it holds the state (amax, calibrator). Descriptors compare equal field by field, hash, and round-trip through
``dict()``: ``ScaledQuantDescriptor(**d.dict()) == d``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np

from .formats import (
    MX_SCALE_ROUNDINGS,
    SCALE_ROUNDING_KEY,
    BlockScheme,
    block_scheme,
    element_format,
    int_range,
    is_float_format,
)

_DEFAULTS: dict[str, Any] = {
    "num_bits": 8,
    "name": None,
    "fake_quant": True,
    "axis": None,
    "block_sizes": None,
    "amax": None,
    "learn_amax": False,
    "scale_amax": None,
    "calib_method": "max",
    "unsigned": False,
    "narrow_range": False,
    "dynamic": False,
    "enable": True,
}
_CALIB_METHODS = ("max", "histogram")
_PlainDict = dict  # the builtin, for annotations inside the class (whose ``dict`` is a method)
_BLOCK_KEYS = ("type", "scale_bits", "scale_block_sizes", SCALE_ROUNDING_KEY)


class FrozenDict(dict):
    """A dict that cannot change after construction: reads, compares, hashes, pickles and JSON-dumps like a dict.

    A descriptor's ``block_sizes`` (and its nested ``scale_block_sizes``) is one, so a caller holding
    ``desc.block_sizes`` cannot change the descriptor (or its hash) behind its back. ``dict(fd)`` gives a mutable copy.
    """

    def _immutable(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("this dict is read-only (a descriptor's block_sizes); copy it with dict(...) to change it")

    __setitem__ = __delitem__ = _immutable
    update = pop = popitem = clear = setdefault = _immutable
    __ior__ = _immutable

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(_freeze(dict(self)))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict) -> FrozenDict:
        return self


def _thaw(v):
    """Plain (mutable) dicts all the way down, for ``dict()`` and YAML."""
    if isinstance(v, dict):
        return {k: _thaw(x) for k, x in v.items()}
    return v


def _check_bool(field: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{field} must be a bool, got {v!r}")
    return bool(v)


def _check_num_bits(v, field: str = "num_bits"):
    if isinstance(v, (tuple, list)):
        v = tuple(v)
        if len(v) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise TypeError(f"{field} as a tuple must be (E, M) integers, got {v!r}")
        if min(v) < 0 or v[0] == 0:  # (ModelOpt's wording, which its users match on)
            raise ValueError(f"{field} must be a positive integer or a tuple of positive integers. Got {v!r}")
        fmt = element_format(v)  # ValueError naming the supported formats
        if fmt.name == "e8m0" and field == "num_bits":
            raise ValueError(f"num_bits={v!r} (E8M0) is a scale format only: use it as block_sizes['scale_bits']")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{field} must be an int in 1..16 or an (E, M) tuple such as (4, 3), got {v!r}")
    if int(v) < 1:  # (ModelOpt's wording, which its users match on)
        raise ValueError(f"{field} must be a positive integer or a tuple of positive integers. Got {v}: use 1..16")
    if int(v) > 16:
        raise ValueError(f"{field} must be in 1..16, got {v}")
    return int(v)


def _check_axis(v):
    if v is None:
        return None
    items = v if isinstance(v, (tuple, list)) else (v,)
    if not items or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in items):
        raise TypeError(f"axis must be None, an int or a non-empty tuple of ints, got {v!r}")
    items = tuple(int(a) for a in items)
    if len(set(items)) != len(items):
        raise ValueError(f"axis has repeated entries: {v!r}")
    return items[0] if not isinstance(v, (tuple, list)) else items


def _check_block_sizes(v):
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise TypeError(f"block_sizes must be a dict {{axis: size, ...}}, got {type(v).__name__}")
    out: dict[Any, Any] = {}
    for k, size in v.items():
        if isinstance(k, str):
            if k not in _BLOCK_KEYS:
                raise ValueError(f"block_sizes: unknown key {k!r}; allowed string keys are {_BLOCK_KEYS}")
            if k == "type" and size not in ("static", "dynamic"):
                raise ValueError(f"block_sizes['type'] must be 'static' or 'dynamic', got {size!r}")
            if k == "scale_bits":
                size = _check_num_bits(size, "block_sizes['scale_bits']")
            if k == SCALE_ROUNDING_KEY and (not isinstance(size, str) or size not in MX_SCALE_ROUNDINGS):
                raise ValueError(f"block_sizes['scale_rounding'] must be one of {MX_SCALE_ROUNDINGS}, got {size!r}")
            if k == "scale_block_sizes":
                size = _check_block_sizes(size)
                if size and any(isinstance(kk, str) for kk in size):
                    raise ValueError("block_sizes['scale_block_sizes'] takes only {axis: size} entries")
            out[k] = size
            continue
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"block_sizes keys must be axes (ints) or one of {_BLOCK_KEYS}, got {k!r}")
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0):
            raise ValueError(f"block_sizes[{k}] must be a positive int (or None for the whole axis), got {size!r}")
        out[int(k)] = None if size is None else int(size)
    if not any(isinstance(k, int) for k in out):
        raise ValueError(f"block_sizes needs at least one {{axis: size}} entry, got {v!r}")
    if "scale_block_sizes" in out and "scale_bits" not in out:
        raise ValueError("block_sizes['scale_block_sizes'] needs block_sizes['scale_bits']")
    return FrozenDict(out)


def _check_amax(v):
    if v is None:
        return None
    try:
        arr = np.array(v, dtype=np.float32)
    except (TypeError, ValueError):
        raise TypeError(f"amax must be float, list or ndarray, got {v!r}") from None
    if arr.size == 0:
        raise ValueError("amax must not be empty")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        bad = arr[~np.isfinite(arr) | (arr < 0)].ravel()[0]
        raise ValueError(f"amax must be finite and >= 0, got {float(bad)!r}")
    arr.setflags(write=False)
    return arr


def _freeze(v):
    """A hashable, comparable form of a field value."""
    if isinstance(v, np.ndarray):
        return ("ndarray", v.shape, tuple(v.ravel().tolist()))
    if isinstance(v, dict):
        return tuple(sorted(((str(k), _freeze(x)) for k, x in v.items())))
    return v


class ScaledQuantDescriptor:
    """How to quantize a tensor: format, granularity, range and calibration. Immutable and validated.

    Args:
        num_bits: int in 1..16 for integer formats, ``(4, 3)`` for FP8 E4M3, ``(5, 2)`` for FP8 E5M2, ``(2, 1)``
            for FP4 E2M1 (per tensor, per channel, or in NVFP4/MX blocks: see
            :data:`modelopt_lite.formats.BLOCK_SCHEMES`). Default 8.
        name: optional label.
        fake_quant: True to simulate (quantize-dequantize); False for real quantization (integer codes).
        axis: None (per tensor), an int or a tuple of ints: the axes that keep their own amax (per channel).
            Negative values count from the end; checked against the input rank when used.
        block_sizes: ``{axis: size}`` block quantization (``None`` size = the whole axis), plus optional
            ``"type": "static"|"dynamic"``, ``"scale_bits"`` and ``"scale_block_sizes"`` (double quantization of
            the per-block scales), and for MX blocks ``"scale_rounding": "floor"|"rceil"`` (the E8M0 scale rule;
            default the scheme's, :data:`modelopt_lite.formats.BLOCK_SCHEMES`). Mutually exclusive with ``axis``.
        amax: a fixed range (float or array); with ``learn_amax`` it initializes the learned range.
        learn_amax: learn amax by gradient descent (LSQ-style gradient, see ``numerics.md``).
        scale_amax: multiply amax by this factor before use (quick experiments).
        calib_method: ``"max"`` or ``"histogram"``.
        unsigned: use ``[0, 2**b - 1]``.
        narrow_range: use the symmetric signed grid ``[-(2**(b-1) - 1), 2**(b-1) - 1]``.
        dynamic: recompute amax from every input instead of calibrating.
        enable: False builds quantizers that start disabled (ModelOpt's ``enable`` attribute). Default True.

    Every field is a read-only property (setting one raises AttributeError); ``block_sizes`` reads like a dict but
    cannot be changed (:class:`FrozenDict`). ``to_yaml()`` / ``from_yaml()`` round-trip a descriptor through YAML
    (needs PyYAML).

    Raises:
        TypeError: unknown keyword arguments (named) or a wrongly typed field.
        ValueError: an out-of-range field or contradictory settings (the message says why).
    """

    __slots__ = (*(f"_{k}" for k in _DEFAULTS), "_scheme")
    _num_bits: int | tuple[int, int]
    _name: str | None
    _fake_quant: bool
    _axis: int | tuple[int, ...] | None
    _block_sizes: FrozenDict | None
    _amax: np.ndarray | None
    _learn_amax: bool
    _scale_amax: float | None
    _calib_method: str
    _unsigned: bool
    _narrow_range: bool
    _dynamic: bool
    _enable: bool
    _scheme: BlockScheme | None

    def __init__(self, num_bits=8, name=None, **kwargs):
        unknown = sorted(set(kwargs) - set(_DEFAULTS))
        if unknown:
            raise TypeError(f"ScaledQuantDescriptor got unknown keyword argument(s): {', '.join(unknown)}")
        f = dict(_DEFAULTS, num_bits=num_bits, name=name, **kwargs)
        f["num_bits"] = _check_num_bits(f["num_bits"])
        if f["name"] is not None and not isinstance(f["name"], str):
            raise TypeError(f"name must be a str or None, got {f['name']!r}")
        for b in ("fake_quant", "learn_amax", "unsigned", "narrow_range", "dynamic", "enable"):
            f[b] = _check_bool(b, f[b])
        f["axis"] = _check_axis(f["axis"])
        f["block_sizes"] = _check_block_sizes(f["block_sizes"])
        f["amax"] = _check_amax(f["amax"])
        if f["scale_amax"] is not None:
            sa = f["scale_amax"]
            if isinstance(sa, bool) or not isinstance(sa, (int, float)) or not math.isfinite(sa) or sa <= 0:
                raise ValueError(f"scale_amax must be a finite number > 0, got {sa!r}")
            f["scale_amax"] = float(sa)
        if f["calib_method"] not in _CALIB_METHODS:
            raise ValueError(f"calib_method must be one of {_CALIB_METHODS}, got {f['calib_method']!r}")
        self._validate_combination(f)
        for k, v in f.items():
            object.__setattr__(self, f"_{k}", v)
        # the block scheme, looked up once (every quantizer call reads it several times; the fields are immutable)
        object.__setattr__(self, "_scheme", block_scheme(f["num_bits"], f["block_sizes"]))

    @staticmethod
    def _validate_combination(f: dict) -> None:
        if f["axis"] is not None and f["block_sizes"] is not None:
            raise ValueError("axis and block_sizes are mutually exclusive: block_sizes already sets the granularity")
        if is_float_format(f["num_bits"]):
            name = element_format(f["num_bits"]).name.upper()
            if f["unsigned"]:
                raise ValueError(f"unsigned=True is meaningless for {name} (num_bits={f['num_bits']}), which is signed")
            if f["narrow_range"]:
                raise ValueError(f"narrow_range=True applies to integer formats only, not {name}")
        else:
            int_range(f["num_bits"], f["unsigned"], f["narrow_range"])  # raises for a signed 1-bit grid
        scheme = _check_scheme(f)  # ValueError for scale_rounding on NVFP4 (formats.block_scheme)
        if scheme is None and f["block_sizes"] and SCALE_ROUNDING_KEY in f["block_sizes"]:
            raise ValueError(
                f"block_sizes['scale_rounding'] applies to MX blocks only (scale_bits=(8, 0), num_bits (4, 3), (5, 2), "
                f"(2, 1) or 8), got num_bits={f['num_bits']!r}, scale_bits={f['block_sizes'].get('scale_bits')!r}"
            )
        block_dynamic = bool(f["block_sizes"]) and f["block_sizes"].get("type") == "dynamic"
        block_dynamic = block_dynamic and not (scheme and scheme.calibrates_amax)  # NVFP4: calibrated global amax
        if f["learn_amax"] and (f["dynamic"] or block_dynamic):
            raise ValueError("learn_amax=True contradicts dynamic quantization: a dynamic amax is recomputed per input")
        if f["amax"] is not None and (f["dynamic"] or block_dynamic):
            raise ValueError("a fixed amax contradicts dynamic quantization; drop amax or dynamic")

    def __setattr__(self, key, value):
        raise AttributeError(f"ScaledQuantDescriptor is immutable (tried to set {key!r}); build a new one")

    def __delattr__(self, key):
        raise AttributeError(f"ScaledQuantDescriptor is immutable (tried to delete {key!r}); build a new one")

    def __reduce__(self):
        return (_rebuild, (self.dict(),))

    # read-only properties
    num_bits = property(lambda self: self._num_bits, doc="int bits, or (E, M) for a float format.")
    name = property(lambda self: self._name, doc="Optional label.")
    fake_quant = property(lambda self: self._fake_quant, doc="True: simulate; False: integer codes.")
    axis = property(lambda self: self._axis, doc="Per-channel axis/axes, or None.")
    block_sizes = property(
        lambda self: self._block_sizes, doc="Block quantization spec (a read-only dict, see FrozenDict) or None."
    )
    amax = property(lambda self: self._amax, doc="Fixed amax (read-only float32 ndarray) or None.")
    learn_amax = property(lambda self: self._learn_amax, doc="Whether amax is learned.")
    scale_amax = property(lambda self: self._scale_amax, doc="Multiplier applied to amax, or None.")
    calib_method = property(lambda self: self._calib_method, doc='"max" or "histogram".')
    unsigned = property(lambda self: self._unsigned, doc="Unsigned integer grid.")
    narrow_range = property(lambda self: self._narrow_range, doc="Symmetric signed grid.")
    enable = property(lambda self: self._enable, doc="False: quantizers built from it start disabled.")

    @property
    def dynamic(self) -> bool:
        """True when amax is recomputed from each input (``dynamic=True`` or dynamic blocks)."""
        scheme = self._scheme
        if scheme is not None:  # NVFP4 calibrates its per-tensor global amax; MX is dynamic
            return self._dynamic or not scheme.calibrates_amax
        return self._dynamic or bool(self._block_sizes and self._block_sizes.get("type") == "dynamic")

    @property
    def nvfp4_static(self) -> bool:
        """True for static NVFP4 (``block_sizes['type'] == 'static'``): stored block amaxes and a global amax."""
        scheme = self._scheme
        bs = self._block_sizes
        return scheme is not None and bs is not None and scheme.kind == "nvfp4" and bs.get("type") == "static"

    @property
    def per_block_amax(self) -> bool:
        """True when the stored amax has one value per block (static generic blocks, static NVFP4)."""
        bs = self._block_sizes
        return bool(bs) and (self._scheme is None or self.nvfp4_static)

    @property
    def block_scheme(self):
        """The :class:`~modelopt_lite.formats.BlockScheme` (NVFP4, MXFP8, MXFP4, MXINT8, ...) or None."""
        return self._scheme

    def dict(self) -> _PlainDict[str, Any]:
        """The fields that differ from their defaults (amax as a list, block_sizes as plain dicts), enough to rebuild
        an equal descriptor."""
        out = {}
        for k, default in _DEFAULTS.items():
            v = getattr(self, f"_{k}")
            same = (v is None and default is None) if isinstance(v, np.ndarray) or v is None else v == default
            if not same:
                out[k] = v.tolist() if isinstance(v, np.ndarray) else _thaw(v)
        return out

    def to_yaml(self) -> str:
        """The :meth:`dict` fields as a YAML mapping (tuples written as lists); needs PyYAML."""
        yaml = _yaml()
        return yaml.safe_dump(_yaml_plain(self.dict()), sort_keys=False, width=120)

    @classmethod
    def from_yaml(cls, yaml_str: str) -> ScaledQuantDescriptor:
        """A descriptor from :meth:`to_yaml` output (or any YAML mapping of its fields); needs PyYAML.

        Only plain YAML is read (``safe_load``: no Python tags). Raises TypeError when the text is not a mapping of
        field names, and the usual descriptor errors for bad values.
        """
        yaml = _yaml()
        if not isinstance(yaml_str, str):
            raise TypeError(f"from_yaml expects the YAML text as a str, got {type(yaml_str).__name__}")
        try:
            fields = yaml.safe_load(yaml_str)
        except yaml.YAMLError as e:
            raise ValueError(f"from_yaml: not valid YAML: {e}") from None
        if fields is None:
            fields = {}
        if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
            raise TypeError(f"from_yaml: expected a mapping of descriptor fields, got {type(fields).__name__}")
        return cls(**fields)

    def _key(self):
        return tuple(_freeze(getattr(self, f"_{k}")) for k in _DEFAULTS)

    def __eq__(self, other):
        return isinstance(other, ScaledQuantDescriptor) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        body = ", ".join(f"{k}={v!r}" for k, v in self.dict().items())
        return f"ScaledQuantDescriptor({body})"

    @staticmethod
    def get_block_quant_axes_and_sizes(block_sizes) -> _PlainDict[Any, Any]:
        """``{axis: size}`` entries of a block_sizes dict (the string keys removed)."""
        if block_sizes is None:
            return {}
        return {k: v for k, v in block_sizes.items() if not isinstance(k, str)}


def _check_scheme(f: dict):
    """The block scheme of the fields (NVFP4/MX), validated: last-axis blocks of an allowed size, nothing else."""
    nb, bs = f["num_bits"], f["block_sizes"]
    scheme = block_scheme(nb, bs)
    if scheme is None:
        elem = element_format(nb) if is_float_format(nb) else None
        if elem is not None and not elem.scaled:
            raise ValueError(f"num_bits={nb!r} ({elem.name.upper()}) has no float32-scaled quantization")
        if bs and bs.get("scale_bits") == (8, 0):
            raise ValueError(f"scale_bits=(8, 0) (E8M0, OCP MX) needs num_bits (4, 3), (5, 2), (2, 1) or 8, got {nb!r}")
        return None
    axes = {k: v for k, v in bs.items() if not isinstance(k, str)}
    if list(axes.items()) not in ([(-1, b)] for b in scheme.blocks):
        raise ValueError(
            f"{scheme.name.upper()} blocks run along the last axis with a size in {scheme.blocks}: block_sizes "
            f"{{-1: {scheme.blocks[0]}, ...}}, got {axes!r}"
        )
    static = bs.get("type", "dynamic") == "static"
    if static and scheme.kind != "nvfp4":
        raise ValueError(f"{scheme.name.upper()} computes its block scales from each input: block_sizes['type'] "
                         f"must be 'dynamic', got {bs.get('type')!r}")  # fmt: skip
    if static and (f["dynamic"] or f["amax"] is not None):
        what = "dynamic=True" if f["dynamic"] else "a fixed (per-tensor) amax"
        raise ValueError(f"static NVFP4 (block_sizes['type'] 'static') stores one amax per block: {what} does not "
                         "apply (calibrate it, or set the quantizer's amax and global_amax)")  # fmt: skip
    if "scale_block_sizes" in bs:
        raise ValueError(f"{scheme.name.upper()} has no scale_block_sizes (its scale format is fixed)")
    if f["unsigned"] or f["narrow_range"]:
        raise ValueError(f"{scheme.name.upper()} is signed (unsigned/narrow_range do not apply)")
    if f["learn_amax"]:
        raise ValueError(f"learn_amax=True is not supported for {scheme.name.upper()}")
    if f["amax"] is not None and not scheme.calibrates_amax:
        raise ValueError(f"{scheme.name.upper()} takes no amax (its E8M0 scales come from each block)")
    if f["amax"] is not None and np.asarray(f["amax"]).size != 1:
        raise ValueError(f"{scheme.name.upper()}'s amax is per tensor (one value), got {np.asarray(f['amax']).size}")
    return scheme


def _rebuild(d):
    return ScaledQuantDescriptor(**d)


def _yaml():
    try:
        import yaml  # optional dependency: only the YAML helpers need it
    except ImportError:
        raise ImportError(
            "ScaledQuantDescriptor.to_yaml/from_yaml need PyYAML; install it with `pip install pyyaml`"
        ) from None
    return yaml


def _yaml_plain(v):
    """Tuples as lists (``safe_dump`` writes no Python tags); dicts recursively."""
    if isinstance(v, dict):
        return {k: _yaml_plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [_yaml_plain(x) for x in v]
    return v


QuantDescriptor = ScaledQuantDescriptor

# Predefined descriptors with the familiar names.
QUANT_DESC_8BIT_PER_TENSOR = QuantDescriptor(num_bits=8)
QUANT_DESC_UNSIGNED_8BIT_PER_TENSOR = QuantDescriptor(num_bits=8, unsigned=True)
QUANT_DESC_8BIT_CONV1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_CONV3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=0)
QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW = QuantDescriptor(num_bits=8, axis=0)
# ConvTranspose weights are (in, out/groups, *k): per output channel is axis 1 (as pytorch-quantization's fixed
# constants and ONNX Runtime's quantizer); the QuantConvTranspose modules use these. For TensorRT versions that
# support only per-input-channel deconvolution weights (NVIDIA/TensorRT #1694, #2380) pass axis=0 explicitly.
QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=1)
QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=1)
QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL = QuantDescriptor(num_bits=8, axis=1)
QUANT_DESC_FP8_PER_TENSOR = QuantDescriptor(num_bits=(4, 3))
QUANT_DESC_4BIT_BLOCK_WEIGHT = QuantDescriptor(num_bits=4, block_sizes={-1: 128})
