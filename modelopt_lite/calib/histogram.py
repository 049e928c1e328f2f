"""``HistogramCalibrator``: int64 histograms of ``|x|`` on a power-of-two grid; amax by percentile, mse or entropy.

Design (see ``grid.py``): the bin width is ``2**e`` with ``e`` the smallest exponent for which ``num_bins`` bins
cover the largest ``|x|`` seen so far. A batch with a larger max raises ``e`` and the existing counts are merged
``2**k`` bins at a time, an exact integer operation. So the histogram (and every amax computed from it) depends
only on the multiset of values: any split into batches, any order, any number of ranks gives identical counts.
The occupied part of the histogram spans between ``num_bins / 2`` and ``num_bins`` bins (pytorch-quantization
spans ``num_bins`` bins over the *first* batch's range, and more after growth, so its result depends on the
batch order). Counts are int64 on the data's device: no float32 saturation at 2**24.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from . import distributed, methods
from .calibrator import Calibrator
from .grid import E_MIN, histogram_rows, needed_exp, regrid, widths
from .mse import mse_amax

_METHOD_ARGS: dict[str, dict] = {
    "percentile": {"percentile": 99.99},
    "mse": {"start_bin": 128, "stride": 1},
    "entropy": {"start_bin": 128, "stride": 1},
}


#: accepted for pytorch-quantization compatibility; they all mean the same here (see the class docstring)
_GROW_METHODS = (None, "stretch", "append")
#: the keywords of pytorch-quantization's ``compute_amax(method, *, stride, start_bin, percentile)``
_PEER_KWARGS = ("stride", "start_bin", "percentile")


def _check_int(what: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{what} must be an int, got {v!r}")
    if v < lo:
        raise ValueError(f"{what} must be >= {lo}, got {v}")
    return v


class HistogramCalibrator(Calibrator):
    """Histogram of ``|x|`` (``x`` for unsigned, which must then be non-negative), per tensor or per channel.

    Args:
        num_bits, axis, unsigned, skip_nonfinite, name, group, sync_ranks: see :class:`Calibrator`.
        num_bins: bins of the grid (>= 2): the occupied histogram spans ``num_bins/2 .. num_bins`` of them.
        grow_method: None, ``"stretch"`` or ``"append"``, accepted for compatibility with pytorch-quantization
            (deprecated there and ignored): the histogram here always grows by merging bins on its power-of-two
            grid, which is exact, so the two old strategies give the same counts. Anything else: ValueError.
        skip_zeros: leave exact zeros out of the histogram (e.g. after ReLU).
        torch_hist: accepted for compatibility (pytorch-quantization's choice between ``torch.histc`` and
            ``np.histogram``); the int64 counts here are exact either way, so it changes nothing.

    The positional order ``(num_bits, axis, unsigned, num_bins, grow_method, skip_zeros, torch_hist)`` is the
    peers'; ``skip_nonfinite``, ``name``, ``group`` and ``sync_ranks`` are keyword-only.

    ``compute_amax(method=None, *, stride=1, start_bin=128, percentile=99.99)`` (the peers' signature; ``method``
    None means ``"percentile"``). As in the peers, every method accepts all three keywords and ignores the ones it
    does not use; any other keyword raises TypeError.

    - ``"percentile"``, ``percentile=99.99`` (0 < p <= 100): the left edge of the bin where the cumulative
      count reaches p %, so the inverted-CDF quantile lies in ``[amax, amax + bin_width)``.
    - ``"mse"``, ``start_bin=128, stride=1``: the bin center minimizing the expected squared
      fake-quantization error (project numerics; E4M3 uses the E4M3 formula); first minimum.
    - ``"entropy"``, ``start_bin=128, stride=1``: TensorRT's KL-divergence search; last minimum; integer
      formats only (ValueError for E4M3).

    An unknown method raises :class:`~modelopt_lite.calib.calibrator.UnknownMethodError` (a ValueError and a
    TypeError). Returns a float32 tensor on the data's device,
    shape ``()`` or keepdims per channel, or None before any data. With ``torch.distributed`` initialized, the
    ranks' histograms are merged first (exactly; see ``distributed.py``). All three methods work per channel.

    Example::

        cal = HistogramCalibrator(8, num_bins=2048)
        for x in batches:
            cal.collect(x)
        amax = cal.compute_amax("percentile", percentile=99.9)
    """

    _METHODS: ClassVar[dict[str, dict]] = _METHOD_ARGS
    _DEFAULT_METHOD = "percentile"

    def __init__(
        self,
        num_bits=8,
        axis=None,
        unsigned=False,
        num_bins=2048,
        grow_method=None,
        skip_zeros=False,
        torch_hist=True,
        *,
        skip_nonfinite=False,
        name=None,
        group=None,
        sync_ranks=True,
    ):
        super().__init__(
            num_bits, axis, unsigned, skip_nonfinite=skip_nonfinite, name=name, group=group, sync_ranks=sync_ranks
        )
        self._num_bins = _check_int("num_bins", num_bins, 2)
        if grow_method not in _GROW_METHODS:
            raise ValueError(
                f"grow_method={grow_method!r} is not supported: pass None, 'stretch' or 'append' (all three "
                "grow the same way here: by merging bins on the power-of-two grid)"
            )
        if not isinstance(skip_zeros, bool):
            raise TypeError(f"skip_zeros must be a bool, got {skip_zeros!r}")
        if not isinstance(torch_hist, bool):
            raise TypeError(f"torch_hist must be a bool, got {torch_hist!r}")
        self._grow_method = grow_method
        self._torch_hist = torch_hist
        self._skip_zeros = skip_zeros
        self._counts = None  # int64 (rows, num_bins)
        self._exp = None  # int64 (rows,)
        self._n_collected = 0

    # ----------------------------------------------------------------------------------------------------------
    @property
    def num_bins(self) -> int:
        """Number of bins of the grid."""
        return self._num_bins

    @property
    def skip_zeros(self) -> bool:
        """Whether exact zeros are left out."""
        return self._skip_zeros

    @property
    def num_collected(self) -> int:
        """Number of values in the histogram (after skipped zeros / non-finite values)."""
        return self._n_collected

    @property
    def counts(self) -> torch.Tensor | None:
        """A copy of the int64 counts: ``(num_bins,)`` per tensor, ``(channels, num_bins)`` per channel."""
        if self._counts is None:
            return None
        return self._counts[0].clone() if self._axis is None else self._counts.clone()

    @property
    def bin_width(self):
        """Bin width: a float per tensor, a float64 tensor ``(channels,)`` per channel (None before data)."""
        if self._exp is None:
            return None
        w = widths(self._exp)
        return float(w[0]) if self._axis is None else w

    # pytorch-quantization's public histogram attributes (its users and tests read them)
    @property
    def _calib_hist(self):
        """The counts (int64): ``(num_bins,)`` per tensor, ``(channels, num_bins)`` per channel; a torch tensor, or
        a NumPy array with ``torch_hist=False`` (as pytorch-quantization's); None before data. A copy."""
        c = self.counts
        return c if c is None or self._torch_hist else c.cpu().numpy()

    @property
    def _calib_bin_edges(self):
        """The ``num_bins + 1`` bin edges (float32, from 0; per channel one row each) of :attr:`_calib_hist`, same
        container rule. The grid's bin width is a power of two (the peers' last edge is the max seen instead)."""
        if self._exp is None:
            return None
        steps = torch.arange(self._num_bins + 1, dtype=torch.float64, device=self._exp.device)
        edges = (steps[None, :] * widths(self._exp).to(self._exp.device)[:, None]).float()
        edges = edges[0] if self._axis is None else edges
        return edges if self._torch_hist else edges.cpu().numpy()

    def reset(self):
        """Forget the histogram, the shapes and ``num_nonfinite``."""
        super().reset()
        self._counts = None
        self._exp = None
        self._n_collected = 0

    # ----------------------------------------------------------------------------------------------------------
    def collect(self, x: torch.Tensor) -> None:
        """Add one batch to the histogram (the tensor is not modified), growing the range when needed."""
        prep = self._prepare(x, skip_zeros=self._skip_zeros)
        if prep is None:
            return
        a, cap = prep.rows, self._num_bins
        need = needed_exp(prep.row_max, cap)
        old_counts, old_exp = self._counts, self._exp
        if old_counts is None or old_exp is None:
            old_counts = torch.zeros(a.shape[0], cap, dtype=torch.int64, device=a.device)
            old_exp = torch.full((a.shape[0],), E_MIN, dtype=torch.int64, device=a.device)
        new_exp = torch.maximum(old_exp, need)
        self._counts = regrid(old_counts, old_exp, new_exp)
        self._exp = new_exp
        counts = histogram_rows(a, new_exp, cap, inplace=True)
        n_new = a.numel()
        if prep.dropped is not None:
            counts[:, 0] -= prep.dropped  # dropped values sit in bin 0 as zeros
            n_new -= int(prep.dropped.sum())
        self._counts += counts
        self._n_collected += n_new

    def _merged(self):
        """(counts, exp, amax shape) of all ranks (never modifies the live state), or None."""
        if self.sync_ranks and distributed.is_active(self.group):
            layout = None if self._counts is None else (*self._counts.shape, self._amax_shape)
            merged = distributed.merge_histograms(self._counts, self._exp, layout, self.group, self._label())
            return None if merged is None else (merged[0], merged[1], merged[2][2])
        if self._counts is None:
            return None
        return self._counts, self._exp, self._amax_shape

    def compute_amax(self, method=None, *, stride=1, start_bin=128, percentile=99.99, **kwargs):
        """amax from the histogram with ``method`` (``"percentile"`` (default), ``"mse"`` or ``"entropy"``)."""
        if kwargs:
            raise TypeError(
                f"{self._label()}.compute_amax(method={method!r}) got unexpected keyword argument(s) "
                f"{', '.join(sorted(kwargs))}; it accepts {', '.join(_PEER_KWARGS)}"
            )
        method = self._check_kwargs(method, {})[0]
        args: dict = {"stride": stride, "start_bin": start_bin, "percentile": percentile}
        what = f"{self._label()}.compute_amax({method!r})"
        if method == "percentile":
            p = args["percentile"]
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise TypeError(f"{what}: percentile must be a number, got {p!r}")
            if math.isnan(p) or not 0 < p <= 100:
                raise ValueError(f"{what}: percentile {p!r} is out of range: it must be in (0, 100]")
        else:
            _check_int(f"{what}: start_bin", args["start_bin"], 0)
            _check_int(f"{what}: stride", args["stride"], 1)
            if method == "entropy":
                methods.check_entropy_args(self._num_bits, args["start_bin"], what)
        merged = self._merged()
        if merged is None:
            return None
        counts, exp, amax_shape = merged
        if method == "percentile":
            amax = methods.percentile_amax(counts, exp, float(args["percentile"]))
        elif method == "mse":
            amax = mse_amax(counts, exp, args["start_bin"], args["stride"], self._num_bits, self._unsigned, what)
        else:
            amax = methods.entropy_amax(
                counts, exp, args["start_bin"], args["stride"], self._num_bits, self._unsigned, what
            )
        return self._shape_amax(amax, amax_shape)

    def _repr_fields(self) -> str:
        state = f"collected={self._n_collected}"
        if self._exp is not None and self._axis is None:
            state += f", bin_width=2**{int(self._exp[0])}"
        return (
            f"{super()._repr_fields()}, num_bins={self._num_bins}, skip_zeros={self._skip_zeros}, "
            f"skip_nonfinite={self._skip_nonfinite}, {state}"
        )
