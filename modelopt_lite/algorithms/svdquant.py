"""SVDQuant (ModelOpt's ``"svdquant"`` method): a float low-rank branch absorbs each Linear's outliers, the residual
weight is quantized.

``"algorithm": {"method": "svdquant", "lowrank": 32}`` (ModelOpt's parameter names and defaults; presets:
:data:`NVFP4_SVDQUANT_DEFAULT_CFG`, :data:`INT4_SVDQUANT_CFG`). For every quantized ``nn.Linear`` whose weight
quantizer is an enabled :class:`~modelopt_lite.nn.TensorQuantizer`, as ModelOpt 0.47 does:

1. ``awq_lite`` smooths the model (a per-input-channel scale ``s``: the weight becomes ``W * s``, the input ``x / s``,
   kept as ``pre_quant_scale`` or folded into the producing norm/Linear; see :mod:`modelopt_lite.algorithms.awq`);
2. the smoothed weight is split by a float64 SVD, ``W = U S V^T``: ``svdquant_lora_a = V^T[:r]`` (``(r, in)``),
   ``svdquant_lora_b = U[:, :r] * S[:r]`` (``(out, r)``), both stored float32 on the weight quantizer (see
   :mod:`modelopt_lite.nn._svdquant_lora`), and the layer's weight becomes the residual ``W - B @ A``;
3. the weight quantizers are calibrated again on the residuals (max), the input quantizers keep their amax (their
   inputs did not change).

The layer then computes ``F.linear(Q_in(x), Q_w(W - B A), bias) + F.linear(F.linear(x_s, A), B)``, ``x_s`` the float
input times its ``pre_quant_scale``. ``skip_layers`` (fnmatch patterns of module names) keep the quantizer config but
skip AWQ and the branch (max calibration only), as ModelOpt. The other parameters are ``awq_lite``'s
(``alpha_step``, ``debug``, ``progress``). Differences from ModelOpt, on purpose: a rank above
``min(out_features, in_features)`` is a ValueError naming the layer (ModelOpt warns and pads with zeros, which
only stores zeros), and the factors are float32 whatever the weight's dtype.

Layers without an enabled TensorQuantizer weight quantizer (disabled, or a SequentialQuantizer) and quantized
modules that are not Linear are max-calibrated as usual. :func:`add_lowrank` applies step 2 to one layer.
"""

from __future__ import annotations

import fnmatch
import logging
import numbers
from typing import cast

import torch
from torch import nn

from ..conversion.algorithm_registry import register_algorithm
from ..conversion.model_quant import _calibration
from ..conversion.model_quant import calibrate as _calibrate_model
from ..nn import TensorQuantizer
from ..presets.svdquant import DEFAULT_RANK
from .awq import LITE_PARAMS, awq, check_params

log = logging.getLogger(__name__)

#: ModelOpt's default rank
PARAMS = ("lowrank", "skip_layers", *LITE_PARAMS)


def check_rank(rank, where: str = "svdquant") -> int:
    """``rank`` as an int (ValueError/TypeError naming ``where`` unless it is an integer >= 1)."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"{where}: lowrank must be an integer >= 1, got {type(rank).__name__} {rank!r}")
    if int(rank) < 1:
        raise ValueError(f"{where}: lowrank must be an integer >= 1, got {rank!r}")
    return int(rank)


def _check_skip(skip) -> list[str]:
    if skip is None:
        return []
    if isinstance(skip, str) or not isinstance(skip, (list, tuple)) or not all(isinstance(p, str) for p in skip):
        raise TypeError(f"svdquant: skip_layers must be a list of module-name patterns or None, got {skip!r}")
    return list(skip)


def _check(params: dict) -> None:
    check_rank(params.get("lowrank", DEFAULT_RANK))
    _check_skip(params.get("skip_layers"))
    check_params({k: v for k, v in params.items() if k in LITE_PARAMS})


def svd_factors(weight: torch.Tensor, rank: int, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)``: the rank-``rank`` truncated SVD of a 2-D ``weight`` in float64, ``a = V^T[:r]`` ``(r, in)`` and
    ``b = U[:, :r] * S[:r]`` ``(out, r)``, both float32 (so ``b @ a`` is the best rank-r approximation).

    Raises:
        ValueError: ``rank`` < 1 or > ``min(weight.shape)``, or ``weight`` is not a finite 2-D tensor.
    """
    rank = check_rank(rank, f"svdquant: {name}")
    if weight.dim() != 2:
        raise ValueError(f"svdquant: {name} must be 2-D, got shape {tuple(weight.shape)}")
    if rank > min(weight.shape):
        raise ValueError(
            f"svdquant: {name}: lowrank={rank} exceeds min(out_features, in_features) = {min(weight.shape)} of the "
            f"weight {tuple(weight.shape)}; choose lowrank <= {min(weight.shape)} or skip the layer (skip_layers)"
        )
    w = weight.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"svdquant: {name} has non-finite values")
    u, s, vt = torch.linalg.svd(w, full_matrices=False)
    return vt[:rank].to(torch.float32).contiguous(), (u[:, :rank] * s[:rank]).to(torch.float32).contiguous()


