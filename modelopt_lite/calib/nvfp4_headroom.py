"""``NVFP4ActHeadroomCalibrator``: ModelOpt 0.47's global amax with headroom for NVFP4 activations.

NVFP4 scales each block of 16 with an E4M3 scale under one per-tensor float32 global amax. Max calibration sets
the global amax to the largest value seen, so anything larger later saturates. This calibrator keeps a histogram of
``log2`` of every non-zero per-block amax (``num_bins`` bins over ``[log2_min, log2_max)``, int64 counts; a ragged
last block is zero-padded, which never changes a block's amax) and the literal max, and returns

    ``upper`` = the per-block amax at ``upper_percentile`` (the literal max when it is 100),
    ``anchor`` = the per-block amax at ``anchor_percentile``, bins below ``upper / 1e6`` left out,
    ``amax = rho * anchor`` when that exceeds ``upper``, else ``upper`` (with a warning: no headroom at this rho),

a percentile being the center (in ``log2``) of the first bin whose cumulative count reaches ``p / 100`` of the total,
exactly ModelOpt's rule, so both give the same amax for the same data. Empty or collapsed statistics fall back to the
literal max. With ``torch.distributed`` initialized the ranks' amaxes are combined by their max, as ModelOpt does.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..functional import blocks
from .distributed import is_active, reduce_max

#: the span of E4M3's normal values (448 / 2**-6): a larger ``rho`` leaves no room below the anchor
FP8_NORMAL_DYNAMIC_RANGE = 28672.0
_ANCHOR_FLOOR_RATIO = 1e6


def _number(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def check_headroom(rho, anchor_percentile, upper_percentile) -> tuple[float, float, float]:
    """Validated ``(rho, anchor_percentile, upper_percentile)``; ValueError naming the bad one."""
    r = _number(rho, "rho")
    if not 0.0 < r < FP8_NORMAL_DYNAMIC_RANGE:
        raise ValueError(f"rho must be in (0, {FP8_NORMAL_DYNAMIC_RANGE:g}), got {rho!r}")
    a = _number(anchor_percentile, "anchor_percentile")
    u = _number(upper_percentile, "upper_percentile")
    for name, p in (("anchor_percentile", a), ("upper_percentile", u)):
        if not 0.0 < p <= 100.0:
            raise ValueError(f"{name} must be in (0, 100], got {p!r}")
    return r, a, u


class NVFP4ActHeadroomCalibrator:
    """Global amax with headroom for an NVFP4 activation quantizer (see the module docstring).

    ``num_bits``, ``axis`` and ``unsigned`` are accepted for the calibrator interface (the amax is per tensor).
    """

    def __init__(
        self,
        num_bits=(2, 1),
        axis=None,
        unsigned=False,
        *,
        block_size: int = 16,
        anchor_percentile: float = 1.0,
        upper_percentile: float = 99.99,
        rho: float = 16384.0,
        num_bins: int = 512,
        log2_min: float = -40.0,
        log2_max: float = 40.0,
        name: str | None = None,
    ):
        self._rho, self._anchor_p, self._upper_p = check_headroom(rho, anchor_percentile, upper_percentile)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
        if not _number(log2_min, "log2_min") < _number(log2_max, "log2_max"):
            raise ValueError(f"need log2_min < log2_max, got {log2_min!r} and {log2_max!r}")
        self._num_bits, self._axis, self._unsigned = num_bits, axis, unsigned
        self._block_size, self._num_bins = block_size, num_bins
        self._log2_min, self._log2_max = float(log2_min), float(log2_max)
        self.name = name
        self._hist: torch.Tensor | None = None
        self._running_max: torch.Tensor | None = None
        self.num_collected = 0

    def _label(self) -> str:
        return f"NVFP4ActHeadroomCalibrator {self.name!r}" if self.name else "NVFP4ActHeadroomCalibrator"

    def _bin_index(self, log2_vals: torch.Tensor) -> torch.Tensor:
        span = torch.tensor(self._log2_max - self._log2_min, dtype=log2_vals.dtype, device=log2_vals.device)
        frac = torch.div(log2_vals - self._log2_min, span)
        return (frac * self._num_bins).floor().long().clamp_(0, self._num_bins - 1)

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Fold one activation batch's per-block amaxes (blocks along the last axis) into the histogram."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._label()}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.numel() == 0:
            return
        ba = blocks.block_amax(x.detach(), {-1: self._block_size}, what=f"{self._label()}: the input").flatten()
        ba = ba.float()
        cur = ba.max()
        self._running_max = cur if self._running_max is None else torch.maximum(self._running_max, cur)
        self.num_collected += 1
        nz = ba[ba > 0]
        if nz.numel() == 0:
            return
        counts = torch.bincount(self._bin_index(torch.log2(nz)), minlength=self._num_bins)
        if self._hist is None:
            self._hist = torch.zeros(self._num_bins, dtype=torch.int64, device=x.device)
        self._hist += counts.to(self._hist.device)

    def _percentile(self, p: float, floor_value: float | None = None) -> float | None:
        if self._hist is None:
            return None
        counts = self._hist.float()
        if floor_value is not None and floor_value > 0:
            floor_bin = int(self._bin_index(torch.log2(torch.tensor(floor_value))).item())
            counts[:floor_bin] = 0
        total = counts.sum()
        if total <= 0:
            return None
        cdf = torch.cumsum(counts, dim=0)
        k = int(torch.searchsorted(cdf, p / 100.0 * total).clamp(0, self._num_bins - 1).item())
        return float(2.0 ** (self._log2_min + (k + 0.5) / self._num_bins * (self._log2_max - self._log2_min)))

    def _local_amax(self) -> torch.Tensor | None:
        if self._hist is None or self._running_max is None:
            return None if self._running_max is None else self._running_max.clone()
        upper = float(self._running_max) if self._upper_p >= 100.0 else self._percentile(self._upper_p)
        anchor = self._percentile(self._anchor_p, floor_value=upper / _ANCHOR_FLOOR_RATIO) if upper else None
        if not upper or upper <= 0 or not anchor or anchor <= 0:
            return self._running_max.clone()
        amax = self._rho * anchor
        if amax <= upper:
            span = upper / anchor
            fix = (
                f"the span also exceeds the FP8 scale range ({FP8_NORMAL_DYNAMIC_RANGE:g}): no rho can clear it; "
                "reduce the range (SmoothQuant, per-channel, higher precision)"
                if span > FP8_NORMAL_DYNAMIC_RANGE
                else "lower anchor_percentile or raise rho for more headroom"
            )
            warnings.warn(
                f"{self._label()}: per-block amax span {span:.1f} leaves no headroom at rho={self._rho:g}; the "
                f"amax falls back to the top of the calibrated range ({fix})",
                stacklevel=3,
            )
            amax = upper
        return torch.tensor(amax, dtype=torch.float32, device=self._running_max.device)

    def compute_amax(self, method=None, **kwargs) -> torch.Tensor | None:
        """The global amax (float32, shape ``()``), or None before any data."""
        if kwargs or method not in (None, "max"):
            raise TypeError(f"{self._label()}.compute_amax takes no method or options, got {method!r} {sorted(kwargs)}")
        a = self._local_amax()
        if is_active():
            a = reduce_max(a, None, self._label())
        return a

    def reset(self) -> None:
        """Forget everything collected."""
        self._hist = None
        self._running_max = None
        self.num_collected = 0

    def __repr__(self) -> str:
        return (
            f"NVFP4ActHeadroomCalibrator(anchor_percentile={self._anchor_p}, upper_percentile={self._upper_p}, "
            f"rho={self._rho}, block_size={self._block_size})"
        )
