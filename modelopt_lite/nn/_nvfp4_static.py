"""Static NVFP4 on :class:`~modelopt_lite.nn.TensorQuantizer` (ModelOpt's ``StaticBlockScaleQuantizer`` format).

A quantizer built with ``{"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}``
stores one amax per block in ``_amax`` (shape: blocks per axis, e.g. ``(out, in / 16)`` for a Linear weight) and a
per-tensor float32 ``_global_amax`` buffer. Max calibration sets the block amaxes to each block's max |x| and the
global amax to their max; scale searches (``mse_calibrate(fp8_scale_sweep=True)``, ``local_hessian_calibrate``)
then move the block amaxes with the global amax fixed. The fake quant is dynamic NVFP4's, with those amaxes in place
of the input's own (:mod:`modelopt_lite.functional.library_nvfp4_static`): after max calibration on a weight both
give the same bits. An uncalibrated static NVFP4 quantizer refuses to quantize (ValueError naming it).

ModelOpt stores the block amax flat, ``(rows * blocks, 1)``; a tensor in that layout is read as ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..descriptor import ScaledQuantDescriptor
from ..functional.library_nvfp4_static import nvfp4_static_fake_quant
from ._amax_state import _to_amax_tensor


class StaticNVFP4State(nn.Module):
    """The global amax of static NVFP4 and its forward (mixed into TensorQuantizer, before AmaxStateMixin)."""

    if TYPE_CHECKING:
        _amax: torch.Tensor | None
        _desc: ScaledQuantDescriptor

        def _label(self) -> str: ...

        def _stored_amax(self) -> torch.Tensor | None: ...

        def _device_now(self) -> torch.device: ...

    @property
    def is_nvfp4_static(self) -> bool:
        """True for static NVFP4 (stored block amaxes and a global amax; ModelOpt's name)."""
        return self._desc.nvfp4_static

    @property
    def global_amax(self) -> torch.Tensor | None:
        """Static NVFP4's per-tensor float32 amax (the global scale is ``global_amax / (6 * 448)``): the stored
        ``_global_amax``, else the max of the block amaxes; None before calibration or for other formats."""
        g = self._buffers.get("_global_amax")
        if g is not None:
            return g
        a = self._amax if self.is_nvfp4_static else None
        return None if a is None else a.detach().amax().float()

    @global_amax.setter
    def global_amax(self, value) -> None:
        if not self.is_nvfp4_static:
            raise ValueError(f"{self._label()}: global_amax applies to static NVFP4 quantizers only")
        if value is None:
            self._buffers.pop("_global_amax", None)
            return
        t = _to_amax_tensor(value, self._device_now(), self._label() + " global_amax")
        if t.numel() != 1:
            raise ValueError(f"{self._label()}: global_amax must be one value, got shape {tuple(t.shape)}")
        self._buffers.pop("_global_amax", None)
        self.register_buffer("_global_amax", t.reshape(()))

    def _store_amax(self, t: torch.Tensor | None) -> None:
        if t is None:
            self._buffers.pop("_global_amax", None)  # uncalibrated again: the global amax goes with the blocks
        super()._store_amax(t)  # type: ignore[misc]

    def _calibrated_global_amax(self) -> None:
        """After max calibration: the global amax is the max of the new block amaxes."""
        if self.is_nvfp4_static and self._amax is not None:
            self.global_amax = self._amax.detach().amax()

    def _block_amax_for(self, x: torch.Tensor) -> torch.Tensor:
        """The stored block amaxes shaped ``(*x.shape[:-1], nblocks)`` (ModelOpt's flat layout reshaped)."""
        a = self._stored_amax()
        if a is None:
            raise ValueError(
                f"{self._label()}: static NVFP4 has no block amax: calibrate it (its blocks' max |x|) or set .amax "
                "before quantizing"
            )
        want = (*x.shape[:-1], -(-x.shape[-1] // int(self._desc.block_sizes[-1])))
        if tuple(a.shape) != want and a.dim() == 2 and a.shape[1] == 1 and a.numel() == torch.Size(want).numel():
            a = a.reshape(want)
        return a

    def _static_nvfp4_quantize(self, x: torch.Tensor) -> torch.Tensor:
        if not self._desc.fake_quant:
            raise ValueError(
                "NVFP4 real quantization returns packed codes and block scales: use "
                "modelopt_lite.functional.microscaling.quantize_nvfp4(..., block_amax=...) (fake_quant=True here)"
            )
        a = self._block_amax_for(x)
        return nvfp4_static_fake_quant(x, a, self.global_amax, int(self._desc.block_sizes[-1]))

    def _apply(self, fn, recurse=True):
        """Keep the global amax float32 (e.g. under ``.half()``), as the block amax."""
        keep = self._buffers.get("_global_amax")
        keep = keep.detach().clone() if keep is not None else None
        out = super()._apply(fn, recurse)
        g = self._buffers.get("_global_amax")
        if g is not None and keep is not None and g.dtype != torch.float32:
            g.data = keep.to(g.device)
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        key = prefix + "_global_amax"
        if key in state_dict:
            src = state_dict[key]
            where = prefix[:-1] or "<root>"
            if not isinstance(src, torch.Tensor):
                raise TypeError(f"{self._label()} at {where!r}: state dict entry {key!r} is not a tensor")
            if not self.is_nvfp4_static:
                raise ValueError(
                    f"{self._label()} at {where!r}: {key!r} is given but the quantizer is not static NVFP4"
                )
            t = _to_amax_tensor(src, self._device_now(), f"{self._label()} at {where!r} global_amax")
            if t.numel() != 1:
                raise ValueError(f"{self._label()} at {where!r}: global_amax must be one value, got {tuple(t.shape)}")
            if self._buffers.get("_global_amax") is None:
                self.register_buffer("_global_amax", torch.zeros((), device=t.device))
            state_dict = {**state_dict, key: t.reshape(())}
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
