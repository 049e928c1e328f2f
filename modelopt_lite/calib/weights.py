"""``calibrate_weights``: set each weight quantizer's amax from the weights it quantizes."""

from __future__ import annotations

import logging
import warnings

import torch

from .histogram import HistogramCalibrator
from .max import MaxCalibrator

logger = logging.getLogger(__name__)

_METHODS = ("max", "percentile", "mse", "entropy")


def _set_amax(quantizer, amax: torch.Tensor, where: str) -> None:
    load = getattr(quantizer, "load_amax", None)
    if callable(load):
        load(amax)
        return
    try:
        quantizer.amax = amax
    except AttributeError as e:
        raise TypeError(f"{where}: the weight_quantizer has neither load_amax() nor a settable amax") from e


@torch.no_grad()
def calibrate_weights(
    model: torch.nn.Module,
    method: str = "percentile",
    perchannel: bool = True,
    percentile: float = 99.99,
    num_bins: int = 2048,
    start_bin: int = 128,
    stride: int = 1,
) -> dict[str, torch.Tensor]:
    """Calibrate every ``weight_quantizer`` of ``model`` on its module's ``weight``; returns ``{name: amax}``.

    A module qualifies when it has a ``weight`` tensor and a ``weight_quantizer`` exposing ``axis``, ``num_bits``
    and ``unsigned`` (and ``narrow_range``), plus ``load_amax(amax)`` or a settable ``amax``.

    Args:
        model: the module tree to walk.
        method: ``"max"``, ``"percentile"``, ``"mse"`` or ``"entropy"`` (see :class:`HistogramCalibrator`).
        perchannel: one amax per channel along the quantizer's ``axis`` (keepdims shape); False (or a quantizer
            with ``axis=None``) gives one amax per tensor (shape ``()``).
        percentile: for ``"percentile"``.
        num_bins: bins of the weight histograms (per tensor and per channel alike).
        start_bin, stride: for ``"mse"`` and ``"entropy"``.

    Dynamic quantizers (``dynamic=True``) are skipped; quantizers with block sizes are skipped with a warning
    (their amax is per block, not per channel). Weights are the same on every rank: no cross-rank reduction.
    """
    if method not in _METHODS:
        raise ValueError(f"calibrate_weights: method must be one of {_METHODS}, got {method!r}")
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        q, merged = getattr(module, "weight_quantizer", None), getattr(module, "quantizer_weight", None)
        w = merged() if callable(merged) else getattr(module, "weight", None)  # a LoRA layer quantizes W + delta
        if q is None or not isinstance(w, torch.Tensor):
            continue
        where = f"calibrate_weights: {name or type(module).__name__}.weight_quantizer"
        missing = [a for a in ("axis", "num_bits", "unsigned") if not hasattr(q, a)]
        if missing:
            raise TypeError(f"{where} lacks attribute(s) {missing}")
        if getattr(q, "dynamic", False) is True:  # amax recomputed per forward: nothing to calibrate
            continue
        if getattr(q, "block_sizes", None):
            warnings.warn(f"{where} uses block_sizes; calibrate_weights does not handle blocks, skipped", stacklevel=2)
            continue
        axis = q.axis if perchannel else None
        label = f"{name}.weight_quantizer" if name else "weight_quantizer"
        if method == "max":
            cal: MaxCalibrator | HistogramCalibrator
            cal = MaxCalibrator(q.num_bits, axis, q.unsigned, name=label, sync_ranks=False)
            kwargs: dict[str, float] = {}
        else:
            cal = HistogramCalibrator(q.num_bits, axis, q.unsigned, num_bins=num_bins, name=label, sync_ranks=False)
            kwargs = (
                {"percentile": percentile} if method == "percentile" else {"start_bin": start_bin, "stride": stride}
            )
        cal.collect(w)
        amax = cal.compute_amax(method, **kwargs)
        if amax is None:  # an empty weight
            continue
        _set_amax(q, amax, where)
        out[name] = amax
        logger.info("calibrate_weights: %s amax (%s) shape %s", label, method, tuple(amax.shape))
    return out
