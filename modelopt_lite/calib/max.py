"""``MaxCalibrator``: amax = the running max of ``|x|``, per tensor or per channel."""

from __future__ import annotations

from typing import ClassVar

import torch

from . import distributed
from .calibrator import Calibrator


class MaxCalibrator(Calibrator):
    """Running max of ``|x|`` (per tensor, or per kept ``axis``).

    Args:
        num_bits, axis, unsigned, skip_nonfinite, name, group, sync_ranks: see :class:`Calibrator`.
        track_amax: also keep every batch's amax (see :attr:`amaxs`).

    ``compute_amax()`` (``method`` may be None or ``"max"``; no keyword arguments) returns a float32 tensor on the
    data's device, shape ``()`` per tensor or keepdims per channel, or None before any data. With
    ``torch.distributed`` initialized it is the max over all ranks (``all_reduce(MAX)``). A batch whose per-channel
    amax shape differs from the previous ones raises ValueError naming both shapes.

    Example::

        cal = MaxCalibrator(8, axis=0)
        for w in batches:
            cal.collect(w)
        amax = cal.compute_amax()   # shape (C, 1, ...) float32
    """

    _METHODS: ClassVar[dict[str, dict]] = {"max": {}}
    _DEFAULT_METHOD = "max"

    def __init__(
        self,
        num_bits=8,
        axis=None,
        unsigned=False,
        track_amax=False,
        *,
        skip_nonfinite=False,
        name=None,
        group=None,
        sync_ranks=True,
    ):
        super().__init__(
            num_bits, axis, unsigned, skip_nonfinite=skip_nonfinite, name=name, group=group, sync_ranks=sync_ranks
        )
        if not isinstance(track_amax, bool):
            raise TypeError(f"track_amax must be a bool, got {track_amax!r}")
        self._track_amax = track_amax
        self._amax = None
        self._amaxs: list[torch.Tensor] = []

    def reset(self):
        """Forget the running max, the tracked amaxs, the shapes and ``num_nonfinite``."""
        super().reset()
        self._amax = None
        self._amaxs = []

    @property
    def _calib_amax(self) -> torch.Tensor | None:
        """The running max on this rank (the peers' attribute, which subclasses overriding ``compute_amax`` read)."""
        return self._amax

    @property
    def amaxs(self) -> list[torch.Tensor]:
        """Per-batch amax tensors (float32, the public amax shape), when ``track_amax=True``; else an empty list."""
        return list(self._amaxs)

    def collect(self, x: torch.Tensor) -> None:
        """Update the running max with one batch (the tensor is not modified)."""
        prep = self._prepare(x)
        if prep is None:
            return
        local = self._shape_amax(prep.row_max)
        if self._track_amax:
            self._amaxs.append(local.clone())
        self._amax = local if self._amax is None else torch.maximum(self._amax, local)

    def compute_amax(self, method=None, **kwargs):
        """The max of ``|x|`` over everything collected (and over all ranks when distributed), or None."""
        self._check_kwargs(method, kwargs)
        amax = self._amax
        if self.sync_ranks and distributed.is_active(self.group):
            amax = distributed.reduce_max(amax, self.group, self._label())
        return None if amax is None else amax.clone()

    def _repr_fields(self) -> str:
        if self._amax is None:
            state = "amax=None"
        elif self._amax.numel() == 1:
            state = f"amax={float(self._amax):.6g}"
        else:
            state = f"amax=[{float(self._amax.min()):.6g}, {float(self._amax.max()):.6g}] (min, max)"
        return f"{super()._repr_fields()}, track_amax={self._track_amax}, {state}"
