"""Exact squared fake-quantization error integrated over histogram bins (the core of the ``mse`` search).

A histogram bin ``[lo, hi)`` holding ``c`` values is read as ``c`` values spread evenly over the bin. With a
candidate amax the quantizer has ``scale = float32(amax) / bound`` (``functional.scales``) and maps ``v = x / scale``
to the nearest level of its grid (ties have measure zero), saturating at the top level:

- integer grids: levels ``0, 1, ..., qmax`` (only ``|x|`` matters: the histogram is of ``|x|``);
- float formats: the non-negative finite values (subnormals included; :func:`~modelopt_lite.formats.float_levels`):
  E4M3's 127 saturating at 448, E5M2's 124 at 57344, E2M1's 8 at 6.

``G(v) = integral from 0 to v of (t - level(t))**2 dt`` has a closed form (integer grid: with
``i = min(floor(v + 1/2), qmax)``, ``G(v) = i/12 + (v - i)**3 / 3``; float formats: a prefix table over the level cells),
so a bin's total error is ``c * scale**3 * (G(hi/scale) - G(lo/scale)) / (hi - lo)``, exactly, for every candidate.

Why not fake-quantize the bin centers (pytorch-quantization)? When the step ``scale`` is close to a multiple of the
bin width, the centers sit at the same offsets inside every step and the estimate dips by about
``(width/scale)**2 / 12`` of the step's error: on N(0,1) data the argmin then locks onto such a candidate
(measured: amax 3.967 instead of 3.924; the raw-data optimum is ~3.92). The integral has no such aliasing.
"""

from __future__ import annotations

import torch

from ..formats import float_levels, int_range, scaled_float_format
from ..functional.division import true_div


class ErrorIntegral:
    """``G(v)`` for one format (see the module docstring); call it on float64 tensors of any shape.

    Above ``top_start`` (the start of the top level's cell, where saturation begins) ``G(v)`` is
    ``const + (v - top)**3 / 3``, a polynomial: sums over such bins reduce to prefix sums (see ``mse.py``).
    """

    def __init__(self, num_bits, unsigned: bool = False, device=None):
        fmt = scaled_float_format(num_bits)
        self.e4m3 = fmt is not None  # any float format (E4M3, E5M2, E2M1): a level table
        if fmt is None:
            self.qmax = int_range(num_bits, unsigned, False).qmax
            self.top, self.top_start = float(self.qmax), self.qmax - 0.5
            return
        lv = float_levels(fmt, device)
        start = torch.cat([lv.new_zeros(1), true_div(lv[1:] + lv[:-1], 2)])  # cell i = [start_i, start_{i+1})
        end = torch.cat([start[1:], lv.new_full((1,), float("inf"))])
        cell = true_div((end[:-1] - lv[:-1]) ** 3 - (start[:-1] - lv[:-1]) ** 3, 3)
        self.levels, self.start = lv, start
        self.prefix = torch.cat([lv.new_zeros(1), cell.cumsum(0)])  # integral from 0 to start_i
        self.top, self.top_start = float(lv[-1]), float(start[-1])

    def __call__(self, v: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``G(v)`` elementwise (float64); ``inplace=True`` may overwrite ``v`` (saves memory traffic)."""
        return true_div(self.g12(v, inplace), 12)

    def g12(self, v: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``12 * G(v)`` (fewer operations; G is continuous, so rounding ties at cell borders do not matter)."""
        if not self.e4m3:
            i = torch.round(v).clamp_(max=float(self.qmax))
            d = v.sub_(i) if inplace else v - i
            return torch.addcmul(i, d * d, d, value=4.0)
        i = torch.searchsorted(self.start, v, right=True) - 1
        lv, st = self.levels[i], self.start[i]
        return self.prefix[i] * 12 + ((v - lv) ** 3 - (st - lv) ** 3) * 4
