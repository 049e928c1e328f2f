"""``Int8Quantizer``: a small standalone 8-bit quantizer (calibrate -> quantize -> dequantize) for analysis.

It is a thin stateful helper over the exact functional ops of :mod:`modelopt_lite.tensor_quant`, so its codes are
the ones a ``TensorQuantizer`` and an exported QuantizeLinear produce:

- symmetric: ``scale = amax / 127``, ``q = clamp(rint(x / scale), qmin, qmax)`` (``[-127, 127]`` by default,
  ``narrow_range=False`` gives ``[-128, 127]``), amax from max ``|x|``;
- asymmetric: the range ``[min(x), max(x)]`` widened to include 0, ``scale = (hi - lo) / 255``,
  ``zero_point = clamp(rint(-128 - lo / scale))``, ``q = clamp(rint(x / scale) + zero_point, -128, 127)``;
- per channel (``channel_axis``) or per group of ``group_size`` consecutive elements along the last dim.

``calibrate`` may be called several times: the ranges only grow (running max/min).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ..formats import int_range
from ..functional import blocks
from ..functional.checks import check_axes, check_input
from ..functional.scales import affine_params, positive_scale, scale_from_amax
from ..tensor_quant import affine_tensor_quant, block_quant, tensor_quant


class Int8Quantizer:
    """Standalone 8-bit quantizer with ``calibrate(t)``, ``quantize(t)``, ``dequantize(q)`` and
    ``get_quantization_params()``.

    Args:
        symmetric: zero point 0 and scale from max ``|x|`` (True) or an asymmetric range with a zero point.
        per_channel: one scale (and zero point) per index of ``channel_axis``.
        channel_axis: the channel dimension for ``per_channel``.
        group_size: one scale per ``group_size`` consecutive elements of the last dim (a last partial group is
            allowed for symmetric quantization; asymmetric groups need the last dim to be a multiple).
        narrow_range: symmetric grid ``[-127, 127]`` (default, as in most int8 toolkits) or ``[-128, 127]``.

    Raises:
        ValueError: ``per_channel`` together with ``group_size``, a non-positive ``group_size``; later, calling
            ``quantize`` before ``calibrate`` or with a tensor whose shape does not match the calibration.
    """

    def __init__(
        self,
        symmetric: bool = True,
        per_channel: bool = False,
        channel_axis: int = 0,
        group_size: int | None = None,
        narrow_range: bool = True,
    ):
        for n, v in (("symmetric", symmetric), ("per_channel", per_channel), ("narrow_range", narrow_range)):
            if not isinstance(v, bool):
                raise TypeError(f"Int8Quantizer: {n} must be a bool, got {v!r}")
        if isinstance(channel_axis, bool) or not isinstance(channel_axis, int):
            raise TypeError(f"Int8Quantizer: channel_axis must be an int, got {channel_axis!r}")
        if group_size is not None:
            if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
                raise ValueError(f"Int8Quantizer: group_size must be a positive int or None, got {group_size!r}")
            if per_channel:
                raise ValueError("Int8Quantizer: per_channel and group_size are mutually exclusive")
        self.symmetric, self.per_channel, self.channel_axis = symmetric, per_channel, channel_axis
        self.group_size, self.narrow_range = group_size, narrow_range
        self._lo: torch.Tensor | None = None  # running min (asymmetric) - or None
        self._hi: torch.Tensor | None = None  # running max (asymmetric) / running amax (symmetric)
        self._shape: tuple | None = None

    # --- ranges ----------------------------------------------------------------------------------------------------
    def _reduce_dims(self, t: torch.Tensor) -> tuple[int, ...]:
        if not self.per_channel:
            return tuple(range(t.dim()))
        (axis,) = check_axes(self.channel_axis, t.dim(), "Int8Quantizer channel_axis")
        return tuple(d for d in range(t.dim()) if d != axis)

    def _grouped(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` viewed as ``(..., n_groups, group_size)`` (asymmetric groups only)."""
        g = cast(int, self.group_size)  # only called when a group size is set
        if t.dim() == 0 or t.shape[-1] % g:
            raise ValueError(
                f"Int8Quantizer: asymmetric group quantization needs the last dim to be a multiple of "
                f"group_size={g}, got shape {tuple(t.shape)}"
            )
        return t.reshape(*t.shape[:-1], t.shape[-1] // g, g)

    def _check(self, t, what="tensor") -> None:
        check_input(t, what)
        if t.numel() == 0:
            raise ValueError(f"Int8Quantizer: {what} is empty")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"Int8Quantizer: {what} contains NaN or Inf")

    def calibrate(self, t: torch.Tensor) -> Int8Quantizer:
        """Record the range of ``t`` (merged with earlier calls); returns self."""
        self._check(t)
        x = t.detach().float()
        shape = self._param_shape(x)
        if self._shape is not None and shape != self._shape:
            raise ValueError(
                f"Int8Quantizer: calibration tensor of shape {tuple(t.shape)} gives parameters of "
                f"shape {shape}, but earlier calibration gave {self._shape}"
            )
        if self.symmetric:
            amax = (
                blocks.block_amax(x, {-1: self.group_size})
                if self.group_size
                else torch.amax(x.abs(), dim=self._reduce_dims(x), keepdim=True)
            )
            self._hi = amax if self._hi is None else torch.maximum(self._hi, amax)
        else:
            if self.group_size:
                xg = self._grouped(x)
                lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
            else:
                dims = self._reduce_dims(x)
                lo, hi = torch.amin(x, dim=dims, keepdim=True), torch.amax(x, dim=dims, keepdim=True)
            self._lo = lo if self._lo is None else torch.minimum(self._lo, lo)
            self._hi = hi if self._hi is None else torch.maximum(self._hi, hi)
        self._shape = shape
        return self

    def _param_shape(self, x: torch.Tensor) -> tuple:
        if self.group_size:
            if self.symmetric:
                return blocks.blocks_shape(x.shape, blocks.normalize({-1: self.group_size}, x.shape))
            return tuple(self._grouped(x).shape[:-1]) + (1,)
        dims = self._reduce_dims(x)
        return tuple(1 if d in dims else n for d, n in enumerate(x.shape))

    @property
    def is_calibrated(self) -> bool:
        """Whether :meth:`calibrate` has been called."""
        return self._hi is not None

    def _need_calib(self) -> None:
        if self._hi is None:
            raise ValueError("Int8Quantizer is not calibrated: call calibrate(tensor) first")

    def reset(self) -> None:
        """Forget the calibrated ranges."""
        self._lo = self._hi = self._shape = None

    # --- quantize / dequantize -------------------------------------------------------------------------------------
    def quantize(self, t: torch.Tensor) -> torch.Tensor:
        """int8 codes of ``t`` (same shape) with the calibrated parameters."""
        self._need_calib()
        check_input(t)
        if self._param_shape(t.detach()) != self._shape:
            raise ValueError(
                f"Int8Quantizer: tensor of shape {tuple(t.shape)} does not match the calibration "
                f"parameters of shape {self._shape}"
            )
        if not self.symmetric:
            if self.group_size:
                q, _, _ = affine_tensor_quant(self._grouped(t), self._lo, self._hi, 8)
                return q.reshape(t.shape).to(torch.int8)
            q, _, _ = affine_tensor_quant(t, self._lo, self._hi, 8)
            return q.to(torch.int8)
        if self.group_size:
            q, _ = block_quant(t, {-1: self.group_size}, self._hi, num_bits=8, narrow_range=self.narrow_range)
            return q.to(torch.int8)
        q, _ = tensor_quant(t, self._hi, 8, narrow_range=self.narrow_range, dtype=torch.int8)
        return q

    def dequantize(self, q: torch.Tensor) -> torch.Tensor:
        """float32 ``(q - zero_point) * scale``; equal bit for bit to fake quantization of the original tensor."""
        self._need_calib()
        if not isinstance(q, torch.Tensor) or q.dtype != torch.int8:
            raise TypeError(
                f"Int8Quantizer.dequantize expects int8 codes, got "
                f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}"
            )
        p = self.get_quantization_params()
        scale, zp = p["scale"], p["zero_point"].float()
        if self.group_size:
            g = self.group_size
            if self.symmetric:
                sizes = blocks.normalize({-1: g}, q.shape)
                qb, pad = blocks.to_blocks(q.float(), sizes)
                yb = qb * blocks.expand_amax(scale, sizes)
                return blocks.from_blocks(yb, q.shape, pad)
            return ((self._grouped(q.float()) - zp) * scale).reshape(q.shape)
        return (q.float() - zp) * scale

    def fake_quantize(self, t: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(t))`` in t's dtype (the simulated quantization error)."""
        return self.dequantize(self.quantize(t)).to(t.dtype)

    def get_quantization_params(self) -> dict:
        """``scale`` (float32, positive), ``zero_point`` (int32, zeros when symmetric), ``qmin``/``qmax``, the
        calibrated range (``amax`` or ``min``/``max``) and the settings."""
        self._need_calib()
        hi, lo = self._hi, self._lo
        assert hi is not None  # calibrated (checked above)
        out: dict[str, Any] = {
            "symmetric": self.symmetric,
            "per_channel": self.per_channel,
            "channel_axis": self.channel_axis if self.per_channel else None,
            "group_size": self.group_size,
        }
        if self.symmetric:
            bound, qmin, qmax = int_range(8, False, self.narrow_range)
            scale = positive_scale(scale_from_amax(hi, bound))
            out.update(
                scale=scale,
                zero_point=torch.zeros(scale.shape, dtype=torch.int32),
                qmin=qmin,
                qmax=qmax,
                amax=hi.clone(),
            )
        else:
            assert lo is not None  # asymmetric calibration sets both ends
            scale, zp, qmin, qmax = affine_params(lo, hi, 8)
            out.update(
                scale=positive_scale(scale),
                zero_point=zp.to(torch.int32),
                qmin=qmin,
                qmax=qmax,
                min=lo.clone(),
                max=hi.clone(),
            )
        return out

    def __repr__(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        c = f", per_channel=True, channel_axis={self.channel_axis}" if self.per_channel else ""
        return f"Int8Quantizer(symmetric={self.symmetric}{c}{g}, calibrated={self.is_calibrated})"
