"""``TensorQuantizer``: the stateful module between a descriptor and the functional ops.

A quantizer is built from a :class:`~modelopt_lite.descriptor.ScaledQuantDescriptor` and holds the state the
descriptor does not: the amax (calibrated, fixed, loaded or learned), the calibrators, the on/off switches and,
for temporal quantization, the current step. ``forward(x)`` returns a new tensor (the caller's ``x`` is never
modified) computed by :mod:`modelopt_lite.tensor_quant`, so its numerics are exactly those of the functional layer
(true float32 division by ``scale = amax / bound``, round half to even, bit-exact with ONNX Runtime).

Modes:

- disabled: ``forward`` returns ``x`` itself.
- uncalibrated (enabled, no amax yet): every input is quantized with its own max (per tensor, per ``axis`` or per
  block), as pytorch-quantization and ModelOpt do; ``amax``, ``scale`` and ``step_size`` are None until calibrated
  or set. ONNX export and ``fake2real`` still refuse such a quantizer (they need a stored amax).
- calibration (``enable_calib()``): every input is collected by the calibrator; the output is ``x`` when
  quantization is off, or quantized with the existing amax when it is on.
- fake quantization (default): quantize-dequantize, same dtype as ``x``.
- real quantization (``fake_quant=False``): returns the integer codes ``q`` as float32 (as pytorch-quantization
  does; for E4M3 the float8 codes converted to float32); :attr:`scale` gives the scale with ``x ~= q * scale``.
"""

from __future__ import annotations

import warnings

import torch

from ..descriptor import QUANT_DESC_8BIT_PER_TENSOR, ScaledQuantDescriptor
from ..formats import element_format
from ..functional import deferred_errors
from ..functional.abs_max import abs_max
from ..functional.checks import META_INPUT, check_axes
from ..functional.library_mx import scheme_fake_quant
from ..tensor_quant import (
    block_quant,
    fake_block_quant,
    fake_float_quant,
    fake_tensor_quant,
    tensor_quant,
)
from . import _quantizer_config as cfg
from ._affine_bias import AffineBiasState
from ._amax_state import AmaxStateMixin, _to_amax_tensor
from ._calib_plumbing import compute_step_amaxes, make_calibrator
from ._clip_state import ClipStateMixin
from ._modelopt_state import ModeloptStateMixin
from ._nvfp4_static import StaticNVFP4State
from ._pre_quant_scale import PreQuantScaleState
from ._quantizer_export import QuantizerExport
from ._scale_report import ScaleReport
from ._svdquant_lora import LowRankState

#: the deferred error of a non-finite dynamic amax (see functional/deferred_errors.py)
_DYNAMIC_NONFINITE = {1: "the input contains NaN or Inf, so its dynamic amax is not finite"}


def _bool(v, what: str, label: str) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{label}: {what} must be a bool, got {v!r}")
    return v


