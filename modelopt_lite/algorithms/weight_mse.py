"""ModelOpt's ``mse`` weight calibration (``model_calib.mse_calibrate``): a multiplier search on each weight amax.

After the max calibration (every quantizer's own calibrator over the loop, or the weights alone without one), each
eligible weight quantizer tries ``amax * m`` for ``m = linspace(start_multiplier, stop_multiplier, n)`` with
``n = ceil((stop - start) / step_size) + 1`` (ModelOpt's candidates, float32), fake-quantizes its module's weight with
each candidate through the quantizer itself (the exact path: ``scale = float32(amax) / bound``, true division,
round half to even), and keeps, per amax element (per tensor, per channel or per block), the candidate with the
smallest summed squared error; the first one wins a tie (``argmin``). Activation amaxes keep their max calibration.

Eligible: an enabled, static, calibrated ``TensorQuantizer`` whose amax is not fixed by its descriptor and is not an
MX format (no amax). ``fp8_scale_sweep=True`` is ModelOpt's sweep over the FP8 E4M3 per-block scales of *static*
NVFP4 weights (and of registered custom backends); every other weight is left at its max amax there. This project
has no static NVFP4 weight quantizer (NVFP4 weights scale their blocks dynamically under a calibrated global amax),
so with ``fp8_scale_sweep=True`` every weight keeps its max amax and a warning says so, as ModelOpt's run on such a
model does.

The error metric can be replaced (``error_fn(w, wq) -> per-element error``): :mod:`.local_hessian` weights it by
the layer's input statistics.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..conversion.algorithm_registry import register_algorithm
from ..functional import blocks
from ..nn import TensorQuantizer

#: ModelOpt's MseCalibConfig fields this algorithm takes (``distributed_sync``, ``shared_states``: see ``check``)
PARAMS = ("step_size", "start_multiplier", "stop_multiplier", "fp8_scale_sweep", "distributed_sync", "shared_states")

ErrorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _number(params: dict, key: str, default: float) -> float:
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key} must be a finite number, got {v!r}")
    return float(v)


def check_params(params: dict) -> None:
    """Validate the search parameters (ValueError/TypeError naming the bad one)."""
    step = _number(params, "step_size", 0.1)
    start = _number(params, "start_multiplier", 0.25)
    stop = _number(params, "stop_multiplier", 4.0)
    if step <= 0:
        raise ValueError(f"step_size must be > 0, got {step!r}")
    if not 0 < start <= stop:
        raise ValueError(f"need 0 < start_multiplier <= stop_multiplier, got {start!r} and {stop!r}")
    for key in ("fp8_scale_sweep", "distributed_sync"):
        if key in params and not isinstance(params[key], bool):
            raise TypeError(f"{key} must be a bool, got {params[key]!r}")
    if params.get("shared_states") is not None:
        raise ValueError(
            "shared_states (ModelOpt's global amax shared across grouped/MoE linears) is not supported: "
            f"got {params['shared_states']!r}; leave it None"
        )


def multipliers(step_size: float, start_multiplier: float, stop_multiplier: float, device=None) -> torch.Tensor:
    """ModelOpt's candidate multipliers: ``linspace(start, stop, ceil((stop - start) / step) + 1)`` (float32)."""
    n = math.ceil((stop_multiplier - start_multiplier) / step_size) + 1
    return torch.linspace(start_multiplier, stop_multiplier, steps=n, device=device)


def eligible(q) -> bool:
    """Whether ``q`` is a weight quantizer the search refines (see the module docstring)."""
    if not isinstance(q, TensorQuantizer) or not q.is_enabled or q.dynamic or q.quant_desc.amax is not None:
        return False
    scheme = q.quant_desc.block_scheme
    if scheme is not None and not scheme.calibrates_amax:  # MX: no amax at all
        return False
    return q.amax is not None


def weight_sites(model: nn.Module) -> Iterator[tuple[str, nn.Module, TensorQuantizer, torch.Tensor]]:
    """``(module name, module, weight_quantizer, weight)`` of every module quantizing its own ``weight`` with an
    eligible quantizer (each quantizer once)."""
    seen: set[int] = set()
    for name, m in model.named_modules():
        q, merged = getattr(m, "weight_quantizer", None), getattr(m, "quantizer_weight", None)
        w = merged() if callable(merged) else getattr(m, "weight", None)  # a LoRA layer quantizes W + delta
        if isinstance(w, torch.Tensor) and eligible(q) and id(q) not in seen:
            seen.add(id(q))
            assert isinstance(q, TensorQuantizer)
            yield name, m, q, w


