"""ModelOpt's per-quantizer state API on :class:`~modelopt_lite.nn.TensorQuantizer`: ``get_modelopt_state()``,
``set_from_modelopt_state(state)`` and ``export_amax()``.

The state is ModelOpt 0.47's plain dict of underscored attributes (``_num_bits``, ``_axis``, ``_block_sizes``,
``_disabled``, ``_if_quant``, ... and ``_pytorch_state_metadata``: the shape and dtype of every tensor), so a state
that ModelOpt wrote is read here and ours reads in ModelOpt. Settings ModelOpt has no attribute for (``calib_method``,
``scale_amax``, ``num_steps``, a fixed ``amax``) travel under ``_modelopt_lite``.

A state is untrusted input: every key is checked (type and value, through the same validation as
``set_from_attribute_config``), keys that only ModelOpt's export internals use are ignored, and any other key
raises ValueError naming the quantizer and the key: nothing is set from a name the state gives.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..descriptor import _DEFAULTS, ScaledQuantDescriptor
from . import _quantizer_config as cfg

#: ModelOpt state key -> our attribute (descriptor field or extra setting)
_ATTRS = {
    "_num_bits": "num_bits",
    "_axis": "axis",
    "_block_sizes": "block_sizes",
    "_unsigned": "unsigned",
    "_narrow_range": "narrow_range",
    "_fake_quant": "fake_quant",
    "_learn_amax": "learn_amax",
    "_dynamic": "dynamic",
    "_trt_high_precision_dtype": "trt_high_precision_dtype",
    "_pass_through_bwd": "pass_through_bwd",
    "_effective_bits": "effective_bits",
    "_bias": "bias",
    "_rotate": "rotate",
    "backend": "backend",
    "_use_constant_amax": "use_constant_amax",
    "_constant_amax": "constant_amax",
}
_SWITCHES = ("_disabled", "_if_quant", "_if_calib")
#: keys ModelOpt keeps for its own export/kernels (derived from the others) or for the tensors' input dtype
_IGNORED = frozenset(
    {
        "_amax_shape_for_export",
        "_is_static_block_scale_quantizer",
        "_is_nvfp4_static_quantizer",  # derived from the format (block_sizes type 'static', NVFP4)
        "_quantize_scales",  # StaticBlockScaleQuantizer's LSQ settings (meaningful only with _lsq, refused below)
        "_quantize_pre_scale",
        "_learnable_amax",
        "_tied_amax",
        "_quant_max_bound",
        "_slices",
        "_input_dtype",
        "_original_shape",
        "_block_reshape_size",
        "_padding",
        "_is_hf_initialized",
        "_enable_pre_quant_scale",
        "_dequantize",
    }
)
_OURS = "_modelopt_lite"
_OUR_KEYS = ("calib_method", "scale_amax", "num_steps", "amax", "calibrator")
#: the tensors a quantizer may hold (``_amax`` a parameter too, with learn_amax)
TENSOR_NAMES = ("_amax", "_global_amax", "_pre_quant_scale", "_bias_value", "_svdquant_lora_a", "_svdquant_lora_b")


def _check_bool(state: Mapping, key: str, label: str, default: bool) -> bool:
    v = state.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{label}: modelopt state {key!r} must be a bool, got {v!r}")
    return v


def _backend_args(v, label: str):
    if v is None or (isinstance(v, dict) and not v):
        return None
    raise ValueError(f"{label}: modelopt state 'backend_extra_args'={v!r} cannot be honoured (no custom backends)")


def _rotate(v, label: str) -> bool:
    if v is False or (isinstance(v, Mapping) and v.get("enable", True) is False):
        return False
    raise ValueError(f"{label}: modelopt state '_rotate'={v!r} cannot be honoured (no input rotation)")


def attrs_from_modelopt_state(state, label: str) -> tuple[dict, dict]:
    """ModelOpt quantizer state -> (attribute config for ``set_from_attribute_config``, switches).

    Missing keys take ModelOpt's defaults, so the result does not depend on the quantizer it is applied to.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"{label}: a modelopt quantizer state must be a dict, got {type(state).__name__}")
    unknown = sorted(
        str(k) for k in state if k not in _ATTRS and k not in _SWITCHES and k not in _IGNORED and k not in _EXTRA_KEYS
    )
    if unknown:
        raise ValueError(f"{label}: unknown modelopt quantizer state key(s) {unknown}; nothing is set from them")
    if state.get("_lsq", False) is not False:
        raise ValueError(
            f"{label}: modelopt state '_lsq'={state['_lsq']!r} (learnable LSQ amaxes) is not supported: restore the "
            "model before lsq(), or after folding the learned amaxes"
        )
    if state.get("_dequantize", False) is not False:
        raise ValueError(
            f"{label}: modelopt state '_dequantize'={state['_dequantize']!r} (real-quantized weights) "
            "is not supported: restore a fake-quantized model"
        )
    attrs: dict[str, Any] = {k: v for k, v in _DEFAULTS.items() if k not in ("name", "enable")}
    attrs["pass_through_bwd"] = True  # ModelOpt's default when the key is absent
    attrs["num_steps"] = 1
    for key, ours in _ATTRS.items():
        if key in state:
            attrs[ours] = state[key]
    attrs["rotate"] = _rotate(attrs.get("rotate", False), label)
    if "backend_extra_args" in state:
        attrs["backend_extra_args"] = _backend_args(state["backend_extra_args"], label)
    bs = attrs.get("block_sizes")
    if isinstance(bs, Mapping):
        attrs["block_sizes"] = dict(bs)
        attrs["axis"] = None  # ModelOpt records the axis its block reshape reduces over: derived, not a setting
    extra = state.get(_OURS, {})
    if not isinstance(extra, Mapping) or any(k not in _OUR_KEYS for k in extra):
        raise ValueError(f"{label}: modelopt state {_OURS!r} must be a dict with keys from {_OUR_KEYS}, got {extra!r}")
    attrs.update(extra)
    switches = {k: _check_bool(state, k, label, k == "_if_quant") for k in _SWITCHES}
    return attrs, switches


