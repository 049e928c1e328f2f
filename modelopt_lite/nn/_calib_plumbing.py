"""Calibration plumbing for :class:`~modelopt_lite.nn.TensorQuantizer`: which collector a quantizer uses.

- per tensor / per channel: :class:`modelopt_lite.calib.MaxCalibrator` or
  :class:`modelopt_lite.calib.HistogramCalibrator`, chosen by the descriptor's ``calib_method``;
- static blocks: :class:`BlockMaxCollector`, a running per-block max |x| (the block amax has the shape
  "blocks per axis", see :mod:`modelopt_lite.functional.blocks`);
- dynamic quantizers: no collector (their amax is recomputed from every input).

Temporal quantizers (``num_steps > 1``) hold one collector per step.
"""

from __future__ import annotations

import torch

from ..functional import blocks


class BlockMaxCollector:
    """Running max |x| of every block over the calibration batches (static block quantization).

    It follows the calibrator interface (``collect``, ``reset``, ``compute_amax``) so the quantizer treats it like
    :class:`~modelopt_lite.calib.MaxCalibrator`. The input shape must stay the same across batches.
    """

    def __init__(self, block_sizes: dict, name: str | None = None):
        self._block_sizes = dict(block_sizes)
        self.name = name
        self._amax: torch.Tensor | None = None

    def collect(self, x: torch.Tensor) -> None:
        """Fold the per-block max |x| of one batch into the running max."""
        a = blocks.block_amax(x, self._block_sizes)
        if self._amax is None:
            self._amax = a.clone()
            return
        if a.shape != self._amax.shape:
            from ..calib.calibrator import AmaxShapeChangedError

            raise AmaxShapeChangedError(
                f"block amax shape changed! from {tuple(self._amax.shape)} to {tuple(a.shape)} "
                f"(input shape {tuple(x.shape)}); static block quantization needs a fixed input shape"
            )
        self._amax = torch.maximum(self._amax, a.to(self._amax.device))

    def reset(self) -> None:
        """Forget everything collected."""
        self._amax = None

    def compute_amax(self, method=None, **kwargs):
        """The per-block amax (float32, blocks per axis), or None before any data."""
        if kwargs:
            raise TypeError(f"BlockMaxCollector.compute_amax takes no keyword arguments, got {sorted(kwargs)}")
        if method not in (None, "max"):
            raise ValueError(f"block calibration supports method None or 'max', got {method!r}")
        return None if self._amax is None else self._amax.clone()

    def __repr__(self):
        return f"BlockMaxCollector(block_sizes={self._block_sizes})"


def make_calibrator(desc, name: str | None = None, factory: tuple | None = None):
    """A fresh collector for a descriptor (None for dynamic quantizers); ``factory``: a user calibrator
    ``(cls, args, kwargs)`` (ModelOpt's ``calibrator`` attribute) built as ``cls(*args, **kwargs)``."""
    if desc.dynamic:
        return None
    if factory is not None:
        cls, args, kwargs = factory
        return cls(*args, **kwargs)
    if desc.per_block_amax:  # static blocks, static NVFP4 (dynamic NVFP4 calibrates a per-tensor global amax)
        return BlockMaxCollector(desc.block_sizes, name=name)
    # imported lazily: most quantizers never calibrate in a given process
    from .. import calib

    if desc.calib_method == "histogram":
        return calib.HistogramCalibrator(num_bits=desc.num_bits, axis=desc.axis, unsigned=desc.unsigned, name=name)
    return calib.MaxCalibrator(num_bits=desc.num_bits, axis=desc.axis, unsigned=desc.unsigned, name=name)


def compute_step_amaxes(calibrators, method, kwargs) -> list:
    """``compute_amax`` of every step's collector (None entries where a collector saw no data)."""
    out = []
    for cal in calibrators:
        out.append(cal.compute_amax(**kwargs) if method is None else cal.compute_amax(method, **kwargs))
    return out
