"""ModelOpt's calibration entry points under their ``model_calib`` names (``mtq.model_calib.max_calibrate`` ...).

Each runs on a model already converted by :func:`modelopt_lite.quantize` (or ``replace_quant_modules`` plus a
``quant_cfg``), with ModelOpt's signature and defaults, through the same code as a config's ``"algorithm"``:

- ``max_calibrate(model, forward_loop=None, distributed_sync=True)``: every quantizer's own calibrator (ModelOpt's
  max calibration); without a loop, the weights alone;
- ``smoothquant(model, forward_loop, alpha=1.0)``, ``awq(model, forward_loop, algorithm="awq_lite", **kwargs)``,
  ``awq_lite`` / ``awq_clip`` (``awq_full`` is both), ``gptq(model, forward_loop, perc_damp=0.01, block_size=128)``,
  ``svdquant(model, forward_loop, lowrank=32)``:
  the registered algorithms, each followed by the max calibration as in ``quantize``; if one raises, the weights and
  quantizers are put back exactly;
- ``mse_calibrate(model, forward_loop=None, distributed_sync=True, step_size=0.1, start_multiplier=0.25,
  stop_multiplier=4.0, fp8_scale_sweep=False, shared_states=None)``: max calibration, then each weight amax searched
  over ``amax * m`` for ModelOpt's multipliers (least squared weight error per amax element);
- ``local_hessian_calibrate(model, forward_loop=None, ..., fp8_scale_sweep=True, block_size=16, debug=False)``: the
  same search weighted by each Linear's per-block input Hessian (``fp8_scale_sweep=True``: static NVFP4 weights only);
- ``nvfp4_act_headroom_calibrate(model, forward_loop=None, *, anchor_percentile=1.0, upper_percentile=99.99,
  rho=16384.0, weight_scale_algorithm=None)``: NVFP4 activation global amaxes with headroom;
- ``layerwise_calibrate(model, forward_loop, calib_func, **calib_kwargs)``: ``calib_func`` decoder layer by decoder
  layer on the inputs each layer gets from the ones before;
- ``svd(weight, rank)``: ModelOpt's truncated SVD ``(U S, V^T)`` of SVDQuant;
- ``enable_stats_collection(model)`` / ``finish_stats_collection(model, method=None, **kwargs)``: the two halves
  of a calibration run by hand;
- ``weight_only_quantize(model)``: the weight quantizers calibrated (max) on the weights alone;
- ``disable_pre_quant_scale_and_resmooth(linear, delete_pre_quant_scale=False)`` /
  ``apply_pre_quant_scale_and_smooth(linear, pre_quant_scale=None)``: undo / redo SmoothQuant on one quantized
  Linear: the weight is rescaled, the ``pre_quant_scale`` removed (kept aside unless deleted) or set, and the weight
  and input amaxes recomputed with max from the weight and the per-channel input maxima SmoothQuant measured.

Parameters the registered algorithm does not take raise a QuantConfigError naming them, before anything runs.
``lsq(model, forward_loop, scale_algorithm=None, ...)`` runs the scale calibration, then LSQ mode (learnable
``amax_pre`` / ``amax_post``) on the static NVFP4 weight quantizers, as ModelOpt (a warning when there is none).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from . import algorithms  # noqa: F401  (registers the algorithms these entry points run)
from .algorithms import layerwise, weight_mse, weight_scale
from .algorithms import lsq as lsq_algorithm
from .algorithms.svdquant import check_rank as svdquant_rank
from .algorithms.svdquant import svd_factors
from .calib.distributed import is_active
from .conversion.config import normalize_algorithm
from .conversion.model_quant import _run_algorithm, calibrate, calibrate_weights
from .conversion.state import ModuleSnapshot, snapshot_quantizers
from .conversion.utils import named_quantizers
from .nn import TensorQuantizer

ForwardLoop = Callable[[nn.Module], object]
#: ModelOpt's type of a calibrator factory ``(initial amax, axis, quant_func) -> calibrator`` (its FP8-sweep
#: backend registry; kept as a name for type annotations)
CalibratorFactory = Callable[[torch.Tensor, "int | tuple | list | None", Callable], object]

__all__ = [
    "CalibratorFactory",
    "ForwardLoop",
    "awq",
    "awq_clip",
    "awq_lite",
    "enable_stats_collection",
    "finish_stats_collection",
    "apply_pre_quant_scale_and_smooth",
    "disable_pre_quant_scale_and_resmooth",
    "gptq",
    "layerwise_calibrate",
    "local_hessian_calibrate",
    "lsq",
    "max_calibrate",
    "mse_calibrate",
    "nvfp4_act_headroom_calibrate",
    "smoothquant",
    "svd",
    "svdquant",
    "weight_only_quantize",
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
    assert name is not None  # a method name in: a method name out
    weights = ModuleSnapshot(m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    quantizers = snapshot_quantizers(q for _, q in named_quantizers(model))
    try:
        _run_algorithm(model, name, checked, forward_loop)
    except BaseException:
        weights.restore()
        quantizers.restore()
        raise
    return model


def _sync_flag(what: str, distributed_sync) -> None:
    if not isinstance(distributed_sync, bool):
        raise TypeError(f"{what}: distributed_sync must be a bool, got {distributed_sync!r}")
    if not distributed_sync and is_active():
        raise ValueError(f"{what}: distributed_sync=False cannot be honoured: calibration always syncs ranks")


def _guarded(model: nn.Module, run: Callable[[], object]) -> nn.Module:
    """``run()``, with the weights and quantizers put back exactly if it raises."""
    weights = ModuleSnapshot(m for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    quantizers = snapshot_quantizers(q for _, q in named_quantizers(model))
    try:
        run()
    except BaseException:
        weights.restore()
        quantizers.restore()
        raise
    return model


def mse_calibrate(
    model: nn.Module,
    forward_loop: ForwardLoop | None = None,
    distributed_sync: bool = True,
    step_size: float = 0.1,
    start_multiplier: float = 0.25,
    stop_multiplier: float = 4.0,
    fp8_scale_sweep: bool = False,
    shared_states=None,
) -> nn.Module:
    """ModelOpt's ``mse_calibrate``: :func:`max_calibrate`, then each weight amax searched over ``amax * m`` for
    ModelOpt's multipliers ``m`` (smallest squared weight error per amax element; see
    :mod:`modelopt_lite.algorithms.weight_mse`). The config form is ``{"method": "mse", "step_size": ...}``."""
    params = {"step_size": step_size, "start_multiplier": start_multiplier, "stop_multiplier": stop_multiplier}
    params.update(fp8_scale_sweep=fp8_scale_sweep, shared_states=shared_states)
    _sync_flag("mse_calibrate", distributed_sync)
    if forward_loop is not None:
        return _algorithm(model, "weight_mse", forward_loop, params)
    normalize_algorithm({"method": "weight_mse", **params})  # QuantConfigError before anything runs

    def run() -> None:
        calibrate_weights(model, None)
        weight_mse.refine_weights(
            model, step_size, start_multiplier, stop_multiplier, fp8_scale_sweep=fp8_scale_sweep, what="mse_calibrate"
        )

    return _guarded(model, run)


def local_hessian_calibrate(
    model: nn.Module,
    forward_loop: ForwardLoop | None = None,
    distributed_sync: bool = True,
    step_size: float = 0.1,
    start_multiplier: float = 0.25,
    stop_multiplier: float = 4.0,
    fp8_scale_sweep: bool = True,
    block_size: int = 16,
    debug: bool = False,
    shared_states=None,
) -> nn.Module:
    """ModelOpt's ``local_hessian_calibrate``: :func:`max_calibrate`, a pass collecting each quantized Linear's
    per-block input Hessian (weight quantizers off), then the :func:`mse_calibrate` search with the error
    ``dW H dW^T`` (see :mod:`modelopt_lite.algorithms.local_hessian`). Without ``forward_loop`` nothing runs (a
    warning), as in ModelOpt; ``fp8_scale_sweep=True`` (ModelOpt's default) sweeps the E4M3 block scales of static
    NVFP4 weights and leaves every other weight at its max amax (a warning), ``False`` searches all by multiplier."""
    _sync_flag("local_hessian_calibrate", distributed_sync)
    if forward_loop is None:
        warnings.warn("local_hessian_calibrate: forward_loop must be provided; skipping local_hessian", stacklevel=2)
        return model
    params = {"step_size": step_size, "start_multiplier": start_multiplier, "stop_multiplier": stop_multiplier}
    params.update(fp8_scale_sweep=fp8_scale_sweep, block_size=block_size, debug=debug, shared_states=shared_states)
    return _algorithm(model, "local_hessian", forward_loop, params)


def nvfp4_act_headroom_calibrate(
    model: nn.Module,
    forward_loop: ForwardLoop | None = None,
    *,
    anchor_percentile: float = 1.0,
    upper_percentile: float = 99.99,
    rho: float = 16384.0,
    weight_scale_algorithm=None,
) -> nn.Module:
    """ModelOpt's ``nvfp4_act_headroom_calibrate``: every NVFP4 input quantizer's global amax set to
    ``max(rho * anchor, upper)`` from the distribution of its per-block amaxes (see
    :mod:`modelopt_lite.calib.nvfp4_headroom`), the weights by ``weight_scale_algorithm`` (default max; ``"mse"`` /
    ``"local_hessian"`` with their options). Without ``forward_loop`` the activations see no data: only the weights
    are calibrated (max or mse; local_hessian needs a loop and warns), as in ModelOpt."""
    params = {"anchor_percentile": anchor_percentile, "upper_percentile": upper_percentile, "rho": rho}
    params["weight_scale_algorithm"] = weight_scale_algorithm
    if forward_loop is not None:
        return _algorithm(model, "nvfp4_act_headroom", forward_loop, params)
    normalize_algorithm({"method": "nvfp4_act_headroom", **params})  # QuantConfigError before anything runs
    method, opts = weight_scale.weight_algorithm(weight_scale_algorithm)
    if method == "mse":
        return mse_calibrate(model, None, **opts)
    if method == "local_hessian":
        return local_hessian_calibrate(model, None, **opts)
    return max_calibrate(model, None, **opts)


def layerwise_calibrate(model: nn.Module, forward_loop: ForwardLoop, calib_func: Callable, **calib_kwargs):
    """ModelOpt's ``layerwise_calibrate``: ``calib_func(layer, layer_loop, **calib_kwargs)`` for each decoder layer
    in turn, ``layer_loop`` replaying the inputs that layer gets from the layers before it (see
    :mod:`modelopt_lite.algorithms.layerwise`; ``get_qdq_activations_from_prev_layer=True``: through the calibrated,
    quantized layers). ``calib_func`` is any entry point of this module (``max_calibrate``, ``gptq``,
    ``mse_calibrate``, ...). The weights and quantizers are put back exactly if it raises."""
    if not callable(calib_func):
        raise TypeError(f"layerwise_calibrate: calib_func must be callable, got {calib_func!r}")
    return _guarded(model, lambda: layerwise.layerwise(model, forward_loop, calib_func, **calib_kwargs))


def lsq(
    model: nn.Module,
    forward_loop: ForwardLoop | None = None,
    scale_algorithm: dict | None = None,
    learnable_amax=("post",),
    tied_amax: bool = False,
    quantize_pre_scale: bool = True,
) -> nn.Module:
    """ModelOpt's ``lsq``: ``scale_algorithm`` (default ``{"method": "mse"}``), then LSQ mode (learnable
    ``amax_pre`` / ``amax_post``) for the static NVFP4 weight quantizers; a warning when there is none (see
    :mod:`modelopt_lite.algorithms.lsq`)."""
    params = {"scale_algorithm": scale_algorithm, "learnable_amax": learnable_amax, "tied_amax": tied_amax}
    params["quantize_pre_scale"] = quantize_pre_scale
    if forward_loop is not None:
        return _algorithm(model, "lsq", forward_loop, params)
    normalize_algorithm({"method": "lsq", **params})  # QuantConfigError before anything runs
    method, opts = weight_scale.weight_algorithm(scale_algorithm or {"method": "mse"}, "scale_algorithm")
    calibs: dict[str, Callable[..., nn.Module]] = {
        "mse": mse_calibrate,
        "local_hessian": local_hessian_calibrate,
        "max": max_calibrate,
    }
    calibs[method](model, None, **opts)
    lsq_algorithm.convert(model, learnable_amax, tied_amax, quantize_pre_scale)
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


def svdquant(model: nn.Module, forward_loop: ForwardLoop, lowrank: int = 32, **kwargs) -> nn.Module:
    """ModelOpt's ``svdquant``: awq_lite, then a rank-``lowrank`` float branch per Linear and the residual quantized
    (see :mod:`modelopt_lite.algorithms.svdquant`)."""
    return _algorithm(model, "svdquant", forward_loop, {"lowrank": lowrank, **kwargs})


def svd(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's ``svd``: ``(us, vt)`` with ``us @ vt`` the best rank-``rank`` approximation of the 2-D ``weight``
    (``us = U[:, :r] * S[:r]`` ``(out, r)``, ``vt = V^T[:r]`` ``(r, in)``; computed in float64, returned in the
    weight's dtype and device). A ``rank`` above ``min(weight.shape)`` pads both with zeros (a warning), as ModelOpt
    does; a non-finite or non-2-D weight or ``rank < 1`` raises ValueError."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"svd: weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"svd: weight must be 2-D, got shape {tuple(weight.shape)}")
    r = svdquant_rank(rank, "svd")
    full = min(weight.shape)
    vt, us = svd_factors(weight, min(r, full), "svd weight")
    if r > full:
        warnings.warn(
            f"svd: rank {r} exceeds min(weight.shape) = {full}; the factors are padded with zeros", stacklevel=2
        )
        us = torch.cat([us, us.new_zeros(us.shape[0], r - full)], 1)
        vt = torch.cat([vt, vt.new_zeros(r - full, vt.shape[1])], 0)
    return us.to(weight.device, weight.dtype), vt.to(weight.device, weight.dtype)


def enable_stats_collection(model: nn.Module) -> None:
    """Switch every enabled, static quantizer to collecting (quantization off), as ModelOpt's helper does."""
    for _, q in named_quantizers(model):
        assert isinstance(q, TensorQuantizer)
        if q.is_enabled and not q.quant_desc.dynamic and q.quant_desc.amax is None:
            q.disable_quant()
            q.enable_calib()


