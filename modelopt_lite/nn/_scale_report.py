"""The scales a :class:`~modelopt_lite.nn.TensorQuantizer` reports (mixed into it, first in its bases): ``maxbound``,
``step_size`` and ``scale`` from the stored amax, and the scale of the last real-quant forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..descriptor import ScaledQuantDescriptor
from ..formats import format_range
from ..functional.division import true_div
from ..functional.microscaling import nvfp4_global_scale
from ..functional.scales import positive_scale, scale_from_amax
from ..tensor_quant import quantize_block_scales


class ScaleReport:
    """``maxbound``, ``step_size``, ``scale`` (relies on the quantizer's descriptor, amax and global amax)."""

    if TYPE_CHECKING:
        _desc: ScaledQuantDescriptor
        _last_scale: torch.Tensor | None
        amax: torch.Tensor | None
        global_amax: torch.Tensor | None
        num_bits: int | tuple
        unsigned: bool
        narrow_range: bool
        scale_amax: float | None
        block_sizes: dict | None

    @property
    def maxbound(self):
        """The value amax maps to: ``2**(b-1) - 1`` signed, ``2**b - 1`` unsigned, 448 / 57344 / 6 for E4M3 / E5M2 /
        E2M1."""
        return format_range(self.num_bits, self.unsigned, self.narrow_range).bound

    def _effective_amax(self) -> torch.Tensor | None:
        a = self.amax
        if a is None:
            return None
        return a * self.scale_amax if self.scale_amax is not None else a

    @property
    def step_size(self) -> torch.Tensor | None:
        """``amax / maxbound`` (float32, detached; ``scale_amax`` applied); None before calibration."""
        a = self._effective_amax()
        return None if a is None else true_div(a.detach().float(), float(self.maxbound))

    @property
    def scale(self) -> torch.Tensor | None:
        """The positive float32 scale (``amax / maxbound``; dead slices report 1.0; blocks: double-quantized); None
        before calibration, except that a real-quant (``fake_quant=False``) quantizer without an amax reports the
        scale of its last input, as pytorch-quantization does. (NVIDIA's tools call the inverse multiplier
        ``maxbound / amax`` their scale.)"""
        a = self._effective_amax()
        if a is None:
            return None if self._desc.fake_quant else self._last_scale
        if self._desc.block_scheme is not None:  # NVFP4: the per-tensor float32 global scale amax / (6 * 448)
            g = self.global_amax  # static NVFP4: its global amax, not the blocks' (None for other formats)
            return positive_scale(nvfp4_global_scale((a if g is None else g).detach()))
        s = scale_from_amax(a.detach(), float(self.maxbound))
        bs = self.block_sizes
        if bs and bs.get("scale_bits") is not None:
            s = quantize_block_scales(s, bs["scale_bits"], bs.get("scale_block_sizes"))
        return positive_scale(s)

    def _keep_scale(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``q``; remembers ``s`` for :attr:`scale` (not while tracing or compiling: a plain attribute)."""
        if not (torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            self._last_scale = s.detach()
        return q