def _check_linear(module: nn.Module, name: str) -> TensorQuantizer:
    if not isinstance(module, nn.Linear) or not isinstance(getattr(module, "input_quantizer", None), TensorQuantizer):
        raise TypeError(
            f"svdquant: {name} is a {type(module).__name__}; the low-rank branch applies to quantized nn.Linear "
            "modules only (quantize the model first)"
        )
    wq = getattr(module, "weight_quantizer", None)
    if not isinstance(wq, TensorQuantizer):
        raise TypeError(
            f"svdquant: {name}: the weight quantizer is a {type(wq).__name__}; the low-rank branch needs one "
            "TensorQuantizer (not a SequentialQuantizer)"
        )
    return wq


@torch.no_grad()
def add_lowrank(module: nn.Module, rank: int = DEFAULT_RANK, name: str | None = None) -> None:
    """Split one quantized Linear's weight: the rank-``rank`` SVD part becomes the float branch
    (``weight_quantizer.svdquant_lora_a`` / ``_b``), the weight becomes the residual ``W - B @ A`` (in place) and
    the weight quantizer's amax is reset (calibrate it again). A layer that has factors already gets its branch
    folded back first, so the result is that of the full weight.

    Raises:
        TypeError: ``module`` is not a quantized ``nn.Linear`` with a TensorQuantizer weight quantizer.
        ValueError: ``rank`` < 1 or > ``min(out_features, in_features)``.
    """
    label = name or type(module).__name__
    wq = _check_linear(module, label)
    w = cast(torch.Tensor, module.weight)
    full = w.detach().to(torch.float64)
    if wq.has_lowrank:
        lora_b, lora_a = wq.svdquant_lora_b, wq.svdquant_lora_a
        assert lora_b is not None and lora_a is not None  # has_lowrank
        full = full + lora_b.double() @ lora_a.double()
    a, b = svd_factors(full, rank, f"{label}.weight")
    residual = full - b.double() @ a.double()
    wq.svdquant_lora_a, wq.svdquant_lora_b = a.to(w.device), b.to(w.device)
    w.data.copy_(residual.to(w.dtype))
    wq.reset_amax()


def _targets(model: nn.Module, skip: list[str]) -> tuple[dict[str, nn.Module], list[str]]:
    """``(layers that get the branch, skipped layer names)``."""
    out: dict[str, nn.Module] = {}
    skipped: list[str] = []
    for name, m in model.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        if not isinstance(m, nn.Linear) or not isinstance(wq, TensorQuantizer):
            continue
        if not wq.is_enabled or m.weight.dim() != 2:
            continue
        if any(fnmatch.fnmatch(name, p) for p in skip):
            skipped.append(name)
        else:
            out[name] = m
    return out, skipped


@torch.no_grad()
def svdquant(
    model: nn.Module,
    forward_loop,
    lowrank: int = DEFAULT_RANK,
    skip_layers: list[str] | None = None,
    *,
    calibrate=None,
    **awq_params,
) -> dict[str, int]:
    """Run SVDQuant on ``model``'s quantized Linears (module docstring); returns ``{layer name: rank}``.

    ``forward_loop(model)`` runs the calibration data; ``calibrate`` (no-argument max calibration over the loop) is
    what :func:`modelopt_lite.quantize` passes. Every rank is checked before the model changes.

    Raises:
        ValueError: ``lowrank`` < 1, or above ``min(out_features, in_features)`` of a layer (named).
        TypeError: bad parameter types.
    """
    rank = check_rank(lowrank)
    skip = _check_skip(skip_layers)
    layers, skipped = _targets(model, skip)
    for name, m in layers.items():
        shape = cast(torch.Tensor, m.weight).shape
        if rank > min(shape):
            raise ValueError(
                f"svdquant: {name}: lowrank={rank} exceeds min(out_features, in_features) = {min(shape)} "
                f"of its weight {tuple(shape)}; choose lowrank <= {min(shape)} or skip the layer "
                "(skip_layers)"
            )
    off = []
    for name in skipped:
        m = model.get_submodule(name)
        for q in (m.weight_quantizer, m.input_quantizer):
            if isinstance(q, TensorQuantizer) and q.is_enabled:
                q.disable()
                off.append(q)
        log.info("svdquant: %s skipped (max calibration only)", name)
    try:
        awq(model, forward_loop, "awq_lite", calibrate=calibrate, **awq_params)
    finally:
        for q in off:
            q.enable()
    for name, m in layers.items():
        add_lowrank(m, rank, name)
    if off:  # the skipped layers' quantizers were off during AWQ: one max calibration over the data, as ModelOpt
        if calibrate is not None:
            calibrate()
        else:
            _calibrate_model(model, None, forward_loop=forward_loop)
    else:  # only the residual weights changed (the inputs did not): their quantizers see the new weights
        _recalibrate_weights(model, list(layers.values()))
    log.info("svdquant: %d layer(s) got a rank-%d branch", len(layers), rank)
    return dict.fromkeys(layers, rank)


def _recalibrate_weights(model: nn.Module, layers: list) -> None:
    if not layers:
        return
    with torch.no_grad(), _calibration(model, None, {}, only={id(m.weight_quantizer) for m in layers}):
        for m in layers:
            m.weight_quantizer(m.weight)


@register_algorithm(
    "svdquant",
    params=PARAMS,
    check=_check,
    hint=" (NVFP4_SVDQUANT_DEFAULT_CFG), or svdquant(model, forward_loop) on a configured model",
)
def _run(model: nn.Module, forward_loop, calibrate, **params) -> None:
    svdquant(model, forward_loop, calibrate=calibrate, **params)