def finish_stats_collection(model: nn.Module, method: str | None = None, **kwargs) -> None:
    """Load every collecting quantizer's amax (``method``/``kwargs`` go to ``load_calib_amax``) and switch it back
    to quantizing; a quantizer that saw no data keeps its amax (a warning names it)."""
    for _, q in named_quantizers(model):
        assert isinstance(q, TensorQuantizer)
        if q.is_calib_enabled:
            q.load_calib_amax(method, strict=False, **kwargs)
            q.disable_calib()
            q.enable_quant()


def weight_only_quantize(model: nn.Module) -> nn.Module:
    """ModelOpt's ``weight_only_quantize``: every enabled static weight quantizer calibrated (max) on its module's
    weight; activation quantizers untouched. Returns the model."""
    return calibrate_weights(model, None)


def _smoothed_linear(linear: nn.Module, what: str):
    iq = getattr(linear, "input_quantizer", None)
    w = getattr(linear, "weight", None)
    if not isinstance(iq, TensorQuantizer) or not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError(f"{what}: expected a quantized Linear (input_quantizer and a 2-D weight), got {linear!r}")
    stats = getattr(iq, "_smoothing_channel_amax", None)
    if not isinstance(stats, torch.Tensor):
        raise ValueError(
            f"{what}: {iq._label()} has no per-channel input maxima from SmoothQuant (smooth the model with "
            "INT8_SMOOTHQUANT_CFG / model_calib.smoothquant in this session first)"
        )
    return iq, w, stats


