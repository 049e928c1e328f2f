"""The affine ``bias`` of a :class:`~modelopt_lite.nn.TensorQuantizer` (ModelOpt 0.47's ``bias`` attribute).

With a bias ``b`` the quantizer computes ``y = fq(x - b) + b`` in float32, in that order (``fq`` the quantizer's
ordinary fake quantization, its amax included), and returns ``y`` in ``x``'s dtype. Configured by a dict in
ModelOpt's form::

    {-2: None, -4: None, "type": "static", "method": "mean"}

- the int keys are the dimensions the bias is **reduced** over (kept, size 1, in the stored bias); their values are
  unused (None). ``{-2: None, -4: None}`` on keys/values ``[batch, heads, seq, head_dim]`` gives one bias per head
  and channel, shape ``(1, heads, 1, head_dim)``;
- ``"type"``: ``"static"`` (default: calibrated, stored in the ``_bias_value`` buffer) or ``"dynamic"`` (computed
  from every input);
- ``"method"``: ``"mean"`` (default) or ``"max_min"`` (see :mod:`modelopt_lite.calib.bias`).

``{"enable": False}`` (or None) means no bias. It is set like the other attributes: a ``quant_cfg`` entry (or
ModelOpt's list entry), ``set_quantizer_attribute`` or ``q.set_from_attribute_config({"bias": ...})``.

Calibration (as ModelOpt does): a static bias is collected together with the amax; each batch first updates the
bias, and the amax calibrator then sees ``x - b`` with the bias so far. ``load_calib_amax`` stores both. Before it
is calibrated (or set through :attr:`bias_value`), a static bias is computed from each input, as an uncalibrated
amax is; ONNX export refuses such a quantizer. The bias is float32 (it stays so under ``.half()``), is saved in
``state_dict`` and restored like the amax (validated: finite, the configured shape). Temporal quantizers
(``num_steps > 1``) take no bias.

Real quantization (``fake_quant=False``) returns the codes of ``x - b`` (``x ~= codes * scale + b``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..calib.bias import BIAS_METHODS, BiasCalibrator, compute_bias, reduce_dims
from ..functional.checks import first_bad

BIAS_TYPES = ("static", "dynamic")
_KEYS = ("type", "method", "enable")


def check_bias_config(value: Any, label: str) -> dict | None:
    """ModelOpt's ``bias`` attribute, validated; returns the normalized dict (int axes as given, in order, then
    ``type`` and ``method``), or None for no bias.

    Raises:
        ValueError / TypeError naming ``label``: not a dict, unknown keys, no axis, a non-int axis, a bad type or
        method.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{label}: bias must be None or a dict such as {{-2: None, -4: None}}, got {value!r}")
    enable = value.get("enable", True)
    if not isinstance(enable, bool):
        raise ValueError(f"{label}: bias['enable'] must be a bool, got {enable!r}")
    if not enable:
        return None
    axes: list[int] = []
    for k, v in value.items():
        if isinstance(k, str):
            if k not in _KEYS:
                hint = " (list the reduced axes as int keys: {-2: None, -4: None})" if k == "axis" else ""
                raise ValueError(f"{label}: unknown bias key {k!r}; allowed: int axes, {', '.join(_KEYS)}{hint}")
            continue
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"{label}: bias axis {k!r} is not an int")
        if v is not None:
            raise ValueError(f"{label}: bias axis {k} maps to {v!r}; the values are unused, give None")
        axes.append(k)
    if not axes:
        raise ValueError(f"{label}: bias {dict(value)!r} names no axis to reduce over (e.g. {{-2: None, -4: None}})")
    btype = value.get("type", "static")
    if btype not in BIAS_TYPES:
        raise ValueError(f"{label}: bias type must be one of {BIAS_TYPES}, got {btype!r}")
    method = value.get("method", "mean")
    if method not in BIAS_METHODS:
        raise ValueError(f"{label}: bias method must be one of {BIAS_METHODS}, got {method!r}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{label}: bias axis listed twice in {axes}")
    return {**{a: None for a in axes}, "type": btype, "method": method}


def bias_axes(cfg: Mapping) -> tuple[int, ...]:
    """The reduced axes of a normalized bias config."""
    return tuple(k for k in cfg if not isinstance(k, str))


def bias_value_problem(cfg: Mapping | None, shape: tuple[int, ...]) -> str | None:
    """Why a stored bias of ``shape`` cannot belong to a quantizer configured with ``cfg`` (None when it can)."""
    if cfg is None:
        return "the quantizer has no bias configured"
    if cfg["type"] != "static":
        return "a dynamic bias stores no value"
    if len(shape) == 0:
        return "a bias needs the input's rank (size 1 on the reduced dimensions), got a scalar"
    try:
        dims = reduce_dims(bias_axes(cfg), len(shape))
    except ValueError as e:
        return str(e)
    big = [d for d in dims if shape[d] != 1]
    if big:
        return f"the reduced dimension(s) {big} must have size 1 (bias axes {bias_axes(cfg)})"
    return None