_EXTRA_KEYS = frozenset({_OURS, "backend_extra_args", "_pytorch_state_metadata", "_lsq"})


def tensor_metadata(state: Mapping, label: str) -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{tensor name: (shape, is_parameter)}`` from a state's ``_pytorch_state_metadata`` (validated)."""
    meta = state.get("_pytorch_state_metadata", {})
    if not isinstance(meta, Mapping) or any(k not in ("buffers", "params") for k in meta):
        raise ValueError(f"{label}: modelopt state '_pytorch_state_metadata' is malformed: {meta!r}")
    out: dict[str, tuple[tuple[int, ...], bool]] = {}
    for kind in ("buffers", "params"):
        entries = meta.get(kind, {})
        if not isinstance(entries, Mapping):
            raise ValueError(f"{label}: modelopt state '_pytorch_state_metadata.{kind}' must be a dict")
        for name, info in entries.items():
            if name not in TENSOR_NAMES or name in out:
                raise ValueError(f"{label}: modelopt state lists a tensor {name!r} (allowed: {TENSOR_NAMES})")
            shape = info.get("shape") if isinstance(info, Mapping) else None
            dtype = info.get("dtype", torch.float32) if isinstance(info, Mapping) else None
            if not isinstance(shape, (tuple, list)) or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape
            ):
                raise ValueError(f"{label}: modelopt state tensor {name!r} has a malformed shape {shape!r}")
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"{label}: modelopt state tensor {name!r} has dtype {dtype!r}, expected float32")
            if len(shape) > 8 or int(torch.Size(shape).numel()) > 1 << 28:
                raise ValueError(f"{label}: modelopt state tensor {name!r} has an implausible shape {tuple(shape)}")
            out[name] = (tuple(shape), kind == "params")
    return out