def _recalibrate(linear: nn.Module, iq: TensorQuantizer, channel_amax: torch.Tensor) -> None:
    """The weight amax by max from the weight; a static per-tensor input amax from the per-channel input maxima."""
    calibrate_weights(linear, None)
    if iq.is_enabled and not iq.quant_desc.dynamic and iq.axis is None and iq.amax is not None:
        iq.amax = channel_amax.amax().reshape(iq.amax.shape)


def disable_pre_quant_scale_and_resmooth(linear: nn.Module, delete_pre_quant_scale: bool = False) -> None:
    """Undo SmoothQuant on one quantized Linear (ModelOpt's name): ``weight *= pre_quant_scale``, the scale removed
    from the input quantizer (kept on the module for :func:`apply_pre_quant_scale_and_smooth` unless
    ``delete_pre_quant_scale``), the weight amax recomputed with max and a per-tensor input amax set to the largest
    input channel maximum. The weight is modified in place, as SmoothQuant itself does."""
    what = "disable_pre_quant_scale_and_resmooth"
    iq, w, stats = _smoothed_linear(linear, what)
    pqs = iq.pre_quant_scale
    if pqs is None:
        raise ValueError(f"{what}: {iq._label()} has no pre_quant_scale to disable")
    with torch.no_grad():
        w.mul_(pqs.to(w.device, w.dtype))
    iq.pre_quant_scale = None
    cast(Any, linear)._disabled_pre_quant_scale = None if delete_pre_quant_scale else pqs
    _recalibrate(linear, iq, stats)


