"""The amax state of a :class:`~modelopt_lite.nn.TensorQuantizer`: storage, temporal steps, state-dict loading.

``_amax`` is a float32 buffer (or an ``nn.Parameter`` when ``learn_amax``), ``None`` until calibrated or set (the
``amax`` property then returns None, and an enabled quantizer quantizes every input with that input's own max).
With ``num_steps > 1`` it has shape ``(num_steps, *amax_shape)`` and the ``amax`` property returns the slice of the
current ``step``. The buffer stays float32 through ``model.half()`` (its value is exactly what exports store) and
is never written in place except by an explicit setter on a learnable amax (to keep optimizer references valid).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from ..functional import deferred_errors
from ..functional.checks import first_bad


def _to_amax_tensor(value, device, label: str) -> torch.Tensor:
    """A validated float32 amax tensor (finite, >= 0) on ``device``; ValueError/TypeError naming the quantizer."""
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{label}: amax must be a number, an array or a tensor, got {value!r}")
    if isinstance(value, torch.Tensor):
        t = value.detach().to(device=device, dtype=torch.float32).clone()
    elif isinstance(value, (numbers.Real, np.ndarray, list, tuple)):
        t = torch.tensor(np.asarray(value, dtype=np.float32), device=device)
    else:
        raise TypeError(f"{label}: amax must be a number, an array or a tensor, got {type(value).__name__}")
    if t.numel() == 0:
        raise ValueError(f"{label}: amax must not be empty")
    bad = ~torch.isfinite(t) | (t < 0)
    if bool(bad.any()):
        raise ValueError(f"{label}: amax must be finite and >= 0, got {first_bad(t, bad)!r}")
    return t


class AmaxStateMixin(nn.Module):
    """amax storage for TensorQuantizer (mixed into it; relies on ``_label()``, ``learn_amax``, ``dynamic``)."""

    # set by TensorQuantizer.__init__ (annotations only: nn.Module keeps buffers in _buffers)
    _amax: torch.Tensor | None
    _num_steps: int
    _step: int
    _device: torch.device

    if TYPE_CHECKING:

        def _label(self) -> str: ...

        def set_from_attribute_config(self, attrs) -> None: ...

        @property
        def learn_amax(self) -> bool: ...

        @property
        def dynamic(self) -> bool: ...

    # --- storage ---------------------------------------------------------------------------------------------------
    def _store_amax(self, t: torch.Tensor | None) -> None:
        """Replace the stored amax (a buffer, or a Parameter when learn_amax); None removes it."""
        self._buffers.pop("_amax", None)
        self._parameters.pop("_amax", None)
        if t is None:
            self.register_buffer("_amax", None)
            return
        t = t.detach().to(dtype=torch.float32).clone()
        if self.learn_amax:
            self.register_parameter("_amax", nn.Parameter(t))
        else:
            self.register_buffer("_amax", t)

    def _write_amax(self, full: torch.Tensor) -> None:
        """Store a full amax (all steps); a learnable amax of the same shape is updated in place."""
        cur = self._amax
        if isinstance(cur, nn.Parameter) and cur.shape == full.shape and self.learn_amax:
            with torch.no_grad():
                cur.copy_(full.to(cur.device))
        else:
            self._store_amax(full)

    @property
    def has_amax(self) -> bool:
        """True when an amax is stored (calibrated, loaded, fixed by the descriptor, or set)."""
        return self._amax is not None

    @property
    def is_calibrated(self) -> bool:
        """Same as :attr:`has_amax` (dynamic quantizers need no calibration and report False)."""
        return self._amax is not None

    def _uncalibrated_error(self) -> RuntimeError:
        if self.dynamic:
            return RuntimeError(f"{self._label()} is dynamic: its amax is recomputed from every input and never stored")
        return RuntimeError(
            f"{self._label()} has no amax: it never saw calibration data and has no fixed amax. Calibrate it "
            "(enable_calib(), run data through it, load_calib_amax()) or set .amax"
        )

    def _stored_amax(self) -> torch.Tensor | None:
        """:attr:`amax` without the sync point (the forward's reader)."""
        a = self._amax
        if a is None:
            if self.dynamic:
                raise self._uncalibrated_error()
            return None
        return a[self._step] if self._num_steps > 1 else a

    @property
    def amax(self) -> torch.Tensor | None:
        """The stored amax of the current step (float32; per channel it keeps the input's rank), or None before
        calibration (as in pytorch-quantization and ModelOpt: the quantizer then uses each input's own max).

        Raises:
            RuntimeError: naming the quantizer, when it is dynamic (its amax is never stored).
        """
        a = self._stored_amax()
        if a is not None:
            deferred_errors.check_errors(a.device)  # a reader's sync point: pending CUDA value errors raise here
        return a

    @amax.setter
    def amax(self, value) -> None:
        if self.dynamic:
            raise ValueError(f"{self._label()} is dynamic; it takes no amax (set dynamic=False first)")
        t = _to_amax_tensor(value, self._device_now(), self._label())
        cur = self._amax
        if cur is None:
            full = t.expand(self._num_steps, *t.shape).clone() if self._num_steps > 1 else t
            self._store_amax(full)
            return
        target = cur.shape[1:] if self._num_steps > 1 else cur.shape
        if tuple(t.shape) != tuple(target):
            if t.numel() == 1 and int(np.prod(target)) == 1:
                t = t.reshape(target)
            else:
                raise ValueError(
                    f"{self._label()}: new amax has shape {tuple(t.shape)} but the stored amax has shape "
                    f"{tuple(target)}; call reset_amax() first to change it"
                )
        if self._num_steps > 1:
            full = cur.detach().clone()
            full[self._step] = t.to(full.device)
        else:
            full = t
        self._write_amax(full)

    def _device_now(self) -> torch.device:
        return self._amax.device if self._amax is not None else self._device

    # --- temporal steps -------------------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Number of temporal steps, each with its own amax (1 = ordinary quantizer)."""
        return self._num_steps

    @num_steps.setter
    def num_steps(self, value) -> None:
        self.set_from_attribute_config({"num_steps": value})

    @property
    def step(self) -> int:
        """Current temporal step (selects the amax and the calibrator); see :meth:`set_step`."""
        return self._step

    @step.setter
    def step(self, value) -> None:
        self.set_step(value)

    def set_step(self, t: int) -> None:
        """Select temporal step ``t`` (``0 <= t < num_steps``); ValueError naming the quantizer otherwise."""
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{self._label()}: step must be an int, got {t!r}")
        if not 0 <= int(t) < self._num_steps:
            raise ValueError(
                f"{self._label()}: step {int(t)} is out of range for num_steps={self._num_steps} "
                f"(valid: 0..{self._num_steps - 1})"
            )
        self._step = int(t)

    # --- torch.nn plumbing ----------------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Follow ``.to()`` / ``.cuda()`` for the device, but keep amax exactly float32 (e.g. under ``.half()``)."""
        keep = self._amax.detach().clone() if self._amax is not None else None
        out = super()._apply(fn, recurse)
        self._device = fn(torch.empty(0, device=self._device)).device
        a = self._amax
        if a is not None and keep is not None and a.dtype != torch.float32:
            a.data = keep.to(a.device)
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "_amax"
        if key in state_dict:
            where = prefix[:-1] or "<root>"
            src = state_dict[key]
            if not isinstance(src, torch.Tensor):
                raise TypeError(f"{self._label()} at {where!r}: state dict entry {key!r} is not a tensor")
            label = f"{self._label()} at {where!r}"
            checked = _to_amax_tensor(src, self._device_now(), label)
            cur = self._amax
            if cur is not None and _is_flat_block_layout(self, tuple(src.shape), tuple(cur.shape)):
                # ModelOpt stores a block amax flat, one row per block: (rows * blocks, 1) -> ours (rows, blocks)
                state_dict = {**state_dict, key: checked.reshape(cur.shape)}
            elif cur is None:
                self._store_amax(checked)  # a fresh quantizer: take the saved shape, on this quantizer's device
            elif tuple(cur.shape) != tuple(src.shape):
                raise ValueError(
                    f"{label}: amax in the state dict has shape {tuple(src.shape)} but this quantizer's "
                    f"amax has shape {tuple(cur.shape)} (different axis, block sizes, num_steps or "
                    "layer shape?)"
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _is_flat_block_layout(q, src: tuple, cur: tuple) -> bool:
    """True when ``src`` is ModelOpt's flat ``(n_blocks, 1)`` layout of a static block amax stored here as ``cur``."""
    d = getattr(q, "_desc", None)
    if d is None or not d.per_block_amax or getattr(q, "_num_steps", 1) != 1:
        return False
    n = int(torch.Size(cur).numel())
    return src != cur and len(src) == 2 and src[1] == 1 and src[0] == n
