"""The weight-scale algorithm of ``nvfp4_act_headroom`` (``weight_scale_algorithm``) and ``lsq``
(``scale_algorithm``): ``{"method": "max" | "mse" | "local_hessian", **options}``, as ModelOpt 0.47 takes it."""

from __future__ import annotations

from typing import Any

from torch import nn

from . import local_hessian, weight_mse

#: the methods and the options each takes
_WEIGHT_METHODS = {
    "max": frozenset({"distributed_sync"}),
    "mse": weight_mse.PARAMS,
    "local_hessian": local_hessian.PARAMS,
}


def weight_algorithm(spec: Any, what: str = "weight_scale_algorithm") -> tuple[str, dict]:
    """``(method, options)`` of a weight scale algorithm (None -> ``("max", {})``); ValueError if malformed."""
    if spec is None:
        return "max", {}
    if isinstance(spec, str):
        spec = {"method": spec}
    if not isinstance(spec, dict) or spec.get("method") not in _WEIGHT_METHODS:
        raise ValueError(f"{what} must be None or {{'method': one of {sorted(_WEIGHT_METHODS)}, ...}}, got {spec!r}")
    method = spec["method"]
    opts = {k: v for k, v in spec.items() if k != "method"}
    unknown = sorted(set(opts) - set(_WEIGHT_METHODS[method]))
    if unknown:
        raise ValueError(f"{what} {method!r} got unknown option(s) {unknown}")
    if method == "mse":
        weight_mse.check_params(opts)
    elif method == "local_hessian":
        local_hessian.check_params(opts)
    elif not isinstance(opts.get("distributed_sync", True), bool):
        raise TypeError(f"distributed_sync must be a bool, got {opts['distributed_sync']!r}")
    return method, opts


def run_weight_algorithm(model: nn.Module, forward_loop, calibrate, method: str, opts: dict) -> None:
    """The weight calibration asked for (each starts with the max calibration over the loop)."""
    if method == "max":
        calibrate()
    elif method == "mse":
        weight_mse.run(model, forward_loop, calibrate, **opts)
    else:
        local_hessian.run(model, forward_loop, calibrate, **opts)