class ModeloptStateMixin(nn.Module):
    """ModelOpt's state API for TensorQuantizer (mixed into it)."""

    if TYPE_CHECKING:
        _desc: ScaledQuantDescriptor
        _disabled: bool
        _if_quant: bool
        _if_calib: bool
        _num_steps: int
        _peer: dict
        _calib_factory: tuple | None
        bias: Any
        maxbound: Any
        dynamic: bool

        def _label(self) -> str: ...

        def _effective_amax(self) -> torch.Tensor | None: ...

        def set_from_attribute_config(self, attrs) -> None: ...

    def _replace_desc(self, **changes) -> None:
        """Replace the descriptor with ``changes`` applied, keeping amax and calibrators (ModelOpt's writable
        ``num_bits`` / ``unsigned``: the attribute changes, the state stays)."""
        self._desc = cfg.patched_descriptor(self._desc, changes, self._label())

    def get_modelopt_state(self, properties_only: bool = False) -> dict[str, Any]:
        """The quantizer's settings as ModelOpt's state dict (plus the tensors' shapes unless ``properties_only``)."""
        if getattr(self, "_lsq", None) is not None:
            raise ValueError(
                f"{self._label()}: modelopt state of an LSQ-mode quantizer (learned amax_pre / amax_post) is not "
                "supported: set its learned amax as .amax and call disable_lsq() first"
            )
        d = self._desc
        fields = d.dict()
        amax = fields.get("amax")
        state: dict[str, Any] = {
            "_num_bits": d.num_bits,
            "_axis": d.axis,
            "_block_sizes": None if d.block_sizes is None else _plain(d.block_sizes),
            "_unsigned": d.unsigned,
            "_narrow_range": d.narrow_range,
            "_fake_quant": d.fake_quant,
            "_learn_amax": d.learn_amax,
            "_dynamic": bool(fields.get("dynamic", False)),
            "_disabled": self._disabled,
            "_if_quant": self._if_quant,
            "_if_calib": self._if_calib,
            "_trt_high_precision_dtype": self._peer["trt_high_precision_dtype"],
            "_pass_through_bwd": self._peer["pass_through_bwd"],
            "_effective_bits": self._peer["effective_bits"],
            "_bias": None if self.bias is None else dict(self.bias),
            "_rotate": False,
            "backend": None,
            "backend_extra_args": {},
            "_use_constant_amax": False,
            "_constant_amax": None,
            "_enable_pre_quant_scale": True,
            "_dequantize": False,
            _OURS: {
                "calib_method": d.calib_method,
                "scale_amax": d.scale_amax,
                "num_steps": self._num_steps,
                "amax": amax,
            },
        }
        if d.nvfp4_static:  # ModelOpt restores it as its StaticBlockScaleQuantizer
            state.update(_is_static_block_scale_quantizer=True, _is_nvfp4_static_quantizer=True, _quant_max_bound=6.0)
        if self._calib_factory is not None:  # a user calibrator class: in-memory states only (see opt.save)
            state[_OURS]["calibrator"] = self._calib_factory
        if not properties_only:
            meta: dict[str, dict] = {"params": {}, "buffers": {}}
            for kind, table in (("params", self._parameters), ("buffers", self._buffers)):
                for k, v in table.items():
                    if v is not None and k not in self._non_persistent_buffers_set:
                        meta[kind][k] = {"shape": v.shape, "dtype": v.dtype}
            state["_pytorch_state_metadata"] = meta
        return state

    def set_from_modelopt_state(self, modelopt_state, properties_only: bool = False) -> None:
        """Apply a ModelOpt quantizer state (validated); unless ``properties_only``, the tensors it lists are
        re-created as zeros of the recorded shapes, to be filled by ``load_state_dict``.

        Raises:
            ValueError: a malformed state, an unknown key, or a setting modelopt_lite cannot honour (the message
                names the quantizer and the key); the quantizer is left unchanged then.
        """
        label = self._label()
        attrs, switches = attrs_from_modelopt_state(modelopt_state, label)
        tensors = {} if properties_only else tensor_metadata(modelopt_state, label)
        snapshot = (self._desc, self._disabled, self._if_quant, self._if_calib)
        try:
            self.set_from_attribute_config(attrs)
        except (TypeError, ValueError) as e:
            self._desc, self._disabled, self._if_quant, self._if_calib = snapshot
            raise ValueError(f"{label}: the modelopt state was rejected: {e}") from None
        self._disabled, self._if_quant, self._if_calib = (
            switches["_disabled"],
            switches["_if_quant"],
            switches["_if_calib"],
        )
        if properties_only:
            return
        for name in TENSOR_NAMES:
            self._buffers.pop(name, None)
            self._parameters.pop(name, None)
        self.register_buffer("_amax", None)
        for name, (shape, is_param) in tensors.items():
            t = torch.zeros(shape, dtype=torch.float32, device=self._device_now_or_cpu())
            if is_param:
                self.register_parameter(name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)

    def _device_now_or_cpu(self) -> torch.device:
        dev = getattr(self, "_device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def export_amax(self) -> torch.Tensor | None:
        """The amax as exporters read it (a fresh tensor; the stored one is never touched): None when uncalibrated
        or dynamic; per tensor shape ``(1,)``, one axis squeezed to 1-D, blocks as stored (one row per output
        channel); zero entries (a channel that never saw data) become ``maxbound`` with a warning, as ModelOpt does."""
        if self.dynamic and self._desc.block_scheme is None:
            return None
        a = self._effective_amax()
        if a is None:
            return None
        a = a.detach().clone().float()
        zero = a == 0
        if bool(zero.any()):
            warnings.warn(
                f"{self._label()}: {int(zero.sum())}/{a.numel()} amax entries are zero (the channel never saw "
                "data); export_amax substitutes maxbound",
                RuntimeWarning,
                stacklevel=2,
            )
            a = torch.where(zero, torch.full_like(a, float(self.maxbound)), a)
        a = a.clamp(min=torch.finfo(torch.float32).tiny)
        if not self._desc.block_sizes:
            axis = self._desc.axis
            if axis is None:
                a = a.reshape(1)
            elif isinstance(axis, int) or len(axis) == 1:
                a = a.squeeze()
        return a


def _plain(v):
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v
