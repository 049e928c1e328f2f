"""SmoothQuant: move activation outliers into the weights before W8A8 calibration.

For each quantized ``Linear`` (input and weight quantizers enabled, per-tensor static input quantizer) with input
``x`` of channels ``j`` and weight ``W`` of shape ``(out, in)``::

    s_j = max|x_j| ** alpha / max_i |W_ij| ** (1 - alpha)
    x @ W.T == (x * (1 / s)) @ (W * s).T

so the layer's weight becomes ``W * s`` (per input channel) and its input quantizer gets ``pre_quant_scale = 1 / s``
(an elementwise multiply before quantizing, exported as ``Mul``). Layers that read the same input tensor (the
query/key/value projections of an attention block) share one ``s``, computed from the max of their weights, so
they keep one input grid. Channels never active (``max|x_j| == 0``) or with an all-zero weight column keep
``s_j = 1``. ``alpha`` trades activation range against weight range: 0.5 is the paper's default, 0.8 suits BERT-style
encoders (all-MiniLM-L6-v2 W8A8: mean cosine to FP32 0.986 without, 0.997 with alpha=0.8).

Used through ``quantize(model, {"quant_cfg": ..., "algorithm": {"method": "smoothquant", "alpha": 0.8}}, loop)``
(see ``INT8_SMOOTHQUANT_CFG``): the loop runs once in float to measure the channels, then once more to calibrate
(max) with the smoothed weights. The model's float weights are modified in place, like every SmoothQuant
implementation; :func:`modelopt_lite.save` with ``include_weights=True`` keeps them.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import nn

from ..conversion.algorithm_registry import register_algorithm
from ..conversion.state import snapshot_quantizers
from ..conversion.utils import named_quantizers
from ..nn import TensorQuantizer

log = logging.getLogger(__name__)
_S_MIN, _S_MAX = 1e-5, 1e5


def check_alpha(alpha) -> float:
    """``alpha`` as a float in [0, 1] (ValueError naming the bad value)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"smoothquant alpha must be a number in [0, 1], got {alpha!r}")
    return float(alpha)


def _candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Quantized Linear-like modules that SmoothQuant can rescale, by module path."""
    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        iq, wq = getattr(m, "input_quantizer", None), getattr(m, "weight_quantizer", None)
        w = getattr(m, "weight", None)
        if iq is None or wq is None or not isinstance(w, torch.Tensor) or w.dim() != 2 or not isinstance(m, nn.Linear):
            continue
        d = iq.quant_desc
        if iq.is_enabled and wq.is_enabled and d.axis is None and not d.block_sizes and not d.dynamic:
            out[name] = m
    return out


def _measure(model: nn.Module, mods: dict[str, nn.Module], forward_loop):
    """Per-channel ``max|x|`` of each module's input over ``forward_loop`` (run in float, no grad), and the groups of
    modules that read the same input tensor."""
    amax: dict[str, torch.Tensor] = {}
    seen: dict[int, list[str]] = {}  # id(input tensor) -> modules that read it, within one forward of the model
    groups: dict[str, set] = {name: {name} for name in mods}
    alive: list[torch.Tensor] = []  # keeps those ids unique until the next forward starts

    def new_forward(_m, _inp):
        seen.clear()
        alive.clear()

    def hook(name):
        def pre(_m, inp):
            x = inp[0]
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return
            a = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
            if not bool(torch.isfinite(a).all()):
                raise ValueError(f"smoothquant: the input of {name} contains NaN or Inf")
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
            for other in seen.setdefault(id(x), []):
                merged = groups[other] | groups[name]
                for member in merged:
                    groups[member] = merged
            seen[id(x)].append(name)
            alive.append(x)

        return pre

    snaps = snapshot_quantizers(q for _, q in named_quantizers(model))
    handles = [model.register_forward_pre_hook(new_forward)]
    handles += [m.register_forward_pre_hook(hook(name)) for name, m in mods.items()]
    try:
        for _, q in named_quantizers(model):
            assert isinstance(q, TensorQuantizer)
            q.disable()  # measure the float model
        with torch.no_grad():
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
        snaps.restore()
    unique = {frozenset(g) for g in groups.values()}
    return amax, [sorted(g) for g in unique]


def smooth_quant(model: nn.Module, forward_loop, alpha: float = 0.5) -> list[list[str]]:
    """Apply SmoothQuant to every eligible quantized Linear of ``model`` (see the module docstring); returns the
    groups of module paths that share one smoothing vector. Calibrate afterwards."""
    alpha = check_alpha(alpha)
    if not callable(forward_loop):
        raise TypeError(f"smoothquant needs a forward_loop callable, got {type(forward_loop).__name__}")
    mods = _candidates(model)
    if not mods:
        log.info("smoothquant: no quantized Linear with enabled per-tensor input and weight quantizers")
        return []
    amax, groups = _measure(model, mods, forward_loop)
    done = []
    for group in sorted(groups):
        group = [n for n in group if n in amax]
        if not group:
            continue
        a = amax[group[0]]
        w = torch.stack(
            [cast(torch.Tensor, mods[n].weight).detach().abs().amax(0).float().to(a.device) for n in group]
        ).amax(0)
        live = (a > 0) & (w > 0)
        s = torch.ones_like(a)
        s[live] = (a[live].pow(alpha) / w[live].pow(1.0 - alpha)).clamp(_S_MIN, _S_MAX)
        with torch.no_grad():
            for n in group:
                weight = cast(torch.Tensor, mods[n].weight)
                iq = cast(TensorQuantizer, mods[n].input_quantizer)
                weight.mul_(s.to(weight.device, weight.dtype))
                iq.pre_quant_scale = (1.0 / s).to(weight.device)
                iq._smoothing_channel_amax = a.to(weight.device)  # model_calib's resmooth reads it
        done.append(group)
    log.info("smoothquant: %d layer(s) in %d group(s) smoothed (alpha=%g)", sum(map(len, done)), len(done), alpha)
    return done


def _check_params(params: dict) -> None:
    if "alpha" in params:
        check_alpha(params["alpha"])


@register_algorithm(
    "smoothquant",
    params=("alpha",),
    check=_check_params,
    hint=" (INT8_SMOOTHQUANT_CFG), or smooth_quant(model, forward_loop) followed by calibrate(model)",
)
def _run(model: nn.Module, forward_loop, calibrate, *, alpha: float = 0.5) -> None:
    """The config algorithm: rescale the Linears, then calibrate with max."""
    smooth_quant(model, forward_loop, alpha=alpha)
    calibrate()
