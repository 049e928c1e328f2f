"""ModelOpt's ``nvfp4_act_headroom`` calibration (``model_calib.nvfp4_act_headroom_calibrate``).

Every enabled, static NVFP4 *input* quantizer (a name ending in ``input_quantizer``; its blocks are scaled
dynamically under the calibrated global amax) gets a
:class:`~modelopt_lite.calib.nvfp4_headroom.NVFP4ActHeadroomCalibrator` for the run, so its global amax leaves
headroom above the calibrated range; the weights are calibrated by ``weight_scale_algorithm``: ``{"method": "max"}``
(the default), ``"mse"`` or ``"local_hessian"`` with their own options, each of which runs the max calibration
first, the pass in which the swapped calibrators collect. The original calibrators are put back afterwards, also on
an error. A ``SequentialQuantizer`` input wrapping an NVFP4 quantizer is refused before anything changes.
"""

from __future__ import annotations

import warnings
from typing import TypeGuard

from torch import nn

from ..calib.nvfp4_headroom import NVFP4ActHeadroomCalibrator, check_headroom
from ..conversion.algorithm_registry import register_algorithm
from ..conversion.utils import named_quantizers
from ..nn import SequentialQuantizer, TensorQuantizer
from .weight_scale import run_weight_algorithm, weight_algorithm

PARAMS = ("anchor_percentile", "upper_percentile", "rho", "weight_scale_algorithm")


class UnsupportedActivationQuantizerError(NotImplementedError, ValueError):
    """An NVFP4 activation quantizer this algorithm cannot calibrate (ModelOpt raises NotImplementedError)."""


def check_params(params: dict) -> None:
    """Validate the headroom parameters and the weight algorithm."""
    check_headroom(
        params.get("rho", 16384.0), params.get("anchor_percentile", 1.0), params.get("upper_percentile", 99.99)
    )
    weight_algorithm(params.get("weight_scale_algorithm"))


def is_nvfp4_activation(q) -> TypeGuard[TensorQuantizer]:
    """An enabled, static NVFP4 quantizer whose global amax is calibrated (not fixed)."""
    if not isinstance(q, TensorQuantizer) or not q.is_enabled or q.dynamic or q.quant_desc.amax is not None:
        return False
    scheme = q.quant_desc.block_scheme
    return scheme is not None and scheme.kind == "nvfp4"


def swap_in(model: nn.Module, anchor_percentile: float, upper_percentile: float, rho: float) -> list:
    """Give every NVFP4 input quantizer a headroom calibrator; returns ``(quantizer, old calibrators)`` pairs."""
    for name, q in model.named_modules():
        if name.endswith("input_quantizer") and isinstance(q, SequentialQuantizer):
            if any(is_nvfp4_activation(s) for s in q):
                raise UnsupportedActivationQuantizerError(
                    f"nvfp4_act_headroom does not support SequentialQuantizer activation quantizers, but {name!r} "
                    "wraps an NVFP4 quantizer; use a single activation quantizer there, or calibrate with 'max'"
                )
    swapped = []
    for name, q in named_quantizers(model):
        if not name.endswith("input_quantizer") or not is_nvfp4_activation(q):
            continue
        blocks = q.block_sizes or {}
        bs = blocks.get(-1, 16)
        cals = [
            NVFP4ActHeadroomCalibrator(
                q.num_bits,
                None,
                q.unsigned,
                block_size=bs,
                anchor_percentile=anchor_percentile,
                upper_percentile=upper_percentile,
                rho=rho,
                name=name,
            )
            for _ in range(q.num_steps)
        ]
        swapped.append((q, q._calibrators))
        q._calibrators = cals
    return swapped


@register_algorithm("nvfp4_act_headroom", params=PARAMS, check=check_params)
def _run(model: nn.Module, forward_loop, calibrate, **params) -> None:
    """ModelOpt's ``{"method": "nvfp4_act_headroom", ...}``."""
    method, opts = weight_algorithm(params.get("weight_scale_algorithm"))
    swapped = swap_in(
        model, params.get("anchor_percentile", 1.0), params.get("upper_percentile", 99.99), params.get("rho", 16384.0)
    )
    if not swapped:
        warnings.warn(
            "nvfp4_act_headroom: no NVFP4 input quantizer matched, so this is plain max calibration of the "
            "activations (check that the config enables NVFP4 activation quantizers)",
            stacklevel=3,
        )
    try:
        run_weight_algorithm(model, forward_loop, calibrate, method, opts)
    finally:
        for q, old in swapped:
            q._calibrators = old
