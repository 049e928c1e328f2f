"""pytorch-quantization's clip stage of a :class:`~modelopt_lite.nn.TensorQuantizer` (PACT-style learned range).

A quantizer built with ``learn_amax=True`` owns a ``clip`` module (:class:`~modelopt_lite.nn.Clip` with learnable
scalar bounds ``[-a, a]``, ``a`` the largest fixed amax, 1.0 without one), as pytorch-quantization's does. The clip
stage runs only when switched on (``TensorQuantizer(..., if_clip=True)`` or :meth:`ClipStateMixin.enable_clip`): in
``forward`` the input is collected by the calibrator first (unclipped), then clipped, then quantized, so
``if_quant=False, if_clip=True`` is a clip-only quantizer whose bounds train with the gradients of
:func:`modelopt_lite.nn.functional.clip`. The quantizer's own amax stays separate (learned with the LSQ gradient);
:meth:`~modelopt_lite.nn.TensorQuantizer.init_learn_amax` sets the clip bounds to ``[-max(amax), max(amax)]``.
The bounds are parameters of the ``clip`` submodule (``clip.clip_value_min`` / ``clip.clip_value_max`` in
``state_dict``); a quantizer without ``learn_amax`` has no ``clip``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn

from .modules.clip import Clip


class ClipStateMixin(nn.Module):
    """The ``clip`` stage for TensorQuantizer (mixed into it; relies on ``_label()`` and ``learn_amax``)."""

    if TYPE_CHECKING:
        learn_amax: bool

        def _label(self) -> str: ...

    _if_clip: bool = False

    def _init_clip(self, if_clip, initial_amax) -> None:
        if not isinstance(if_clip, bool):
            raise TypeError(f"{self._label()}: if_clip must be a bool, got {if_clip!r}")
        if if_clip and not self.learn_amax:
            raise ValueError(f"{self._label()}: if_clip=True needs learn_amax=True (the clip bounds are learned)")
        if self.learn_amax:
            self._make_clip(initial_amax)
        self._if_clip = if_clip

    def _make_clip(self, amax) -> None:
        if amax is None:
            a = 1.0
        elif isinstance(amax, torch.Tensor):
            a = float(amax.detach().float().max())
        else:
            a = float(np.max(np.asarray(amax, dtype=np.float32)))
        self.clip = Clip(-a, a, learn_min=True, learn_max=True)

    def _follow_learn_amax(self, amax: torch.Tensor | None) -> None:
        """Keep the clip stage in step with ``learn_amax`` after a descriptor change (``set_from_attribute_config``,
        a restore): a learn_amax quantizer owns ``clip`` (bounds from ``amax``), any other quantizer has none."""
        if self.learn_amax and self._clip_module() is None:
            self._make_clip(amax)
            if amax is not None:
                self._modules["clip"].to(amax.device)  # type: ignore[union-attr]
        elif not self.learn_amax and self._clip_module() is not None:
            del self._modules["clip"]
            self._if_clip = False

    def _clip_module(self) -> Clip | None:
        m = self._modules.get("clip")
        return m if isinstance(m, Clip) else None

    @staticmethod
    def _bounds(clip: Clip) -> tuple[torch.Tensor, torch.Tensor]:
        return cast(torch.Tensor, clip.clip_value_min), cast(torch.Tensor, clip.clip_value_max)

    def _sync_clip(self, amax: torch.Tensor) -> None:
        """Set the clip bounds to ``[-max(amax), max(amax)]`` (``init_learn_amax``), creating ``clip`` if needed."""
        clip = self._clip_module()
        if clip is None:
            self._make_clip(amax.detach())
            clip = cast(Clip, self._modules["clip"])
            clip.to(amax.device)
        lo, hi = self._bounds(clip)
        a = amax.detach().float().max()
        with torch.no_grad():
            lo.copy_(-a)
            hi.copy_(a)

    def enable_clip(self) -> None:
        """Clip inputs to the learned ``[clip_value_min, clip_value_max]`` before quantizing (needs learn_amax)."""
        if self._clip_module() is None:
            raise ValueError(f"{self._label()}: enable_clip() needs learn_amax=True (the clip bounds are learned)")
        self._if_clip = True

    def disable_clip(self) -> None:
        """Stop clipping in forward (the default)."""
        self._if_clip = False

    is_clip_enabled = property(lambda self: self._if_clip, doc="The clip stage runs in forward.")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Clip bounds are optional in a state dict: a state without them (a quantizer saved before learn_amax, e.g.
        a calibrated PTQ model loaded for QAT) sets them to ``[-max(amax), max(amax)]`` (else keeps them), and a
        quantizer without ``clip`` ignores saved bounds. (``state_dict`` is torch's per-load copy.)"""
        keys = (prefix + "clip.clip_value_min", prefix + "clip.clip_value_max")
        clip = self._clip_module()
        if clip is None:
            for k in keys:
                state_dict.pop(k, None)
        elif not any(k in state_dict for k in keys):
            lo, hi = self._bounds(clip)
            amax = state_dict.get(prefix + "_amax")
            if isinstance(amax, torch.Tensor) and amax.numel() and amax.is_floating_point():
                a = amax.detach().float().max().to(hi.device)
                state_dict[keys[0]], state_dict[keys[1]] = -a, a
            else:
                state_dict[keys[0]], state_dict[keys[1]] = lo.detach().clone(), hi.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply_clip(self, x: torch.Tensor) -> torch.Tensor:
        clip = self._clip_module()
        return clip(x) if self._if_clip and clip is not None else x
