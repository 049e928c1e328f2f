"""ModelOpt's calibration entry points under their ``model_calib`` names (``mtq.model_calib.max_calibrate`` ...).

Each runs on a model already converted by :func:`modelopt_lite.quantize` (or ``replace_quant_modules`` plus a
``quant_cfg``), with ModelOpt's signature and defaults, through the same code as a config's ``"algorithm"``:

- ``max_calibrate(model, forward_loop=None, distributed_sync=True)``: every quantizer's own calibrator (ModelOpt's
  max calibration); without a loop, the weights alone;
- ``smoothquant(model, forward_loop, alpha=1.0)``, ``awq(model, forward_loop, algorithm="awq_lite", **kwargs)``,
  ``awq_lite`` / ``awq_clip`` (``awq_full`` is both), ``gptq(model, forward_loop, perc_damp=0.01, block_size=128)``:
  the registered algorithms, each followed by the max calibration as in ``quantize``; if one raises, the weights and
  quantizers are put back exactly;
- ``enable_stats_collection(model)`` / ``finish_stats_collection(model, method=None, **kwargs)``: the two halves
  of a calibration run by hand.

Parameters the registered algorithm does not take raise a QuantConfigError naming them, before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import algorithms  # noqa: F401  (registers the algorithms these entry points run)
from .calib.distributed import is_active
from .conversion.config import normalize_algorithm
from .conversion.model_quant import _run_algorithm, calibrate, calibrate_weights
from .conversion.state import ModuleSnapshot, snapshot_quantizers
from .conversion.utils import named_quantizers

ForwardLoop = Callable[[nn.Module], object]

__all__ = [
    "ForwardLoop",
    "awq",
    "awq_clip",
    "awq_lite",
    "enable_stats_collection",
    "finish_stats_collection",
    "gptq",
    "max_calibrate",
    "smoothquant",
]


def max_calibrate(model: nn.Module, forward_loop: ForwardLoop | None = None, distributed_sync: bool = True):
    """ModelOpt's max calibration: each quantizer's own calibrator over ``forward_loop(model)`` (None: the weight
    quantizers on their weights, activation quantizers left dynamic). Returns the model.

    ``distributed_sync``: the calibrators reduce their statistics across ranks whenever ``torch.distributed`` is
    initialized with several ranks; ``False`` cannot be honoured there and raises ValueError.
    """
    if not isinstance(distributed_sync, bool):
        raise TypeError(f"max_calibrate: distributed_sync must be a bool, got {distributed_sync!r}")
    if not distributed_sync and is_active():
        raise ValueError("max_calibrate: distributed_sync=False cannot be honoured: calibration always syncs ranks")
    if forward_loop is None:
        return calibrate_weights(model, None)
    return calibrate(model, None, forward_loop)


def _algorithm(model: nn.Module, method: str, forward_loop, params: dict) -> nn.Module:
    if not callable(forward_loop):
        raise TypeError(f"{method}: forward_loop must be a callable taking the model, got {forward_loop!r}")
    normalized = normalize_algorithm({"method": method, **params})  # QuantConfigError before anything runs
    assert normalized is not None
    name, checked = normalized
    weights = ModuleSnapshot(m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    quantizers = snapshot_quantizers(q for _, q in named_quantizers(model))
    try:
        _run_algorithm(model, name, checked, forward_loop)
    except BaseException:
        weights.restore()
        quantizers.restore()
        raise
    return model


def smoothquant(model: nn.Module, forward_loop: ForwardLoop | None = None, alpha: float = 1.0) -> nn.Module:
    """SmoothQuant with migration strength ``alpha`` (ModelOpt's default 1.0), then max calibration."""
    return _algorithm(model, "smoothquant", forward_loop, {"alpha": alpha})


def awq(model: nn.Module, forward_loop: ForwardLoop | None = None, algorithm: str = "awq_lite", **kwargs):
    """AWQ: ``algorithm`` is ``"awq_lite"`` (scale search), ``"awq_clip"`` (clip search) or ``"awq_full"``."""
    if algorithm not in ("awq_lite", "awq_clip", "awq_full"):
        raise ValueError(f"awq: algorithm must be 'awq_lite', 'awq_clip' or 'awq_full', got {algorithm!r}")
    return _algorithm(model, algorithm, forward_loop, kwargs)


def awq_lite(model: nn.Module, forward_loop: ForwardLoop, **kwargs) -> nn.Module:
    """AWQ's per-channel scale search (ModelOpt's ``awq_lite``)."""
    return _algorithm(model, "awq_lite", forward_loop, kwargs)


def awq_clip(model: nn.Module, forward_loop: ForwardLoop, **kwargs) -> nn.Module:
    """AWQ's weight clipping search (ModelOpt's ``awq_clip``)."""
    return _algorithm(model, "awq_clip", forward_loop, kwargs)


def gptq(model: nn.Module, forward_loop: ForwardLoop, perc_damp: float = 0.01, block_size: int = 128, **kwargs):
    """GPTQ weight refitting (ModelOpt's defaults), then max calibration."""
    return _algorithm(model, "gptq", forward_loop, {"perc_damp": perc_damp, "block_size": block_size, **kwargs})


def enable_stats_collection(model: nn.Module) -> None:
    """Switch every enabled, static quantizer to collecting (quantization off), as ModelOpt's helper does."""
    for _, q in named_quantizers(model):
        if q.is_enabled and not q.quant_desc.dynamic and q.quant_desc.amax is None:
            q.disable_quant()
            q.enable_calib()


def finish_stats_collection(model: nn.Module, method: str | None = None, **kwargs) -> None:
    """Load every collecting quantizer's amax (``method``/``kwargs`` go to ``load_calib_amax``) and switch it back
    to quantizing; a quantizer that saw no data keeps its amax (a warning names it)."""
    for _, q in named_quantizers(model):
        if q.is_calib_enabled:
            q.load_calib_amax(method, strict=False, **kwargs)
            q.disable_calib()
            q.enable_quant()
