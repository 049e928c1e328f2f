"""ModelOpt's ``local_hessian`` weight calibration (``model_calib.local_hessian_calibrate``).

The search of :mod:`.weight_mse` with the squared weight error replaced by the output error of each input block:
for a quantized Linear with weight ``W`` (``cout x cin``), the inputs ``X`` the calibration loop feeds it give one
Hessian per block of ``block_size`` input channels, ``H_b = sum X_b^T X_b / tokens`` (float32, ``block_size x
block_size``), and a candidate amax costs ``sum_b dW_b H_b dW_b^T`` per output row (``dW = W - q(W)``), every element
of a block carrying its block's loss, as ModelOpt's ``local_hessian_error`` does. Steps, as ModelOpt:

1. max calibration of every quantizer over the loop;
2. one more pass of the loop with the weight quantizers off (the input quantizers as calibrated) collecting ``H``;
3. the multiplier search on every eligible weight amax: Hessian-weighted where the layer is a quantized Linear
   whose ``cin`` is a multiple of ``block_size`` and saw data, plain squared error otherwise (a warning names it).

``fp8_scale_sweep=True`` (ModelOpt's default) runs the E4M3 block-scale sweep of :mod:`.weight_mse` on the static
NVFP4 weights (Hessian-weighted the same way) and keeps every other weight at its max amax (a warning names them);
``fp8_scale_sweep=False`` runs the multiplier search on all. Without a loop nothing runs (a warning), as in ModelOpt.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import nn

from ..conversion.algorithm_registry import register_algorithm
from ..conversion.cfg_context import set_quantizer_by_cfg_context
from ..nn import TensorQuantizer
from . import weight_mse

PARAMS = (*weight_mse.PARAMS, "block_size", "debug")


def check_params(params: dict) -> None:
    """:func:`weight_mse.check_params` plus ``block_size`` (an int >= 1) and ``debug`` (a bool)."""
    weight_mse.check_params(params)
    bs = params.get("block_size", 16)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"block_size must be an int >= 1, got {bs!r}")
    if "debug" in params and not isinstance(params["debug"], bool):
        raise TypeError(f"debug must be a bool, got {params['debug']!r}")


class LocalHessian:
    """``sum X_b^T X_b`` per block of ``block_size`` input channels of one Linear, and its token count."""

    def __init__(self, name: str, cout: int, cin: int, block_size: int):
        self.name, self.cout, self.cin, self.block_size = name, cout, cin, block_size
        self.sum: torch.Tensor | None = None
        self.tokens = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Fold in one input batch ``(..., cin)`` (ValueError naming the layer for NaN/Inf)."""
        if x.shape[-1] != self.cin:
            raise ValueError(
                f"local_hessian: {self.name} got an input of shape {tuple(x.shape)}, expected (..., {self.cin})"
            )
        xf = x.detach().reshape(-1, self.cin).to(torch.float32)
        if not bool(torch.isfinite(xf).all()):
            raise ValueError(f"local_hessian: the input of {self.name} contains NaN or Inf")
        xb = xf.T.reshape(self.cin // self.block_size, self.block_size, -1)
        h = xb @ xb.transpose(-1, -2)
        self.sum = h if self.sum is None else self.sum + h
        self.tokens += xf.shape[0]

    def hessian(self) -> torch.Tensor | None:
        """``sum / tokens`` (``(cin / block_size, block_size, block_size)``), None before any data."""
        if self.sum is None or not self.tokens:
            return None
        return torch.div(self.sum, torch.tensor(float(self.tokens), dtype=torch.float32, device=self.sum.device))

    def error_fn(self) -> weight_mse.ErrorFn | None:
        """Per-element error: each element of a block carries ``dW_b H_b dW_b^T`` of its row and block."""
        h = self.hessian()
        if h is None:
            return None
        cout, bs = self.cout, self.block_size

        def error(w: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
            dw = (w - wq).reshape(cout, -1, bs)
            loss = torch.einsum("cnb,nbd,cnd->cn", dw, h.to(dw.device), dw)
            return loss.unsqueeze(-1).expand(-1, -1, bs).reshape(w.shape)

        return error


def _linears(model: nn.Module, block_size: int) -> dict[int, tuple[nn.Module, LocalHessian]]:
    """``{id(weight_quantizer): (module, accumulator)}`` for every quantized Linear the Hessian applies to."""
    out: dict[int, tuple[nn.Module, LocalHessian]] = {}
    for name, m, q, w in weight_mse.weight_sites(model):
        if w.dim() != 2 or not isinstance(getattr(m, "input_quantizer", None), TensorQuantizer):
            continue
        if w.shape[1] % block_size:
            warnings.warn(
                f"local_hessian: {name} has {w.shape[1]} input features, not a multiple of block_size={block_size}; "
                "its weight gets the plain squared-error search",
                stacklevel=3,
            )
            continue
        bsz = q.block_sizes
        quant_block = bsz.get(-1, bsz.get(1)) if bsz else None
        if quant_block is not None and quant_block != block_size:
            warnings.warn(
                f"local_hessian: block_size ({block_size}) != the weight quantizer's block ({quant_block}) of {name}; "
                "the Hessian blocks do not align with the scale blocks",
                stacklevel=3,
            )
        out[id(q)] = (m, LocalHessian(name, w.shape[0], w.shape[1], block_size))
    return out


def collect(model: nn.Module, forward_loop, block_size: int) -> dict[int, LocalHessian]:
    """Run ``forward_loop(model)`` once with the weight quantizers off, accumulating each Linear's block Hessians."""
    sites = _linears(model, block_size)
    handles = []
    for m, acc in sites.values():

        def hook(_mod, args, _acc=acc):
            if args and isinstance(args[0], torch.Tensor):
                _acc.add(args[0])

        handles.append(m.register_forward_pre_hook(hook))
    try:
        with set_quantizer_by_cfg_context(model, {"*weight_quantizer": {"enable": False}}), torch.no_grad():
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    return {qid: acc for qid, (_, acc) in sites.items()}


def refine(model: nn.Module, forward_loop, **params) -> dict[int, LocalHessian]:
    """Steps 2 and 3 of the module docstring on a max-calibrated model; returns the accumulators."""
    accs = collect(model, forward_loop, params.get("block_size", 16))
    fns = {qid: acc.error_fn() for qid, acc in accs.items()}
    weight_mse.refine_weights(
        model,
        step_size=params.get("step_size", 0.1),
        start_multiplier=params.get("start_multiplier", 0.25),
        stop_multiplier=params.get("stop_multiplier", 4.0),
        error_fn_for=lambda q: fns.get(id(q)),
        fp8_scale_sweep=params.get("fp8_scale_sweep", True),
        what="local_hessian",
    )
    if params.get("debug", False):
        cast(Any, model)._local_hessian_accumulators = {acc.name: acc for acc in accs.values()}
    return accs


@register_algorithm("local_hessian", params=PARAMS, check=check_params)
def run(model: nn.Module, forward_loop, calibrate, **params) -> None:
    """ModelOpt's ``{"method": "local_hessian", ...}``: max calibration, the Hessian pass, the weighted search."""
    calibrate()
    refine(model, forward_loop, **params)
