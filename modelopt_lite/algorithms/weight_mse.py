"""ModelOpt's ``mse`` weight calibration (``model_calib.mse_calibrate``): a multiplier search on each weight amax.

After the max calibration (every quantizer's own calibrator over the loop, or the weights alone without one), each
eligible weight quantizer tries ``amax * m`` for ``m = linspace(start_multiplier, stop_multiplier, n)`` with
``n = ceil((stop - start) / step_size) + 1`` (ModelOpt's candidates, float32), fake-quantizes its module's weight with
each candidate through the quantizer itself (the exact path: ``scale = float32(amax) / bound``, true division,
round half to even), and keeps, per amax element (per tensor, per channel or per block), the candidate with the
smallest summed squared error; the first one wins a tie (``argmin``). Activation amaxes keep their max calibration.

Eligible: an enabled, static, calibrated ``TensorQuantizer`` whose amax is not fixed by its descriptor and is not an
MX format (no amax).

``fp8_scale_sweep=True`` is ModelOpt's sweep over the FP8 E4M3 block scales of *static* NVFP4 weights
(``block_sizes["type"] == "static"``, see :mod:`modelopt_lite.nn._nvfp4_static`): with the global amax ``g`` fixed,
every block tries the 126 amaxes ``g * (v / 448)`` for ``v`` each positive finite E4M3 value (so its block scale is
exactly ``v``), and keeps the one with the least error (the first on a tie), as ModelOpt's ``NVFP4MSECalibrator``.
Every other weight keeps its max amax there (ModelOpt skips them too) and a warning names them.

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
from ..formats import e4m3_levels
from ..functional import blocks
from ..functional.division import true_div
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
    if bs and q.quant_desc.per_block_amax:  # static blocks, static NVFP4: one amax per block
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


def fp8_scale_candidates(device=None) -> torch.Tensor:
    """The 126 positive finite E4M3 values divided by 448 (float32, ascending): ModelOpt's NVFP4 sweep candidates."""
    return true_div(e4m3_levels(device)[1:].float(), 448.0)  # the levels without 0 (exact in float32)


@torch.no_grad()
def search_amax(
    q: TensorQuantizer, w: torch.Tensor, mults: torch.Tensor, error_fn: ErrorFn | None = None, where: str = ""
) -> torch.Tensor:
    """The candidate ``amax * m`` (per amax element) with the smallest summed error of ``q(w)``; sets it on ``q``
    and returns it. ``error_fn(w, wq)`` gives the per-element error (default: the squared difference, float32)."""
    initial = q.amax
    assert initial is not None
    initial = initial.detach().clone()
    mults = mults.to(initial.device)
    return _search(q, w, initial, [initial * m for m in mults], error_fn, where or q._label())


@torch.no_grad()
def sweep_fp8_scales(q: TensorQuantizer, w: torch.Tensor, error_fn: ErrorFn | None = None, where: str = ""):
    """Static NVFP4: each block amax becomes the candidate ``global_amax * c`` (``c`` in
    :func:`fp8_scale_candidates`) with the smallest summed error of ``q(w)``; sets it on ``q`` and returns it."""
    initial, g = q.amax, q.global_amax
    assert initial is not None and g is not None
    initial = initial.detach().clone()
    cands = [torch.full_like(initial, 1.0) * (g * c) for c in fp8_scale_candidates(initial.device)]
    return _search(q, w, initial, cands, error_fn, where or q._label())


def _search(q: TensorQuantizer, w, initial: torch.Tensor, cands: list, error_fn: ErrorFn | None, where: str):
    _check_finite(w, where)
    wf = w.detach().float()
    best_loss: torch.Tensor | None = None
    best = initial.clone()
    was_calib = q.is_calib_enabled
    q.disable_calib()
    try:
        for cand in cands:
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
    fp8_scale_sweep: bool = False,
    what: str = "mse",
) -> dict[str, torch.Tensor]:
    """Run :func:`search_amax` (``fp8_scale_sweep``: :func:`sweep_fp8_scales` on the static NVFP4 weights, the others
    kept, with a warning) on every eligible weight quantizer of ``model``; returns ``{module name: amax}``."""
    out: dict[str, torch.Tensor] = {}
    skipped = []
    for name, _, q, w in list(weight_sites(model)):
        error_fn = error_fn_for(q) if error_fn_for is not None else None
        where = f"{what}: {name}.weight_quantizer"
        if fp8_scale_sweep and q.quant_desc.nvfp4_static:
            out[name] = sweep_fp8_scales(q, w, error_fn, where=where)
        elif fp8_scale_sweep:
            skipped.append(name)
        else:
            mults = multipliers(step_size, start_multiplier, stop_multiplier, device=w.device)
            out[name] = search_amax(q, w, mults, error_fn, where=where)
    if skipped:
        warn_no_sweep(what, skipped)
    return out


def warn_no_sweep(what: str, names: list[str]) -> None:
    """``fp8_scale_sweep=True``: the weights ``names`` are not static NVFP4 and keep their max amax."""
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
    warnings.warn(
        f"{what}: fp8_scale_sweep=True refines only static NVFP4 weights (block_sizes type 'static', ModelOpt's FP8 "
        f"block-scale sweep); these keep their max-calibrated amax: {shown}. Pass fp8_scale_sweep=False for the "
        "multiplier search.",
        stacklevel=3,
    )


@register_algorithm("weight_mse", params=PARAMS, check=check_params)
def run(model: nn.Module, forward_loop, calibrate, **params) -> None:
    """ModelOpt's ``{"method": "mse", "step_size": ..., ...}``: max calibration, then the weight amax search."""
    calibrate()
    refine_weights(
        model,
        step_size=params.get("step_size", 0.1),
        start_multiplier=params.get("start_multiplier", 0.25),
        stop_multiplier=params.get("stop_multiplier", 4.0),
        fp8_scale_sweep=params.get("fp8_scale_sweep", False),
    )
