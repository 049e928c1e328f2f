"""What exporters and ``fake2real`` read from a :class:`~modelopt_lite.nn.TensorQuantizer`: ``export_info()`` (the
format, axes, blocks, amax and scale as fresh tensors) and ``quantize_weight_codes(w)`` (a weight's real codes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..descriptor import ScaledQuantDescriptor
from ..formats import element_format, format_range, torch_code_dtype
from ..functional import blocks
from ..tensor_quant import block_quant, tensor_quant


class QuantizerExport(nn.Module):
    """Export views of TensorQuantizer (mixed into it; relies on its descriptor, amax and affine-bias state)."""

    if TYPE_CHECKING:
        _desc: ScaledQuantDescriptor
        _last_rank: int | None
        _amax: torch.Tensor | None
        amax: torch.Tensor | None
        axis: Any
        dynamic: bool
        bias: Any
        bias_value: torch.Tensor | None

        @property
        def scale(self) -> torch.Tensor | None: ...

        def _label(self) -> str: ...

        def _effective_amax(self) -> torch.Tensor | None: ...

        def _resolve_axes(self, rank: int): ...

        def _amax_for(self, x: torch.Tensor): ...

        def _uncalibrated_error(self) -> RuntimeError: ...

    def _export_rank(self):
        if self._last_rank is not None:
            return self._last_rank
        a = self.amax if self._amax is not None else None
        if a is not None and self.axis is not None:
            return a.dim() if a.numel() > 1 or a.dim() > 0 else None
        return None

    def export_info(self) -> dict:
        """What an exporter needs, as fresh tensors (the amax buffer is never modified).

        Keys: ``kind`` ("int" | a float format's name: "e4m3", "e5m2", "e2m1" | "block" | a block scheme's name:
        "nvfp4", "mxfp8", ...), ``num_bits``,
        ``unsigned``, ``narrow_range``, ``axis`` (tuple of
        non-negative dims resolved against the last input rank, or None), ``block_sizes`` (axis keys made
        non-negative when the rank is known), ``amax`` (current step, ``scale_amax`` applied; None when dynamic),
        ``scale`` (positive float32, dead slices 1.0; None when dynamic), ``qmin``, ``qmax``, ``dynamic``, ``bias`` (the
        stored static affine bias, float32, or None; see :mod:`._affine_bias`).
        """
        d = self._desc
        fmt = element_format(d.num_bits)
        kind = "block" if d.block_sizes else (fmt.name if fmt.is_scaled_float else "int")
        kind = d.block_scheme.name if d.block_scheme else kind  # "nvfp4", "mxfp8", ... (formats.BLOCK_SCHEMES)
        _, qmin, qmax = format_range(d.num_bits, d.unsigned, d.narrow_range)
        rank = self._export_rank()
        axis = None
        if d.axis is not None:
            axis = (
                self._resolve_axes(rank)
                if rank is not None
                else ((d.axis,) if isinstance(d.axis, int) else tuple(d.axis))
            )
        block_sizes = dict(d.block_sizes) if d.block_sizes else None  # a fresh, mutable copy
        if block_sizes and rank is not None:
            pos = blocks.normalize(block_sizes, [1] * rank)
            sizes = {a: block_sizes[k] for a, k in zip(pos, (k for k in block_sizes if not isinstance(k, str)))}
            block_sizes = {**sizes, **{k: v for k, v in block_sizes.items() if isinstance(k, str)}}
        amax = scale = None
        if not d.dynamic:
            eff, s = self._effective_amax(), self.scale
            if eff is None or s is None:
                raise self._uncalibrated_error()
            amax, scale = eff.detach().clone().float(), s.clone()
            if axis is not None and rank is not None and amax.numel() > 1 and amax.dim() != rank and len(axis) == 1:
                keep = [amax.numel() if d == axis[0] else 1 for d in range(rank)]  # a flat fixed amax
                amax, scale = amax.reshape(keep), scale.reshape(keep)
        return {
            "kind": kind,
            "num_bits": d.num_bits,
            "unsigned": d.unsigned,
            "narrow_range": d.narrow_range,
            "axis": axis,
            "block_sizes": block_sizes,
            "amax": amax,
            "scale": scale,
            "qmin": qmin,
            "qmax": qmax,
            "dynamic": d.dynamic,
            "bias": None if self.bias_value is None else self.bias_value.detach().clone(),
        }

    def quantize_weight_codes(self, w: torch.Tensor):
        """Real quantization of a weight: ``(codes, scale)`` with ``w ~= codes * scale`` (blocks: scale per block).

        Integer formats give int8/uint8 (<= 8 bits), int16 or int32 codes; E4M3/E5M2 give float8_e4m3fn/float8_e5m2
        codes, E2M1 its float32 grid values. The
        scale is positive float32 with amax's shape. Uses the stored amax (or the dynamic one).
        """
        d = self._desc
        if self.bias is not None:
            raise ValueError(f"{self._label()}: a quantizer with an affine bias has no weight codes (fake quantize)")
        if not self.dynamic and self._amax is None:
            raise self._uncalibrated_error()
        try:
            amax = self._amax_for(w)
            if d.block_scheme is not None:
                raise ValueError(f"{d.block_scheme.name.upper()} real codes: use functional.microscaling.quantize_*")
            fmt = element_format(d.num_bits)
            if fmt.is_scaled_float:
                if d.block_sizes:
                    raise ValueError(f"{fmt.name.upper()} block quantization has no code export; use fake quantization")
                return tensor_quant(w, amax, d.num_bits)
            dtype = torch_code_dtype(d.num_bits, d.unsigned)
            if d.block_sizes:
                q, s = block_quant(w, d.block_sizes, amax, d.num_bits, d.unsigned, d.narrow_range)
                if bool(torch.isnan(q).any()):
                    raise ValueError("the weight contains NaN, which has no integer code")
                return q.to(dtype), s
            return tensor_quant(w, amax, d.num_bits, d.unsigned, d.narrow_range, dtype=dtype)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{self._label()}: {e}") from e
