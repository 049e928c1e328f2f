"""``Calibrator``: the base class every calibrator shares (argument checks, input preparation, axes, errors).

A calibrator watches tensors (``collect``), keeps statistics, and turns them into an ``amax``
(``compute_amax``): a float32 tensor on the data's device, shape ``()`` per tensor, or the input's rank with
size 1 on the reduced dimensions when ``axis`` names the dimensions to keep (per channel).

Input handling is common to all calibrators and done here:

- the input is never modified; it is detached and read as float32 (float64 stays float64, integers are read as
  float64);
- NaN/Inf raise ``ValueError`` naming the calibrator and the number of NaN and Inf values, unless
  ``skip_nonfinite=True``, in which case they are left out and counted in ``num_nonfinite``;
- ``unsigned=True`` requires non-negative data (``ValueError`` with the minimum otherwise);
- ``axis`` (int or tuple, negative allowed) is checked against the rank on the first ``collect``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..formats import element_format, int_range
from ..functional.checks import check_axes

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class UnknownMethodError(ValueError, TypeError):
    """``compute_amax`` got a method the calibrator does not have.

    A ValueError here; also a TypeError, which is what pytorch-quantization and ModelOpt raise for an unknown
    method, so code written against them catches it unchanged.
    """


class AmaxShapeChangedError(RuntimeError, ValueError):
    """A batch's per-channel amax shape differs from the earlier batches' ("amax shape changed!").

    A RuntimeError, as pytorch-quantization's and ModelOpt's ``MaxCalibrator`` raise, and a ValueError (bad input).
    """


def check_num_bits(num_bits):
    """Validate ``num_bits``: an int (an integer grid) or an ``(E, M)`` element format. Returns it normalized."""
    if isinstance(num_bits, (tuple, list)):
        return element_format(tuple(num_bits)).num_bits  # ValueError naming the supported formats
    int_range(num_bits)  # raises TypeError / ValueError with a clear message
    return num_bits


def _check_axis_arg(axis):
    if axis is None:
        return None
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    if len(items) == 0 or not all(isinstance(a, int) and not isinstance(a, bool) for a in items):
        raise TypeError(f"axis must be None, an int or a non-empty tuple of ints, got {axis!r}")
    return tuple(items) if isinstance(axis, (tuple, list)) else axis


class Prepared:
    """One batch, ready for statistics: ``rows`` is ``|x|`` as (channels, values) and what was left out.

    ``rows`` has non-finite values replaced by 0 when they are skipped; ``dropped`` (int64 per channel, or None)
    counts the values that sit in ``rows`` as zeros but must not be counted (skipped non-finite values, and exact
    zeros under ``skip_zeros``); ``row_max`` is the per-channel max of the kept values (float, on the device).
    """

    __slots__ = ("amax_shape", "dropped", "row_max", "rows")

    def __init__(self, rows, dropped, row_max, amax_shape):
        self.rows = rows
        self.dropped = dropped
        self.row_max = row_max
        self.amax_shape = amax_shape


class Calibrator:
    """Base class of the calibrators; see the module docstring for the shared contract.

    Args:
        num_bits: an int (integer grid) or ``(4, 3)`` for FP8 E4M3.
        axis: None (one amax per tensor) or the dimension(s) to keep (one amax per channel).
        unsigned: the quantizer is unsigned; negative data is an error.
        skip_nonfinite: leave NaN/Inf out (and count them in ``num_nonfinite``) instead of raising.
        name: a label used in error messages (TensorQuantizer sets it to the quantizer's name).
        group: the ``torch.distributed`` process group to reduce over in ``compute_amax`` (None: the default group).
        sync_ranks: when ``torch.distributed`` is initialized, reduce the statistics across ``group`` before
            computing amax, so every rank gets the amax of all ranks' data (default True). ``compute_amax`` is
            then a collective: every rank of the group must call it, for the same calibrators in the same order
            (a rank that collected nothing takes part with empty statistics).
    """

    _METHODS: ClassVar[dict[str, dict]] = {}
    _DEFAULT_METHOD: ClassVar[str] = ""

    def __init__(
        self, num_bits=8, axis=None, unsigned=False, *, skip_nonfinite=False, name=None, group=None, sync_ranks=True
    ):
        self._num_bits = check_num_bits(num_bits)
        self._axis = _check_axis_arg(axis)
        if not isinstance(unsigned, bool):
            raise TypeError(f"unsigned must be a bool, got {unsigned!r}")
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool, got {skip_nonfinite!r}")
        if unsigned and isinstance(self._num_bits, tuple):
            raise ValueError(f"unsigned=True is not supported with num_bits={self._num_bits} (it is signed)")
        self._unsigned = unsigned
        self._skip_nonfinite = skip_nonfinite
        self.name = name
        self.group = group
        self.sync_ranks = bool(sync_ranks)
        self.num_nonfinite = 0
        self._reset_shape()

    # ----------------------------------------------------------------------------------------------------------
    @property
    def num_bits(self):
        """``num_bits`` as given (an int or ``(4, 3)``)."""
        return self._num_bits

    @property
    def axis(self):
        """The kept dimension(s), or None for per-tensor statistics."""
        return self._axis

    @property
    def unsigned(self) -> bool:
        """Whether the data must be non-negative."""
        return self._unsigned

    @property
    def skip_nonfinite(self) -> bool:
        """Whether NaN/Inf are skipped (and counted) rather than rejected."""
        return self._skip_nonfinite

    def _label(self) -> str:
        return f"{type(self).__name__} {self.name!r}" if self.name is not None else type(self).__name__

    def _reset_shape(self):
        self._in_rank: int | None = None  # rank of the first batch (per-axis only)
        self._keep: tuple[int, ...] | None = None  # normalized kept dims
        self._amax_shape: tuple[int, ...] | None = None  # keepdims shape of amax
        self._device: torch.device | None = None

    def reset(self):
        """Forget everything collected (statistics, shapes, ``num_nonfinite``)."""
        self.num_nonfinite = 0
        self._reset_shape()

    # ----------------------------------------------------------------------------------------------------------
    def _check_kwargs(self, method, kwargs: dict):
        """Resolve ``method`` and fill defaults; unknown methods raise ValueError, unknown kwargs TypeError."""
        m = self._DEFAULT_METHOD if method is None else method
        if m not in self._METHODS:
            raise UnknownMethodError(
                f"{self._label()}: unknown method {method!r}; expected one of {sorted(self._METHODS)}"
            )
        allowed = self._METHODS[m]
        bad = sorted(set(kwargs) - set(allowed))
        if bad:
            ok = ", ".join(sorted(allowed)) or "no keyword arguments"
            raise TypeError(
                f"{self._label()}.compute_amax(method={m!r}) got unexpected keyword argument(s) "
                f"{', '.join(bad)}; it accepts {ok}"
            )
        return m, {**allowed, **kwargs}

    def _prepare(self, x, skip_zeros: bool = False) -> Prepared | None:
        """Validate one batch and return |x| as (channels, values) rows, or None for an empty tensor."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._label()}.collect expects a torch.Tensor, got {type(x).__name__}")
        if x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"{self._label()}.collect expects a real-valued tensor, got {x.dtype}")
        x = x.detach()
        if x.dtype not in _FLOAT_DTYPES:  # integer data: exact in float64
            x = x.to(torch.float64)
        amax_shape = self._check_shape(x)
        if self._device is not None and x.device != self._device:
            raise ValueError(f"{self._label()}: collected data on {self._device} before, got a tensor on {x.device}")
        if x.numel() == 0:
            return None
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        rows = self._to_rows(x)  # a view when possible; never written to
        lo, hi = torch.aminmax(rows)
        lo_v, hi_v = torch.stack([lo, hi]).tolist()
        finite_mask = None
        bad = 0
        if not (abs(lo_v) < float("inf") and abs(hi_v) < float("inf")):  # NaN or Inf somewhere
            finite_mask = torch.isfinite(rows)
            n_nan = int(torch.isnan(rows).sum())
            bad = rows.numel() - int(finite_mask.sum())
            if not self._skip_nonfinite:
                raise ValueError(
                    f"{self._label()}: input has {n_nan} NaN and {bad - n_nan} Inf value(s) "
                    f"(of {x.numel()}); pass skip_nonfinite=True to leave them out"
                )
            lo_v = float(torch.where(finite_mask, rows, torch.zeros_like(rows)).amin()) if bad < rows.numel() else 0
        if self._unsigned and lo_v < 0:
            raise ValueError(f"{self._label()}: unsigned calibration got negative values (minimum {lo_v!r})")
        a = rows.abs()
        if finite_mask is not None:
            a = torch.where(finite_mask, a, torch.zeros_like(a))
        dropped = None
        if finite_mask is not None:
            dropped = (~finite_mask).sum(dim=1)
        if skip_zeros:
            zeros = (rows == 0).sum(dim=1)
            dropped = zeros if dropped is None else dropped + zeros
        self.num_nonfinite += bad
        self._device = x.device
        if rows.shape[0] == 1 and finite_mask is None:  # per tensor: the max is known already
            row_max = torch.tensor([max(-lo_v, hi_v)], dtype=a.dtype, device=a.device)
        else:
            row_max = a.amax(dim=1)
        return Prepared(a, dropped, row_max, amax_shape)

    def _check_shape(self, x: torch.Tensor):
        """Normalize axis on the first batch; later batches must keep the same kept-dim sizes."""
        if self._axis is None:
            return ()
        if self._keep is None:
            keep = tuple(sorted(check_axes(self._axis, x.dim(), what=f"{self._label()} axis")))
            shape = tuple(x.shape[d] if d in keep else 1 for d in range(x.dim()))
            self._keep, self._in_rank, self._amax_shape = keep, x.dim(), shape
            return shape
        keep = self._keep
        now_shape = tuple(x.shape[d] if d in keep else 1 for d in range(x.dim())) if x.dim() == self._in_rank else None
        if now_shape != self._amax_shape:
            now = now_shape if now_shape is not None else f"(rank {x.dim()} instead of {self._in_rank})"
            raise AmaxShapeChangedError(
                f"{self._label()}: amax shape changed! {self._amax_shape} before, "
                f"{now} now (input shape {tuple(x.shape)}, axis={self._axis!r})"
            )
        return now_shape

    def _to_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self._axis is None:
            return x.reshape(1, -1)
        keep = self._keep
        if keep is None:
            raise RuntimeError(f"{self._label()}: the kept dims are set by the first collect()")
        rest = [d for d in range(x.dim()) if d not in keep]
        n_ch = 1
        for d in keep:
            n_ch *= x.shape[d]
        return x.permute(*keep, *rest).reshape(n_ch, -1)

    def _shape_amax(self, flat: torch.Tensor, shape=None) -> torch.Tensor:
        """(channels,) -> the public amax shape (``shape``, else the one seen in collect), float32."""
        flat = flat.to(torch.float32)
        if self._axis is None:
            return flat.reshape(())
        target = self._amax_shape if shape is None else shape
        if target is None:
            raise RuntimeError(f"{self._label()}: the amax shape is set by the first collect()")
        return flat.reshape(target)

    def _repr_fields(self) -> str:
        return f"name={self.name!r}, num_bits={self._num_bits!r}, axis={self._axis!r}, unsigned={self._unsigned}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._repr_fields()})"
