"""ModelOpt's ``lsq`` (``model_calib.lsq``), as far as this project's quantizers allow.

ModelOpt runs a weight-scale calibration (``scale_algorithm``: ``{"method": "mse"}`` by default, or ``"max"`` /
``"local_hessian"`` with their options) and then converts every *static NVFP4* weight quantizer (its
``StaticBlockScaleQuantizer``: stored per-block amaxes under a global amax) to LSQ mode, with separate quantize
(``pre``) and dequantize (``post``) amaxes of which ``learnable_amax`` become parameters. Every other weight
quantizer is left as calibrated. Here the same: every enabled, calibrated static NVFP4 weight quantizer
(``block_sizes["type"] == "static"``) gets :meth:`~modelopt_lite.nn.TensorQuantizer.enable_lsq` (numerics and
gradients: :mod:`modelopt_lite.functional.nvfp4_lsq`); when there is none a warning says so (a single learnable
amax for other formats is :meth:`TensorQuantizer.init_learn_amax`).
"""

from __future__ import annotations

import warnings

from torch import nn

from ..conversion.algorithm_registry import register_algorithm
from ..nn import TensorQuantizer
from .weight_scale import run_weight_algorithm, weight_algorithm

PARAMS = ("scale_algorithm", "learnable_amax", "tied_amax", "quantize_pre_scale")
_AMAXES = ("pre", "post")


def check_params(params: dict) -> None:
    """Validate ``scale_algorithm`` (as a weight algorithm) and the LSQ options."""
    weight_algorithm(params.get("scale_algorithm") or {"method": "mse"}, "scale_algorithm")
    la = params.get("learnable_amax", ("post",))
    names = [la] if isinstance(la, str) else la
    if not isinstance(names, (list, tuple)) or any(n not in _AMAXES for n in names):
        raise ValueError(f"learnable_amax must be 'pre', 'post', a list of those or [], got {la!r}")
    for key in ("tied_amax", "quantize_pre_scale"):
        if key in params and not isinstance(params[key], bool):
            raise TypeError(f"{key} must be a bool, got {params[key]!r}")


def convert(model: nn.Module, learnable_amax=("post",), tied_amax=False, quantize_pre_scale=True) -> list[str]:
    """LSQ mode for every enabled, calibrated static NVFP4 weight quantizer; returns their names (a warning if
    none)."""
    done, seen = [], set()
    for name, m in model.named_modules():
        q = getattr(m, "weight_quantizer", None)
        if not isinstance(q, TensorQuantizer) or id(q) in seen or not q.is_enabled or not q.is_nvfp4_static:
            continue
        seen.add(id(q))
        if q.has_amax:
            q.enable_lsq(learnable_amax=learnable_amax, tied_amax=tied_amax, quantize_pre_scale=quantize_pre_scale)
            done.append(name)
    if not done:
        warnings.warn(
            "lsq: the weights were calibrated with the scale algorithm, but no quantizer was converted to LSQ mode: "
            "ModelOpt converts only static NVFP4 weight quantizers (block_sizes type 'static': separate pre/post "
            "block amaxes), and the model has none; for a single learnable amax call init_learn_amax() on the "
            "weight quantizers",
            stacklevel=4,
        )
    return done


@register_algorithm("lsq", params=PARAMS, check=check_params)
def run(model: nn.Module, forward_loop, calibrate, **params) -> None:
    """ModelOpt's ``{"method": "lsq", ...}``: the scale calibration, then LSQ mode for static NVFP4 weights."""
    method, opts = weight_algorithm(params.get("scale_algorithm") or {"method": "mse"}, "scale_algorithm")
    run_weight_algorithm(model, forward_loop, calibrate, method, opts)
    convert(
        model,
        params.get("learnable_amax", ("post",)),
        params.get("tied_amax", False),
        params.get("quantize_pre_scale", True),
    )
