"""Static NVFP4 on :class:`~modelopt_lite.nn.TensorQuantizer` (ModelOpt's ``StaticBlockScaleQuantizer`` format).

A quantizer built with ``{"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}``
stores one amax per block in ``_amax`` (shape: blocks per axis, e.g. ``(out, in / 16)`` for a Linear weight) and a
per-tensor float32 ``_global_amax`` buffer. Max calibration sets the block amaxes to each block's max |x| and the
global amax to their max; scale searches (``mse_calibrate(fp8_scale_sweep=True)``, ``local_hessian_calibrate``)
then move the block amaxes with the global amax fixed. The fake quant is dynamic NVFP4's, with those amaxes in place
of the input's own (:mod:`modelopt_lite.functional.library_nvfp4_static`): after max calibration on a weight both
give the same bits. Uncalibrated (no block amax yet), it quantizes each input with that input's own block maxima and
max, i.e. as dynamic NVFP4 (ModelOpt's StaticBlockScaleQuantizer falls back the same way, and so does every
uncalibrated quantizer here: AWQ's and SVDQuant's searches rely on it); ``enable_lsq``, ``fake2real``, the HF and
ONNX exports refuse it (ValueError naming the quantizer).

ModelOpt stores the block amax flat, ``(rows * blocks, 1)``; a tensor in that layout is read as ours.

LSQ (:meth:`StaticNVFP4State.enable_lsq`, ModelOpt's ``enable_lsq``; run by ``model_calib.lsq``): separate quantize
and dequantize block amaxes ``_amax_pre`` / ``_amax_post`` (one tensor when tied), initialised from the calibrated
amax, of which ``learnable_amax`` are float32 ``nn.Parameter`` s (ModelOpt keeps them in the weight's dtype); the
forward is :func:`modelopt_lite.functional.nvfp4_lsq.fake_nvfp4_lsq`. The calibrated ``_amax`` stays as it was
(ModelOpt deletes it); ``disable_lsq()`` returns to the plain static quantizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..descriptor import ScaledQuantDescriptor
from ..functional import microscaling as mx
from ..functional.library_nvfp4_static import nvfp4_static_fake_quant
from ..functional.microscaling import nvfp4_global_scale
from ..functional.nvfp4_lsq import fake_nvfp4_lsq
from ._amax_state import _to_amax_tensor

_LSQ_AMAXES = ("pre", "post")


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
            self.disable_lsq()
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

    # --- LSQ ---------------------------------------------------------------------------------------------------------
    _lsq: dict | None = None

    def enable_lsq(
        self, quantize_scales=None, learnable_amax=("post",), tied_amax: bool = False, quantize_pre_scale: bool = True
    ) -> None:
        """LSQ mode (see the module docstring): ``learnable_amax`` among "pre"/"post" become parameters;
        ``tied_amax``: one tensor for both; ``quantize_scales`` (default True): E4M3 block scales (False: ``a / 6``);
        ``quantize_pre_scale=False``: the pre scale unquantized."""
        label = self._label()
        if not self.is_nvfp4_static or self._amax is None or self.global_amax is None:
            raise ValueError(f"{label}: enable_lsq needs a calibrated static NVFP4 quantizer (block amaxes + global)")
        names = [learnable_amax] if isinstance(learnable_amax, str) else list(learnable_amax)
        if any(n not in _LSQ_AMAXES for n in names):
            raise ValueError(
                f"{label}: learnable_amax must be 'pre', 'post', a list of those or [], got {learnable_amax!r}"
            )
        for key, v in (("tied_amax", tied_amax), ("quantize_pre_scale", quantize_pre_scale)):
            if not isinstance(v, bool):
                raise TypeError(f"{label}: {key} must be a bool, got {v!r}")
        quantize = True if quantize_scales is None else quantize_scales
        if not isinstance(quantize, bool):
            raise TypeError(f"{label}: quantize_scales must be a bool or None, got {quantize_scales!r}")
        self.disable_lsq()
        a = self._amax.detach().float().clone()
        for name in ("post",) if tied_amax else _LSQ_AMAXES:
            t = a.clone()
            if name in names or (tied_amax and names):
                self.register_parameter(f"_amax_{name}", nn.Parameter(t))
            else:
                self.register_buffer(f"_amax_{name}", t)
        self._lsq = {"learnable": sorted(set(names)), "tied": tied_amax, "quantize_scales": quantize,
                     "quantize_pre_scale": quantize_pre_scale}  # fmt: skip

    def disable_lsq(self) -> None:
        """Leave LSQ mode (the learned amaxes are dropped; ``_amax`` is the calibrated one)."""
        for name in ("_amax_pre", "_amax_post"):
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)
        self._lsq = None

    @property
    def amax_pre(self) -> torch.Tensor | None:
        """LSQ's quantize amax (the post one when tied); None outside LSQ mode."""
        if self._lsq is None:
            return None
        return getattr(self, "_amax_post" if self._lsq["tied"] else "_amax_pre")

    @property
    def amax_post(self) -> torch.Tensor | None:
        """LSQ's dequantize amax; None outside LSQ mode."""
        return None if self._lsq is None else self._parameters.get("_amax_post", self._buffers.get("_amax_post"))

    def _lsq_quantize(self, x: torch.Tensor, block: int) -> torch.Tensor:
        lsq = self._lsq
        assert lsq is not None
        want = tuple(self._block_amax_for(x).shape)
        pre, post = self.amax_pre, self.amax_post
        assert pre is not None and post is not None
        pre, post = pre.reshape(want), post.reshape(want)
        g = self.global_amax
        assert g is not None
        gs = nvfp4_global_scale(g.detach().float().reshape(()).to(x.device))
        qs = lsq["quantize_scales"]
        return fake_nvfp4_lsq(x, pre, post, gs, block, qs and lsq["quantize_pre_scale"], qs)

    def _static_nvfp4_quantize(self, x: torch.Tensor) -> torch.Tensor:
        if not self._desc.fake_quant:
            raise ValueError(
                "NVFP4 real quantization returns packed codes and block scales: use "
                "modelopt_lite.functional.microscaling.quantize_nvfp4(..., block_amax=...) (fake_quant=True here)"
            )
        block = int(self._desc.block_sizes[-1])
        if self._lsq is not None:
            return self._lsq_quantize(x, block)
        if self._stored_amax() is None:  # uncalibrated: x's own block maxima and max (= dynamic NVFP4)
            mx._check_finite(x, "NVFP4 input")
            a = mx._block_amax(mx._blocks(x.detach(), block))
            g = self._buffers.get("_global_amax")  # a set global amax is kept (dynamic NVFP4 with that amax)
            return nvfp4_static_fake_quant(x, a, g if g is not None else a.amax(), block)
        return nvfp4_static_fake_quant(x, self._block_amax_for(x), self.global_amax, block)

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
