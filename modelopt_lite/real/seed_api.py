"""The torch_quantizer-style entry points: ``fake_quant(model, wq_params, aq_params, num_steps)``.

Workflow users know (fake quant -> run data -> convert)::

    wq = {"n_bits": 8, "channel_wise": True, "scale_method": "max"}
    aq = {"n_bits": 8, "channel_wise": False, "scale_method": "mse"}
    fq = modelopt_lite.fake_quant(model, wq, aq, num_steps=1)   # weights calibrated now, activations collecting
    run_inference(fq)                                            # activations collect statistics
    real = modelopt_lite.fake2real(fq, save_dir=".")            # finishes calibration, converts, saves

or in one call with ``forward_loop=`` (the returned model is then calibrated and ready to evaluate). ``scale_method``
maps onto the calibrators: ``"max"`` -> MaxCalibrator; ``"mse"``, ``"entropy"``, ``"percentile"`` -> a
HistogramCalibrator resolved with that method. ``num_steps > 1`` gives temporal activation quantizers (one amax per
step, select with ``modelopt_lite.quant_step(model, t)`` while running).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from ..conversion.config import CONVTRANSPOSE_WEIGHT_AXIS, INT8_DEFAULT_CFG
from ..conversion.model_quant import quantize
from ..conversion.utils import quantizer_sites
from ..nn.tensor_quantizer import TensorQuantizer

_PARAM_KEYS = {"n_bits", "channel_wise", "scale_method", "percentile"}
_METHODS = ("max", "mse", "entropy", "percentile")
_PENDING = "_modelopt_lite_pending_calibration"


def _check_params(p: dict, what: str) -> tuple[int, bool, str, dict]:
    if not isinstance(p, dict):
        raise TypeError(
            f"fake_quant: {what} must be a dict like {{'n_bits': 8, 'channel_wise': True, "
            f"'scale_method': 'max'}}, got {type(p).__name__}"
        )
    unknown = sorted(set(p) - _PARAM_KEYS)
    if unknown:
        raise TypeError(f"fake_quant: {what} has unknown key(s) {unknown}; allowed: {sorted(_PARAM_KEYS)}")
    n = p.get("n_bits", 8)
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 8:
        raise ValueError(f"fake_quant: {what}['n_bits'] must be an int in 2..8, got {n!r}")
    cw = p.get("channel_wise", False)
    if not isinstance(cw, bool):
        raise TypeError(f"fake_quant: {what}['channel_wise'] must be a bool, got {cw!r}")
    m = p.get("scale_method", "max")
    if m not in _METHODS:
        raise ValueError(f"fake_quant: {what}['scale_method'] must be one of {_METHODS}, got {m!r}")
    kwargs = {}
    if "percentile" in p:
        if m != "percentile":
            raise ValueError(f"fake_quant: {what}['percentile'] is only used with scale_method='percentile'")
        kwargs["percentile"] = float(p["percentile"])
    return n, cw, m, kwargs


def seed_config(wq_params: dict, aq_params: dict, num_steps: int = 1) -> dict:
    """The :func:`modelopt_lite.quantize` config equivalent to the seed parameters (``algorithm`` None)."""
    wn, wcw, wm, _ = _check_params(wq_params, "wq_params")
    an, acw, am, _ = _check_params(aq_params, "aq_params")
    if acw:
        raise ValueError(
            "fake_quant: aq_params['channel_wise']=True is not supported: activations are quantized "
            "per tensor (one scale per step), as integer GEMMs need"
        )
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"fake_quant: num_steps must be an int >= 1, got {num_steps!r}")
    cfg = copy.deepcopy(INT8_DEFAULT_CFG)
    qc = cfg["quant_cfg"]
    w = {
        "num_bits": wn,
        "axis": 0 if wcw else None,
        "calib_method": "max" if wm == "max" else "histogram",
        "enable": True,
    }
    qc["*weight_quantizer"] = w
    for sub in qc.values():  # ConvTranspose weights keep the project's channel axis for them
        if isinstance(sub, dict) and "*weight_quantizer" in sub and isinstance(sub["*weight_quantizer"], dict):
            sub["*weight_quantizer"] = dict(w, axis=CONVTRANSPOSE_WEIGHT_AXIS if wcw else None)
    qc["*input_quantizer"] = {
        "num_bits": an,
        "axis": None,
        "enable": True,
        "num_steps": num_steps,
        "calib_method": "max" if am == "max" else "histogram",
    }
    cfg["algorithm"] = None
    return cfg


def _method_arg(method: str, calib_method: str):
    return None if (method == "max" and calib_method != "histogram") else method


def _calibrate_weights(model: nn.Module, method: str, kwargs: dict) -> None:
    """Weights are data independent: collect each weight once and load its amax right away."""
    for site in quantizer_sites(model):
        q = site.quantizer
        assert isinstance(q, TensorQuantizer)  # quantizer_sites yields TensorQuantizers only
        if site.local != "weight_quantizer" or not q.is_enabled or site.owner is None:
            continue
        w = getattr(site.owner, "weight", None)
        if not isinstance(w, torch.Tensor):
            continue
        q.reset_amax()
        q.disable_quant()
        q.enable_calib()
        with torch.no_grad():
            q(w)
        q.load_calib_amax(_method_arg(method, q.quant_desc.calib_method), **kwargs)
        q.disable_calib()
        q.enable_quant()


def fake_quant(
    model: nn.Module,
    wq_params: dict,
    aq_params: dict,
    num_steps: int = 1,
    forward_loop: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """Quantize ``model`` in place with the seed-style parameters and return it.

    Weight quantizers are calibrated immediately from the weights (``wq_params['scale_method']``). Activation
    quantizers are calibrated with ``aq_params['scale_method']``: by ``forward_loop(model)`` when given (the model
    comes back calibrated), otherwise they are left collecting statistics from whatever the caller runs next, and
    :func:`finish_calibration` (called by :func:`modelopt_lite.fake2real`) loads their amax.

    Args:
        model: a float model (converted in place, as :func:`modelopt_lite.quantize` does).
        wq_params / aq_params: ``{"n_bits": 2..8, "channel_wise": bool, "scale_method": "max" | "mse" |
            "entropy" | "percentile", "percentile": float (percentile only)}``.
        num_steps: temporal steps of the activation quantizers (1 for ordinary models).
        forward_loop: optional calibration loop ``forward_loop(model)``.

    Raises:
        TypeError / ValueError: malformed parameters (unknown keys, bad n_bits or scale_method).
    """
    cfg = seed_config(wq_params, aq_params, num_steps)
    _, _, wm, wkw = _check_params(wq_params, "wq_params")
    _, _, am, akw = _check_params(aq_params, "aq_params")
    model = quantize(model, cfg)
    _calibrate_weights(model, wm, wkw)
    pending = {}
    for site in quantizer_sites(model):
        q = site.quantizer
        assert isinstance(q, TensorQuantizer)  # quantizer_sites yields TensorQuantizers only
        if site.local == "input_quantizer" and q.is_enabled and not q.quant_desc.dynamic:
            q.disable_quant()
            q.enable_calib()
            pending[site.name] = (am, akw)
    setattr(model, _PENDING, pending)
    if forward_loop is not None:
        if not callable(forward_loop):
            raise TypeError(f"fake_quant: forward_loop must be callable, got {type(forward_loop).__name__}")
        with torch.no_grad():
            forward_loop(model)
        finish_calibration(model)
    return model


def has_pending_calibration(model: nn.Module) -> bool:
    """True when :func:`fake_quant` left activation quantizers collecting statistics."""
    return bool(getattr(model, _PENDING, None))


def finish_calibration(model: nn.Module, strict: bool = True) -> nn.Module:
    """Load the amax of the activation quantizers :func:`fake_quant` left collecting; returns the model.

    Raises:
        RuntimeError: a quantizer saw no data (named); ``strict=False`` warns and disables it instead.
    """
    pending = getattr(model, _PENDING, None) or {}
    modules = dict(model.named_modules())
    for name, (method, kwargs) in pending.items():
        q = cast(TensorQuantizer, modules[name])  # fake_quant recorded input quantizers only
        q.disable_calib()
        q.enable_quant()
        try:
            q.load_calib_amax(_method_arg(method, q.quant_desc.calib_method), **kwargs)
        except RuntimeError:
            if strict:
                raise
            warnings.warn(f"finish_calibration: {name} saw no data; it is disabled", RuntimeWarning, stacklevel=2)
            q.disable()
    if hasattr(model, _PENDING):
        delattr(model, _PENDING)
    return model