def apply_pre_quant_scale_and_smooth(linear: nn.Module, pre_quant_scale: torch.Tensor | None = None) -> None:
    """Redo SmoothQuant on one quantized Linear (ModelOpt's name): with ``pre_quant_scale`` (default: the one
    :func:`disable_pre_quant_scale_and_resmooth` kept), ``weight /= pre_quant_scale``, the scale set on the input
    quantizer, the weight amax recomputed with max and a per-tensor input amax set from the scaled channel maxima.
    Raises ValueError when the layer already has a pre_quant_scale or none is given or kept."""
    what = "apply_pre_quant_scale_and_smooth"
    iq, w, stats = _smoothed_linear(linear, what)
    if iq.pre_quant_scale is not None:
        raise ValueError(f"{what}: {iq._label()} already has a pre_quant_scale (disable it first)")
    pqs = pre_quant_scale if pre_quant_scale is not None else getattr(linear, "_disabled_pre_quant_scale", None)
    if pqs is None:
        raise ValueError(f"{what}: no pre_quant_scale given and none kept by disable_pre_quant_scale_and_resmooth")
    iq.pre_quant_scale = pqs  # validated: finite, > 0, one value per input channel
    pqs = iq.pre_quant_scale
    assert pqs is not None
    with torch.no_grad():
        w.div_(pqs.to(w.device, w.dtype))
    cast(Any, linear)._disabled_pre_quant_scale = None
    _recalibrate(linear, iq, stats * pqs.to(stats.device, stats.dtype))