def _reduce(err: torch.Tensor, q: TensorQuantizer, amax: torch.Tensor) -> torch.Tensor:
    """Sum the per-element error over the elements each amax entry scales; shaped like ``amax``."""
    bs = q.quant_desc.block_sizes
    if bs and q.quant_desc.block_scheme is None:  # static blocks: one amax per block
        sizes = blocks.normalize(bs, err.shape)
        eb, _ = blocks.to_blocks(err, sizes)
        return eb.sum(dim=blocks.inner_dims(err.dim(), sizes)).reshape(amax.shape)
    if amax.numel() == 1:
        return err.sum().reshape(amax.shape)
    fitted = q._fit_static(amax, err)
    red = [d for d in range(err.dim()) if fitted.shape[d] == 1 and err.shape[d] != 1]
    return err.sum(dim=red, keepdim=True).reshape(amax.shape)


def _check_finite(w: torch.Tensor, where: str) -> None:
    if w.is_floating_point() and not bool(torch.isfinite(w).all()):
        raise ValueError(f"{where}: the weight contains NaN or Inf, so no amax can be searched for it")


@torch.no_grad()
def search_amax(
    q: TensorQuantizer, w: torch.Tensor, mults: torch.Tensor, error_fn: ErrorFn | None = None, where: str = ""
) -> torch.Tensor:
    """The candidate ``amax * m`` (per amax element) with the smallest summed error of ``q(w)``; sets it on ``q``
    and returns it. ``error_fn(w, wq)`` gives the per-element error (default: the squared difference, float32)."""
    where = where or q._label()
    _check_finite(w, where)
    initial = q.amax
    assert initial is not None
    initial = initial.detach().clone()
    mults = mults.to(initial.device)
    wf = w.detach().float()
    best_loss: torch.Tensor | None = None
    best = initial.clone()
    was_calib = q.is_calib_enabled
    q.disable_calib()
    try:
        for m in mults:
            cand = initial * m
            q.amax = cand
            wq = q(w.detach()).float()
            err = (wf - wq) ** 2 if error_fn is None else error_fn(wf, wq)
            loss = _reduce(err, q, cand).to(initial.device)
            if best_loss is None:
                best_loss, best = loss, cand
            else:
                better = loss < best_loss  # strictly better: the first minimum wins a tie, as argmin
                best_loss = torch.where(better, loss, best_loss)
                best = torch.where(better, cand, best)
    except BaseException:
        q.amax = initial
        raise
    finally:
        if was_calib:
            q.enable_calib()
    q.amax = best
    return best


def refine_weights(
    model: nn.Module,
    step_size: float = 0.1,
    start_multiplier: float = 0.25,
    stop_multiplier: float = 4.0,
    error_fn_for: Callable[[TensorQuantizer], ErrorFn | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run :func:`search_amax` on every eligible weight quantizer of ``model``; returns ``{module name: amax}``."""
    out: dict[str, torch.Tensor] = {}
    for name, _, q, w in list(weight_sites(model)):
        mults = multipliers(step_size, start_multiplier, stop_multiplier, device=w.device)
        error_fn = error_fn_for(q) if error_fn_for is not None else None
        out[name] = search_amax(q, w, mults, error_fn, where=f"mse: {name}.weight_quantizer")
    return out


def warn_no_sweep(what: str) -> None:
    """``fp8_scale_sweep=True`` here: no static NVFP4 weight exists, every weight keeps its max amax."""
    warnings.warn(
        f"{what}: fp8_scale_sweep=True refines only static NVFP4 weights (ModelOpt's FP8 block-scale sweep); "
        "this project's NVFP4 weights scale their blocks dynamically, so every weight keeps its max-calibrated "
        "amax. Pass fp8_scale_sweep=False for the multiplier search.",
        stacklevel=3,
    )


@register_algorithm("weight_mse", params=PARAMS, check=check_params)
def run(model: nn.Module, forward_loop, calibrate, **params) -> None:
    """ModelOpt's ``{"method": "mse", "step_size": ..., ...}``: max calibration, then the weight amax search."""
    calibrate()
    if params.get("fp8_scale_sweep", False):
        warn_no_sweep("mse")
        return
    refine_weights(
        model,
        step_size=params.get("step_size", 0.1),
        start_multiplier=params.get("start_multiplier", 0.25),
        stop_multiplier=params.get("stop_multiplier", 4.0),
    )