class TensorQuantizer(
    ScaleReport,
    ModeloptStateMixin,
    QuantizerExport,
    AffineBiasState,
    PreQuantScaleState,
    LowRankState,
    ClipStateMixin,
    StaticNVFP4State,
    AmaxStateMixin,
):
    """Quantize a tensor as its descriptor says, with calibration, temporal steps and learnable amax.

    Args:
        quant_desc: a :class:`ScaledQuantDescriptor` (or a dict of its fields). Default: 8-bit per tensor.
        disabled: start disabled (``forward`` returns its input).
        if_quant: quantize in ``forward`` (default True).
        if_calib: collect calibration statistics in ``forward`` (default False).
        amax: a fixed amax, overriding the descriptor's.
        name: a label used in error messages (``quantize()`` sets it to the module path); defaults to the
            descriptor's ``name``.
        num_steps: temporal steps, each with its own amax and calibrator (default 1).
        if_clip: run the learned clip stage in ``forward`` (pytorch-quantization's PACT clip; needs ``learn_amax``,
            see :mod:`._clip_state`). With ``if_quant=False`` the quantizer only clips.

    The amax lives in the ``_amax`` buffer (an ``nn.Parameter`` with ``learn_amax``): shape ``()`` per tensor, the
    input's rank with size 1 on reduced dims per channel, "blocks per axis" for static blocks, with a leading
    ``num_steps`` dimension for temporal quantizers. It round-trips through ``state_dict`` (also into a fresh
    quantizer) and follows ``.to(device)``.
    """

    #: pytorch-quantization's switch for exporting through torch's fake-quant ops: accepted, not needed (every
    #: ``torch.onnx.export`` writes standard Q/DQ, see :mod:`modelopt_lite.functional.onnx_qdq`)
    use_fb_fake_quant = False

    def __init__(
        self,
        quant_desc=QUANT_DESC_8BIT_PER_TENSOR,
        disabled=False,
        if_quant=True,
        if_calib=False,
        amax=None,
        name=None,
        num_steps=1,
        if_clip=False,
        *,
        quant_attribute_cfg=None,
    ):
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"TensorQuantizer: name must be a str or None, got {name!r}")
        if quant_attribute_cfg is not None:  # ModelOpt's keyword for the descriptor
            if quant_desc is not QUANT_DESC_8BIT_PER_TENSOR:
                raise TypeError("TensorQuantizer: give quant_desc or quant_attribute_cfg (the same thing), not both")
            quant_desc = quant_attribute_cfg
        desc = cfg.as_descriptor(quant_desc, "TensorQuantizer quant_desc")
        extras = cfg.peer_extras(desc)  # a QuantizerAttributeConfig's bias, num_steps, ... (applied below)
        self._desc = cfg.ScaledQuantDescriptor(**cfg.full_fields(desc)) if extras else desc
        self._name = name if name is not None else self._desc.name
        self._disabled = _bool(disabled, "disabled", self._label()) or not self._desc.enable
        self._if_quant = _bool(if_quant, "if_quant", self._label())
        self._if_calib = _bool(if_calib, "if_calib", self._label())
        self._num_steps = self._check_num_steps(num_steps)
        self._step = 0
        self._calibrators: list | None = None
        self._calib_factory: tuple | None = None  # a user calibrator class (ModelOpt's ``calibrator``)
        self._peer = dict(cfg.PEER_DEFAULTS)  # ModelOpt's trt_high_precision_dtype / pass_through_bwd / effective_bits
        self._last_rank: int | None = None
        self._last_scale: torch.Tensor | None = None  # of the last real-quant (fake_quant=False) dynamic forward
        self._device = torch.device("cpu")
        self.register_buffer("_amax", None)
        fixed = amax if amax is not None else self._desc.amax
        if fixed is not None:
            self.amax = fixed
        self._init_clip(if_clip, fixed)
        if extras:
            self.set_from_attribute_config(extras)
            if fixed is not None and self._amax is None:  # num_steps reset it
                self.amax = fixed

    # --- identity and descriptor ----------------------------------------------------------------------------------
    def _label(self) -> str:
        return f"TensorQuantizer {self._name!r}" if self._name else "TensorQuantizer (unnamed)"

    @property
    def name(self) -> str | None:
        """Label used in messages; ``quantize()`` sets it to the module path."""
        return self._name

    @name.setter
    def name(self, value) -> None:
        if value is not None and not isinstance(value, str):
            raise TypeError(f"TensorQuantizer name must be a str or None, got {value!r}")
        self._name = value
        for cal in self._calibrators or ():
            if cal is not None and hasattr(cal, "name"):
                cal.name = value

    @property
    def quant_desc(self) -> ScaledQuantDescriptor:
        """The current (immutable) descriptor."""
        return self._desc

    def _check_num_steps(self, n) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{self._label()}: num_steps must be an int >= 1, got {n!r}")
        return n

    def set_from_attribute_config(self, attrs) -> None:
        """Patch the settings with a config dict (or replace them with a descriptor).

        Keys: any descriptor field (``num_bits, axis, block_sizes, unsigned, narrow_range, fake_quant, learn_amax,
        calib_method, dynamic, amax, scale_amax, name, enable``) plus ``num_steps`` (int) and ModelOpt's ``bias`` (the
        affine bias, see :mod:`._affine_bias`). A descriptor is a complete
        config: its ``enable`` (default True) switches the quantizer on or off, as a full ModelOpt config does. Unknown
        keys raise TypeError naming the key and the quantizer. Setting ``block_sizes`` clears ``axis`` (and vice
        versa), switching to E4M3 clears ``unsigned``/``narrow_range``, and going dynamic drops a fixed amax.
        Changing the format (num_bits, axis, block_sizes, unsigned, calib_method, dynamic, num_steps) resets the
        calibration state (amax and calibrators); a fixed ``amax`` in the descriptor is then stored again.
        """
        changes, extra = cfg.split_patch(attrs, self._label())
        new = cfg.patched_descriptor(self._desc, changes, self._label()) if changes else self._desc
        steps = self._check_num_steps(extra.get("num_steps", self._num_steps))
        bias = self._checked_bias_patch(extra, steps)  # the affine bias (nn/_affine_bias.py)
        self._peer.update({k: v for k, v in extra.items() if k in cfg.PEER_DEFAULTS})
        enable = new.enable if "enable" in changes else None
        reset = cfg.format_changed(self._desc, new) or steps != self._num_steps
        self._desc, self._num_steps = new, steps
        if self._step >= steps:
            self._step = 0
        if reset:
            self._store_amax(None)
            self._calibrators = None
            self.bias_value = None
        if "calibrator" in extra:
            self._calib_factory, self._calibrators = extra["calibrator"], None
        self._set_bias_config(bias)
        if "amax" in changes and new.amax is not None and not reset:
            self._store_amax(None)
        if new.amax is not None and self._amax is None:
            self.amax = new.amax
        if self._amax is not None and isinstance(self._amax, torch.nn.Parameter) != new.learn_amax:
            self._store_amax(self._amax)  # re-registers as Parameter or buffer
        self._follow_learn_amax(self._amax)
        if enable is not None:
            self._disabled = not enable

    # --- read-only (through the descriptor) properties ------------------------------------------------------------
    num_bits = property(
        lambda self: self._desc.num_bits,
        lambda self, v: self._replace_desc(num_bits=v),
        doc="int bits, or (E, M) for a float format; settable (the descriptor is replaced, amax and calibrators kept).",
    )
    axis = property(lambda self: self._desc.axis, doc="Per-channel axis/axes as configured (may be negative).")
    block_sizes = property(lambda self: self._desc.block_sizes, doc="Block quantization spec, or None.")
    unsigned = property(
        lambda self: self._desc.unsigned,
        lambda self, v: self._replace_desc(unsigned=v),
        doc="Unsigned integer grid; settable like num_bits.",
    )
    narrow_range = property(lambda self: self._desc.narrow_range, doc="Symmetric signed grid.")
    fake_quant = property(lambda self: self._desc.fake_quant, doc="False: forward returns integer codes.")
    # ModelOpt's attribute name (its ``utils.enable_fake_quant`` and users' code set it); settable like num_bits
    _fake_quant = property(
        lambda self: self._desc.fake_quant,
        lambda self, v: self._replace_desc(fake_quant=v),
        doc="ModelOpt's name of :attr:`fake_quant`; settable (the descriptor is replaced, amax kept).",
    )
    learn_amax = property(lambda self: self._desc.learn_amax, doc="amax is an nn.Parameter trained by LSQ.")
    dynamic = property(lambda self: self._desc.dynamic, doc="amax recomputed per input (also dynamic blocks).")
    scale_amax = property(lambda self: self._desc.scale_amax, doc="Multiplier applied to amax at use, or None.")

    # --- switches ---------------------------------------------------------------------------------------------------
    def enable(self) -> None:
        """Turn the quantizer on."""
        self._disabled = False

    def disable(self) -> None:
        """Turn the quantizer off: ``forward`` returns its input."""
        self._disabled = True

    def enable_quant(self) -> None:
        """Quantize in forward."""
        self._if_quant = True

    def disable_quant(self) -> None:
        """Do not quantize in forward (calibration-only pass)."""
        self._if_quant = False

    def enable_calib(self) -> None:
        """Collect calibration statistics in forward (no effect on dynamic quantizers)."""
        self._if_calib = True

    def disable_calib(self) -> None:
        """Stop collecting calibration statistics."""
        self._if_calib = False

    is_enabled = property(lambda self: not self._disabled, doc="False when disabled.")
    is_quant_enabled = property(lambda self: self._if_quant, doc="Quantization on in forward.")
    is_calib_enabled = property(lambda self: self._if_calib, doc="Calibration collection on in forward.")

    # --- calibration ------------------------------------------------------------------------------------------------
    def _calibrator_list(self) -> list:
        if self._calibrators is None:
            self._calibrators = [
                self._wrap_calibrator(make_calibrator(self._desc, self._name, self._calib_factory))
                for _ in range(self._num_steps)
            ]
        return self._calibrators

    @property
    def calibrator(self):
        """The current step's calibrator (MaxCalibrator, HistogramCalibrator, a block collector), None if dynamic."""
        return self._calibrator_list()[self._step]

    _calibrator = calibrator  # the familiar pytorch-quantization attribute name

    def load_calib_amax(self, method=None, strict=True, **kwargs) -> None:
        """Store ``calibrator.compute_amax(method, **kwargs)`` (every step) as the amax.

        A calibrator that saw no data raises RuntimeError naming the quantizer (``strict=False``: a warning, the
        amax is left as it was; temporal steps without data get the max of the others). Dynamic, or disabled with
        no data at all (pytorch-quantization's loop calls this on every quantizer): no-op.
        """
        deferred_errors.check_errors()  # the end of calibration: pending CUDA value errors raise here
        if self.dynamic:
            return
        results = compute_step_amaxes(self._calibrator_list(), method, kwargs)
        missing = [t for t, a in enumerate(results) if a is None]
        if missing and self._disabled and len(missing) == len(results):
            return  # off and never fed: peers' loops load every quantizer, default-off output quantizers too
        if missing:
            where = f" for step(s) {missing}" if self._num_steps > 1 else ""
            msg = f"{self._label()}: the calibrator returned no amax{where}: it never saw calibration data"
            if strict:
                raise RuntimeError(msg + " (Calibrator returned None); run data through it first, or pass strict=False")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            present = [a for a in results if a is not None]
            if not present:
                return
            fill = torch.stack([a.float() for a in present]).amax(0)
            results = [fill if a is None else a for a in results]
        dev = self._device_now()
        checked = [_to_amax_tensor(a, dev, self._label()) for a in results]
        full = torch.stack(checked) if self._num_steps > 1 else checked[0]
        if self._amax is not None and self._amax.shape != full.shape:
            self._store_amax(None)
        self._write_amax(full)
        self._calibrated_global_amax()  # static NVFP4: the max of the new block amaxes
        self._load_calib_bias()

    def reset_amax(self) -> None:
        """Forget the amax and everything the calibrators collected (the quantizer becomes uncalibrated)."""
        self._store_amax(None)
        self._calibrators = None
        self.bias_value = None

    def init_learn_amax(self) -> torch.nn.Parameter:
        """Turn the current (calibrated or fixed) amax into an ``nn.Parameter`` trained with the LSQ gradient."""
        if self._amax is None:
            raise RuntimeError(f"{self._label()}: init_learn_amax() needs an amax; calibrate or set one first")
        if not self.learn_amax:
            self._desc = cfg.patched_descriptor(self._desc, {"learn_amax": True}, self._label())
        if not isinstance(self._amax, torch.nn.Parameter):
            self._store_amax(self._amax)
        assert isinstance(self._amax, torch.nn.Parameter)  # _store_amax registers a Parameter with learn_amax
        self._sync_clip(self._amax)
        return self._amax

    # --- forward ----------------------------------------------------------------------------------------------------
    def _resolve_axes(self, rank: int):
        axis = self._desc.axis
        if axis is None:
            return None
        try:
            return check_axes(axis, rank, "axis")
        except ValueError:
            raise ValueError(f"{self._label()}: axis={axis!r} is out of range for an input of rank {rank}") from None

    def _dynamic_amax(self, x: torch.Tensor) -> torch.Tensor:
        axes = self._resolve_axes(x.dim())
        xd = x.detach()
        red = None if axes is None else [d for d in range(x.dim()) if d not in axes]
        if red is None or red:
            a = abs_max(xd, red, keepdim=True).float()
        else:
            a = xd.abs().float()
        if deferred_errors.deferring(a):  # CUDA: the flag is read asynchronously (no host sync)
            flag = torch.isfinite(a).all().logical_not()
            deferred_errors.defer(flag, "dynamic amax", _DYNAMIC_NONFINITE, x)
        elif not bool(torch.isfinite(a).all()):
            raise ValueError(f"{self._label()}: the input contains NaN or Inf, so its dynamic amax is not finite")
        return a

    def _fit_static(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Reshape a flat per-channel amax (e.g. a fixed 1-D amax) to the input's rank; never touches the buffer."""
        axes = self._resolve_axes(x.dim())
        if axes is None or a.numel() == 1 or a.dim() == x.dim():
            return a
        shape = [x.shape[d] if d in axes else 1 for d in range(x.dim())]
        if a.numel() != int(torch.Size(shape).numel()):
            raise ValueError(
                f"{self._label()}: amax of shape {tuple(a.shape)} does not match axis={self.axis} of an "
                f"input of shape {tuple(x.shape)} (expected {tuple(shape)})"
            )
        return a.reshape(shape)

    def _amax_for(self, x: torch.Tensor):
        """The amax to quantize ``x`` with: the stored one, else ``x``'s own (None for blocks: computed per block)."""
        stored = None if self.dynamic else self._stored_amax()
        if stored is None:
            if self.block_sizes and not (self._desc.block_scheme and self._desc.block_scheme.calibrates_amax):
                return None
            a = self._dynamic_amax(x)
        else:
            a = self._fit_static(stored, x)
        return a * self.scale_amax if self.scale_amax is not None else a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize ``x`` (a new tensor; ``x`` is never modified). See the module docstring for the modes.

        A ``pre_quant_scale`` (SmoothQuant) multiplies ``x`` first, in every mode, disabled included."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._label()}: expected a torch.Tensor, got {type(x).__name__}")
        x = self._apply_pre_quant_scale(x)
        if self._disabled:
            return x
        if x.is_meta:
            raise TypeError(f"{self._label()}: the input {META_INPUT}")
        self._resolve_axes(x.dim())
        if self._last_rank != x.dim():  # (nn.Module.__setattr__ costs microseconds: set on a change only)
            self._last_rank = x.dim()
        if self._if_calib and not self.dynamic:
            self._collect(x)
        x = self._apply_clip(x)  # pytorch-quantization's clip stage, off unless if_clip / enable_clip()
        if not self._if_quant or x.numel() == 0:
            return x
        if self._peer["pass_through_bwd"] and x.requires_grad and torch.is_grad_enabled():
            xd = x.detach()  # ModelOpt's pass_through_bwd=True: the gradient of x passes through unclipped
            return self._affine_quantize(xd) + (x - xd)
        return self._affine_quantize(x)  # self._quantize(x), or fq(x - b) + b with an affine bias

    trt_high_precision_dtype = property(
        lambda self: self._peer["trt_high_precision_dtype"],
        doc="ModelOpt's TensorRT export dtype of scales (recorded: our Q/DQ scales are float32).",
    )
    pass_through_bwd = property(
        lambda self: self._peer["pass_through_bwd"],
        doc="True: plain straight-through gradient for x (ModelOpt); False (default): zero outside the range.",
    )
    effective_bits = property(
        lambda self: self._peer["effective_bits"], doc="ModelOpt's auto-quantize cost (recorded)."
    )

    def _collect(self, x: torch.Tensor) -> None:
        try:
            self.calibrator.collect(x.detach())
        except (ValueError, TypeError) as e:
            raise type(e)(f"{self._label()}: {e}") from e

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        d = self._desc
        try:
            with deferred_errors.label(self._label):  # names this quantizer in a deferred (CUDA) value error
                return self._quantize_labelled(x, d)
        except deferred_errors.DeferredValueError:
            raise  # an earlier call's error: it names its own quantizer
        except (ValueError, TypeError) as e:
            if str(e).startswith(self._label()):
                raise
            raise type(e)(f"{self._label()}: {e}") from e

    def _quantize_labelled(self, x: torch.Tensor, d) -> torch.Tensor:
        if d.nvfp4_static:  # stored block amaxes and global amax (nn/_nvfp4_static.py)
            return self._static_nvfp4_quantize(x)
        amax = self._amax_for(x)
        if d.block_scheme is not None:  # NVFP4 / OCP MX (formats.BLOCK_SCHEMES)
            return scheme_fake_quant(x, d.block_scheme, d.block_sizes, amax, d.fake_quant)
        if d.block_sizes:
            if d.fake_quant:
                return fake_block_quant(x, d.block_sizes, amax, d.num_bits, d.unsigned, d.narrow_range)
            return block_quant(x, d.block_sizes, amax, d.num_bits, d.unsigned, d.narrow_range)[0]
        fmt = element_format(d.num_bits)
        if fmt.is_scaled_float:  # E4M3, E5M2, E2M1 with a float32 scale
            if d.fake_quant:
                return fake_float_quant(x, amax, fmt)
            q, s = tensor_quant(x, amax, d.num_bits)
            return self._keep_scale(q.float(), s)
        if d.fake_quant:
            return fake_tensor_quant(x, amax, d.num_bits, d.unsigned, d.narrow_range)
        return self._keep_scale(*tensor_quant(x, amax, d.num_bits, d.unsigned, d.narrow_range))

    # pytorch-quantization's private names, read by its users' code and tests
    _get_amax = _amax_for
    _axis = property(lambda self: self._desc.axis, doc="Alias of ``axis`` (pytorch-quantization's attribute).")
    _num_bits = property(lambda self: self._desc.num_bits, doc="Alias of ``num_bits``.")
    _unsigned = property(lambda self: self._desc.unsigned, doc="Alias of ``unsigned``.")

    def extra_repr(self) -> str:
        return cfg.describe(self) + self._bias_text()
