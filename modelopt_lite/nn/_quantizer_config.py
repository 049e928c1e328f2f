"""Descriptor patching and text summaries for :class:`~modelopt_lite.nn.TensorQuantizer` (no state lives here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..descriptor import _DEFAULTS, ScaledQuantDescriptor
from ..formats import element_format, is_float_format
from ._affine_bias import check_bias_config

#: keys besides the descriptor fields (``enable`` is one) that ``set_from_attribute_config`` accepts
EXTRA_KEYS = ("num_steps", "trt_high_precision_dtype", "pass_through_bwd", "effective_bits", "bias", "calibrator")
#: defaults of the settings a quantizer keeps besides its descriptor (ModelOpt's names and defaults, except
#: ``pass_through_bwd``: ours is False, the clipped straight-through estimator of pytorch-quantization)
PEER_DEFAULTS = {"trt_high_precision_dtype": "Float", "pass_through_bwd": False, "effective_bits": None}
_TRT_DTYPES = ("Float", "Half", "BFloat16")
#: ModelOpt QuantizerAttributeConfig keys accepted only at the value that changes nothing (what else they ask for,
#: modelopt_lite does not do)
_ONLY_DEFAULT = {
    "rotate": (False, "input rotation (QuaRot/SpinQuant) is not provided"),
    "backend": (None, "custom quantization backends are not provided"),
    "backend_extra_args": (None, "custom quantization backends are not provided"),
}
#: ModelOpt keys translated to descriptor fields: the amax pinned to a constant (calibration skips the quantizer)
_PINNED = ("use_constant_amax", "constant_amax")
#: every ModelOpt-only key ``split_patch`` understands
PEER_KEYS = frozenset(_ONLY_DEFAULT) | frozenset(_PINNED) | frozenset(PEER_DEFAULTS) | {"bias"}


def check_peer_extra(key: str, value, label: str):
    """Validate one of :data:`PEER_DEFAULTS`' settings; returns the value to store."""
    if key == "trt_high_precision_dtype" and value not in _TRT_DTYPES:
        raise ValueError(f"{label}: trt_high_precision_dtype must be one of {_TRT_DTYPES}, got {value!r}")
    if key == "pass_through_bwd" and not isinstance(value, bool):
        raise TypeError(f"{label}: pass_through_bwd must be a bool, got {value!r}")
    if key == "effective_bits" and value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 16:
            raise ValueError(f"{label}: effective_bits must be None or a number in (0, 16], got {value!r}")
        value = float(value)
    return value


def check_calibrator_factory(value, label: str) -> tuple | None:
    """ModelOpt's ``calibrator`` given as a class or ``(cls, args, kwargs)`` (the quantizer builds ``cls(*args,
    **kwargs)``); returns ``(cls, args, kwargs)``. The class must have ``collect``, ``compute_amax`` and ``reset``."""
    if value is None:
        return None
    parts = (value,) if isinstance(value, type) else value
    if not isinstance(parts, (tuple, list)) or not 1 <= len(parts) <= 3 or not isinstance(parts[0], type):
        raise TypeError(f"{label}: calibrator must be a class or (class, args, kwargs), got {value!r}")
    cls: type = parts[0]
    args: Any = parts[1] if len(parts) > 1 else ()  # (cls,), (cls, args) or (cls, args, kwargs)
    kwargs: Any = parts[2] if len(parts) > 2 else {}
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, Mapping):
        raise TypeError(f"{label}: calibrator (class, args, kwargs) needs a tuple of args and a dict of kwargs")
    for method in ("collect", "compute_amax", "reset"):
        if not callable(getattr(cls, method, None)):
            raise TypeError(f"{label}: calibrator class {cls.__module__}.{cls.__qualname__} has no {method}() method")
    return (cls, tuple(args), dict(kwargs))


