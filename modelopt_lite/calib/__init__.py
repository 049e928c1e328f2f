"""Calibrators: statistics of the tensors a quantizer sees, turned into ``amax``.

- :class:`MaxCalibrator`: running max of ``|x|`` (per tensor or per channel).
- :class:`HistogramCalibrator`: exact int64 histograms on a power-of-two grid (batch-split and rank invariant);
  amax by ``"percentile"``, ``"mse"`` or ``"entropy"`` (vectorized sweeps).
- :class:`MseCalibrator`: ModelOpt's search of ``amax * m`` scored by a caller's quantization function.
- :func:`calibrate_weights`: set every weight quantizer's amax from the weights themselves.

Every calibrator has the same interface: ``collect(x)``, ``reset()``, ``compute_amax(method=None, **kwargs)``
(float32 amax on the data's device, or None before any data) and, with ``torch.distributed`` initialized,
reduces across ranks so each rank gets the amax of all ranks' data.
"""

from .calibrator import Calibrator
from .histogram import HistogramCalibrator
from .max import MaxCalibrator
from .mse_search import MseCalibrator
from .weights import calibrate_weights

__all__ = ["Calibrator", "HistogramCalibrator", "MaxCalibrator", "MseCalibrator", "calibrate_weights"]