def _checked_value(value: Any, cfg: Mapping | None, label: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{label}: the bias value must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{label}: the bias value must be a floating-point tensor, got {value.dtype}")
    problem = bias_value_problem(cfg, tuple(value.shape))
    if problem:
        raise ValueError(f"{label}: bias value of shape {tuple(value.shape)} does not fit: {problem}")
    t = value.detach().to(torch.float32).clone()
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise ValueError(f"{label}: the bias value must be finite, got {first_bad(t, bad)!r}")
    return t


class AffineCalibrator:
    """An amax calibrator fed ``x - b``: ``collect(x)`` first updates the static bias calibrator, then passes
    ``x - b`` (float32) to the wrapped calibrator. Everything else is the wrapped calibrator's."""

    def __init__(self, inner, bias: BiasCalibrator):
        self._inner = inner
        self.bias_calibrator = bias

    def collect(self, x: torch.Tensor) -> None:
        b = self.bias_calibrator.collect(x)
        self._inner.collect(x.detach().float() - b)

    def reset(self) -> None:
        self.bias_calibrator.reset()
        self._inner.reset()

    def compute_amax(self, *args, **kwargs):
        return self._inner.compute_amax(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_inner", "bias_calibrator"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"AffineCalibrator({self._inner!r}, {self.bias_calibrator!r})"


class AffineBiasState(nn.Module):
    """Affine-bias storage and numerics for TensorQuantizer (mixed into it; relies on ``_label()``,
    ``_device_now()``, ``_quantize()``, ``num_steps``, ``fake_quant``, ``_calibrators`` and ``calibrator``)."""

    _bias_cfg: dict | None = None

    if TYPE_CHECKING:
        _calibrators: list | None

        def _label(self) -> str: ...

        def _device_now(self) -> torch.device: ...

        def _quantize(self, x: torch.Tensor) -> torch.Tensor: ...

        @property
        def calibrator(self) -> Any: ...

    # --- configuration ----------------------------------------------------------------------------------------------
    @property
    def bias(self) -> dict | None:
        """The affine bias config in ModelOpt's form (``{-2: None, -4: None, "type": ..., "method": ...}``), or None."""
        return None if self._bias_cfg is None else dict(self._bias_cfg)

    @property
    def bias_axis(self) -> tuple[int, ...] | None:
        """The dimensions the bias is reduced over (as configured), or None without a bias."""
        return None if self._bias_cfg is None else bias_axes(self._bias_cfg)

    @property
    def bias_type(self) -> str | None:
        """``"static"`` or ``"dynamic"``; None without a bias."""
        return None if self._bias_cfg is None else self._bias_cfg["type"]

    @property
    def bias_method(self) -> str | None:
        """``"mean"`` or ``"max_min"``; None without a bias."""
        return None if self._bias_cfg is None else self._bias_cfg["method"]

    def _checked_bias_patch(self, extra: Mapping, num_steps: int) -> Any:
        """The new bias config a ``set_from_attribute_config`` patch asks for (``...``: unchanged); validated
        before anything changes."""
        cfg = check_bias_config(extra["bias"], self._label()) if "bias" in extra else self._bias_cfg
        if cfg is not None and num_steps > 1:
            raise ValueError(f"{self._label()}: an affine bias cannot be combined with num_steps={num_steps} > 1")
        return cfg if "bias" in extra else ...

    def _set_bias_config(self, cfg: Any) -> None:
        """Store a config from :meth:`_checked_bias_patch`; a different one drops the stored bias and calibrators."""
        if cfg is ... or cfg == self._bias_cfg:
            return
        self._bias_cfg = cfg
        self._buffers.pop("_bias_value", None)
        self._calibrators = None

    # --- the stored (static) bias -----------------------------------------------------------------------------------
    @property
    def bias_value(self) -> torch.Tensor | None:
        """The stored static bias (float32, the input's rank, size 1 on the reduced dimensions), or None."""
        return self._buffers.get("_bias_value")

    @bias_value.setter
    def bias_value(self, value) -> None:
        if value is None:
            self._buffers.pop("_bias_value", None)
            return
        t = _checked_value(value, self._bias_cfg, self._label())
        cur = self._buffers.get("_bias_value")
        if cur is not None and cur.shape != t.shape:
            raise ValueError(
                f"{self._label()}: new bias value has shape {tuple(t.shape)} but the stored one has shape "
                f"{tuple(cur.shape)}; set bias_value = None first to change it"
            )
        self.register_buffer("_bias_value", t.to(self._device_now()))

    def reset_bias(self) -> None:
        """Forget the stored bias and what its calibrator collected."""
        self._buffers.pop("_bias_value", None)
        for cal in self._calibrators or ():
            if isinstance(cal, AffineCalibrator):
                cal.bias_calibrator.reset()

    # --- calibration --------------------------------------------------------------------------------------------------
    @property
    def _bias_calibrator(self) -> BiasCalibrator | None:
        """ModelOpt's name for the static bias calibrator of the current calibrator (None without a static bias)."""
        cal = self.calibrator
        return cal.bias_calibrator if isinstance(cal, AffineCalibrator) else None

    def _wrap_calibrator(self, cal):
        """``cal`` fed ``x - b`` when a static bias is configured (called where the calibrators are made)."""
        cfg = self._bias_cfg
        if cal is None or cfg is None or cfg["type"] != "static":
            return cal
        return AffineCalibrator(cal, BiasCalibrator(cfg["method"], bias_axes(cfg), name=getattr(self, "_name", None)))

    def _load_calib_bias(self) -> None:
        """Store the calibrated static bias (after ``load_calib_amax``); nothing when none was collected."""
        cal = self.calibrator
        if not isinstance(cal, AffineCalibrator):
            return
        b = cal.bias_calibrator.compute_bias()
        if b is None:
            return
        self._buffers.pop("_bias_value", None)  # the kept sizes may differ from an earlier calibration
        self.bias_value = b

    # --- forward ------------------------------------------------------------------------------------------------------
    def _bias_for(self, x: torch.Tensor) -> torch.Tensor:
        """The bias to use for ``x`` (float32, broadcastable): the stored one, else ``x``'s own."""
        cfg = self._bias_cfg
        assert cfg is not None
        stored = self._buffers.get("_bias_value") if cfg["type"] == "static" else None
        if stored is None:
            try:
                return compute_bias(x, bias_axes(cfg), cfg["method"])
            except ValueError as e:
                raise ValueError(f"{self._label()}: {e}") from None
        if stored.dim() != x.dim() or any(s not in (1, n) for s, n in zip(stored.shape, x.shape)):
            raise ValueError(
                f"{self._label()}: the stored bias of shape {tuple(stored.shape)} does not fit an input of shape "
                f"{tuple(x.shape)}"
            )
        return stored.to(x.device)

    def _affine_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``fq(x - b) + b`` in float32 (``x``'s dtype returned; real quantization: the codes of ``x - b``)."""
        if self._bias_cfg is None:
            return self._quantize(x)
        xf = x if x.dtype == torch.float32 else x.float()  # (no Cast node in an export of a float32 model)
        b = self._bias_for(xf)
        y = self._quantize(xf - b)
        if not getattr(self, "fake_quant", True):
            return y
        y = y + b
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _bias_export_problem(self) -> str | None:
        """Why ONNX export cannot write this quantizer's bias as a constant (None when it can or there is none)."""
        cfg = self._bias_cfg
        if cfg is not None and cfg["type"] == "static" and self._buffers.get("_bias_value") is None:
            return "its static affine bias is not calibrated"
        return None

    def _bias_text(self) -> str:
        cfg = self._bias_cfg
        if cfg is None:
            return ""
        state = (
            "dynamic" if cfg["type"] == "dynamic" else ("calibrated" if self.bias_value is not None else "uncalibrated")
        )
        return f" bias(axes={bias_axes(cfg)}, {cfg['method']}, {state})"

    # --- torch.nn plumbing ------------------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Keep the bias float32 through ``.half()`` & co (it follows ``.to(device)``)."""
        keep = self._buffers.get("_bias_value")
        keep = keep.detach().clone() if keep is not None else None
        out = super()._apply(fn, recurse)
        b = self._buffers.get("_bias_value")
        if b is not None and keep is not None and b.dtype != torch.float32:
            b.data = keep.to(b.device)
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "_bias_value"
        if key in state_dict:
            label = f"{self._label()} at {prefix[:-1] or '<root>'!r}"
            new = _checked_value(state_dict[key], self._bias_cfg, label)
            cur = self._buffers.get("_bias_value")
            if cur is not None and cur.shape != new.shape:
                raise ValueError(
                    f"{label}: bias value in the state dict has shape {tuple(new.shape)} but this quantizer's "
                    f"has shape {tuple(cur.shape)}"
                )
            if cur is None:
                self.register_buffer("_bias_value", new.to(self._device_now()))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