def translate_peer(attrs: Mapping, label: str) -> dict:
    """ModelOpt's extra QuantizerAttributeConfig keys -> ours: ``use_constant_amax=True`` is ``amax=448.0`` (the
    FP8 E4M3 range, as ModelOpt pins it), ``constant_amax=v`` is ``amax=v``; ``bias`` (the affine bias) is
    validated and normalized; ``rotate``/``backend``/``backend_extra_args`` must be at their no-op value;
    ``block_size`` (a functional argument, not a quantizer attribute) is rejected with a hint. Other keys pass
    unchanged."""
    out = dict(attrs)
    if "block_size" in out:
        raise TypeError(
            f"{label}: 'block_size' is not a quantizer attribute (ModelOpt's fake_tensor_quant takes it for export "
            "only); give block quantization as block_sizes={-1: N}"
        )
    for key, (default, why) in _ONLY_DEFAULT.items():
        if key in out:
            value = out.pop(key)
            off = value is default or value == default
            if not off:
                raise ValueError(f"{label}: {key}={value!r} cannot be honoured: {why}")
    if "bias" in out:  # the affine bias (nn/_affine_bias.py), normalized; {"enable": False} is None
        out["bias"] = check_bias_config(out["bias"], label)
    pinned = None
    if out.pop("use_constant_amax", False):
        pinned = 448.0
    if out.get("constant_amax") is not None:
        v = out["constant_amax"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{label}: constant_amax must be a positive number, got {v!r}")
        if pinned is not None and float(v) != pinned:
            raise ValueError(f"{label}: use_constant_amax=True (448) contradicts constant_amax={v!r}")
        pinned = float(v)
    out.pop("constant_amax", None)
    if pinned is not None:
        if out.get("amax") is not None and out["amax"] != pinned:
            raise ValueError(f"{label}: a constant amax {pinned} contradicts amax={out['amax']!r}")
        out["amax"] = pinned
    return out


#: descriptor fields whose change invalidates a calibrated amax (and the calibrators)
FORMAT_KEYS = ("num_bits", "axis", "block_sizes", "unsigned", "calib_method", "dynamic")


def full_fields(desc: ScaledQuantDescriptor) -> dict:
    """Every field of a descriptor (defaults included), usable as ``ScaledQuantDescriptor(**fields)``."""
    return {**_DEFAULTS, **desc.dict()}


def _frozen(v):
    """A hashable form of a (nested) setting value, for equality and hashing."""
    if isinstance(v, Mapping):
        return tuple(sorted((str(k), _frozen(x)) for k, x in v.items()))
    if isinstance(v, (tuple, list)):
        return tuple(_frozen(x) for x in v)
    return v


class QuantizerAttributeConfig(ScaledQuantDescriptor):
    """ModelOpt's ``QuantizerAttributeConfig``: a descriptor that also carries ModelOpt's quantizer settings that
    are not descriptor fields (``bias``, ``num_steps``, ``calibrator``, ``trt_high_precision_dtype``,
    ``pass_through_bwd``, ``effective_bits``, ``use_constant_amax`` / ``constant_amax``, and ``rotate`` / ``backend``
    at their no-op values).

    Those settings are validated when it is built (the same checks as ``set_from_attribute_config``, errors naming
    ``QuantizerAttributeConfig``) and kept in :attr:`extras`; a :class:`TensorQuantizer` built from it (directly,
    as ``quant_desc_input=`` / ``quant_desc_weight=`` of a quant module, or through ``set_from_attribute_config``)
    applies them. Without such settings it is an ordinary descriptor (equal to the ``ScaledQuantDescriptor`` with
    the same fields). :meth:`dict` gives the descriptor fields only.
    """

    __slots__ = ("_extras",)
    _extras: dict

    def __init__(self, num_bits=None, name=None, **kwargs):
        label = "QuantizerAttributeConfig"
        if num_bits is None and name is None and kwargs == {"enable": True}:  # ModelOpt's rule and wording
            raise ValueError(
                "Invalid quantizer config: Cannot specify only {'enable': True}. Additional parameters are required "
                "when enabling quantization."
            )
        num_bits = 8 if num_bits is None else num_bits
        peer = {k: kwargs.pop(k) for k in list(kwargs) if k in EXTRA_KEYS or k in PEER_KEYS}
        if "amax" in kwargs and any(k in peer for k in _PINNED):
            peer["amax"] = kwargs.pop("amax")  # checked against the pinned constant by translate_peer
        changes, extra = split_patch(peer, label) if peer else ({}, {})
        super().__init__(num_bits, name, **kwargs, **changes)
        if "num_steps" in extra:
            n = extra["num_steps"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{label}: num_steps must be an int >= 1, got {n!r}")
        object.__setattr__(self, "_extras", extra)

    @property
    def extras(self) -> dict:
        """The settings beyond the descriptor fields, validated (a copy)."""
        return dict(self._extras)

    def _key(self):
        base = super()._key()
        return base + (_frozen(self._extras),) if self._extras else base

    def __hash__(self):
        return hash(self._key())

    def __reduce__(self):
        return (_rebuild_attribute_config, (self.dict(), self.extras))

    def __repr__(self):
        body = ", ".join(f"{k}={v!r}" for k, v in {**self.dict(), **self._extras}.items())
        return f"QuantizerAttributeConfig({body})"


def _rebuild_attribute_config(fields: dict, extras: dict) -> QuantizerAttributeConfig:
    return QuantizerAttributeConfig(**fields, **extras)


def peer_extras(desc) -> dict:
    """The settings a :class:`QuantizerAttributeConfig` carries beyond its descriptor fields (``{}`` otherwise)."""
    return desc.extras if isinstance(desc, QuantizerAttributeConfig) else {}


def as_descriptor(value, what: str) -> ScaledQuantDescriptor:
    """A descriptor from a descriptor or a dict of its fields (a :class:`QuantizerAttributeConfig` when the dict
    has ModelOpt's settings beyond the descriptor fields, such as ``bias``)."""
    if isinstance(value, ScaledQuantDescriptor):
        return value
    if isinstance(value, Mapping):
        if any(k in EXTRA_KEYS or k in PEER_KEYS for k in value):
            return QuantizerAttributeConfig(**value)
        return ScaledQuantDescriptor(**value)
    raise TypeError(f"{what} must be a ScaledQuantDescriptor or a dict of its fields, got {type(value).__name__}")


def split_patch(attrs, label: str) -> tuple[dict, dict]:
    """Validate the keys of an attribute config; return (descriptor changes, extra settings)."""
    if isinstance(attrs, ScaledQuantDescriptor):
        attrs = {**full_fields(attrs), **peer_extras(attrs)}
    if not isinstance(attrs, Mapping):
        raise TypeError(
            f"{label}: the attribute config must be a dict or a ScaledQuantDescriptor, got {type(attrs).__name__}"
        )
    attrs = translate_peer(attrs, label)
    unknown = [k for k in attrs if k not in _DEFAULTS and k not in EXTRA_KEYS]
    if unknown:
        raise TypeError(
            f"{label}: unknown quantizer attribute(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(list(_DEFAULTS) + list(EXTRA_KEYS))}"
        )
    changes = {k: v for k, v in attrs.items() if k in _DEFAULTS}
    extra = {k: v for k, v in attrs.items() if k in EXTRA_KEYS}
    for k in PEER_DEFAULTS:
        if k in extra:
            extra[k] = check_peer_extra(k, extra[k], label)
    if "calibrator" in extra:
        extra["calibrator"] = check_calibrator_factory(extra["calibrator"], label)
    return changes, extra


def patched_descriptor(desc: ScaledQuantDescriptor, changes: dict, label: str) -> ScaledQuantDescriptor:
    """``desc`` with ``changes`` applied; conflicts a patch obviously means to override are resolved for it.

    - setting ``block_sizes`` clears ``axis`` and vice versa (they are mutually exclusive);
    - switching to a float format (E4M3, E5M2, E2M1) clears ``unsigned`` / ``narrow_range``;
    - switching to dynamic quantization drops a fixed ``amax``.
    Keys named in the patch always win; a genuine contradiction still raises.
    """
    changes = dict(changes)
    if changes.get("block_sizes") is not None:
        changes.setdefault("axis", None)
    if changes.get("axis") is not None:
        changes.setdefault("block_sizes", None)
    nb = changes.get("num_bits")
    if is_float_format(nb):
        changes.setdefault("unsigned", False)
        changes.setdefault("narrow_range", False)
    bs = changes.get("block_sizes")
    if changes.get("dynamic") or (isinstance(bs, Mapping) and bs.get("type") == "dynamic"):
        changes.setdefault("amax", None)
    try:
        return ScaledQuantDescriptor(**{**full_fields(desc), **changes})
    except (TypeError, ValueError) as e:
        raise type(e)(f"{label}: {e}") from e


def format_changed(old: ScaledQuantDescriptor, new: ScaledQuantDescriptor) -> bool:
    """True when a calibrated amax of ``old`` means nothing for ``new``."""
    return any(getattr(old, k) != getattr(new, k) for k in FORMAT_KEYS)


def _num(v: float) -> str:
    return f"{v:.4g}"


def amax_text(amax: torch.Tensor | None, dynamic: bool) -> str:
    if dynamic:
        return "amax=dynamic"
    if amax is None:
        return "amax=uncalibrated"
    a = amax.detach().float()
    if a.numel() == 1:
        return f"amax={_num(a.item())}"
    return f"amax=[{_num(a.min().item())}, {_num(a.max().item())}]({a.numel()})"


def describe(q) -> str:
    """The compact ``extra_repr`` of a quantizer, e.g. ``8b per-channel(axis=0) amax=[0.12, 3.4](32) calib=max quant``."""
    pqs = q.pre_quant_scale
    pqs_text = f"pre_quant_scale({pqs.numel()})" if pqs is not None else ""
    if not q.is_enabled:
        return "disabled" + (f", {pqs_text}" if pqs_text else "")
    d = q.quant_desc
    if d.block_scheme is not None or element_format(d.num_bits).is_float:
        fmt = d.block_scheme.name if d.block_scheme else element_format(d.num_bits).title.lower()
        if d.block_scheme is not None and d.block_scheme.kind == "mx":
            fmt += f"/{d.block_scheme.rounding}"  # the E8M0 scale rule in effect
    else:
        fmt = f"{d.num_bits}b" + (" unsigned" if d.unsigned else "") + (" narrow" if d.narrow_range else "")
    if d.block_sizes:
        gran = "block(" + ", ".join(f"{k}: {v}" for k, v in d.block_sizes.items()) + ")"
    elif d.axis is not None:
        ax = d.axis[0] if isinstance(d.axis, tuple) and len(d.axis) == 1 else d.axis
        gran = f"per-channel(axis={ax})"
    else:
        gran = "per-tensor"
    stored = q._amax
    if stored is not None and q.num_steps > 1:
        stored = stored[q.step]
    parts = [fmt, gran, amax_text(stored, d.dynamic)]
    if q.num_steps > 1:
        parts.append(f"steps={q.num_steps}(t={q.step})")
    if d.scale_amax is not None:
        parts.append(f"scale_amax={_num(d.scale_amax)}")
    if d.learn_amax:
        parts.append("learn_amax")
    if pqs_text:
        parts.append(pqs_text)
    if not d.dynamic:
        parts.append(f"calib={d.calib_method}")
    modes = []
    if q.is_quant_enabled:
        modes.append("quant" if d.fake_quant else "real-quant")
    if q.is_calib_enabled and not d.dynamic:
        modes.append("collecting")
    parts.append("+".join(modes) if modes else "pass-through")
    return " ".join(parts)
