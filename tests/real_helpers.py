"""Shared, cached fixtures for the real-quantization and analysis tests (trained once per test process)."""

from __future__ import annotations

import copy
import functools

import torch

import modelopt_lite as mtl
from modelopt_lite.conversion.model_quant import make_forward_loop
from modelopt_lite.examples import load_digits_data, trained_digits_model


@functools.cache
def _trained(kind: str):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is ~8x cheaper than two busy-waiting ones on a shared CPU
    try:
        return trained_digits_model(kind, epochs=6)
    finally:
        torch.set_num_threads(n)


def float_model(kind: str = "cnn"):
    """A fresh copy of a (cached) trained digits model in eval mode."""
    return copy.deepcopy(_trained(kind)).eval()


def data():
    return load_digits_data()


def calib_loop(n_batches: int = 4):
    return make_forward_loop(data().calib_batches(n_batches, 64))


@functools.cache
def _fake(kind: str, cfg_name: str):
    return mtl.quantize(float_model(kind), getattr(mtl, cfg_name), calib_loop()).eval()


def fake_model(kind: str = "cnn", cfg_name: str = "INT8_DEFAULT_CFG"):
    """A fresh copy of a calibrated fake-quant digits model."""
    return copy.deepcopy(_fake(kind, cfg_name))


def layer_inputs(model, x, names=None):
    """``{module name: input tensor}`` of the named modules (default: those owning enabled quantizers), via pre-hooks."""
    from modelopt_lite.conversion.utils import named_quantizers

    if names is None:
        names = {n.rpartition(".")[0] for n, q in named_quantizers(model) if q.is_enabled}
    seen, hooks = {}, []
    for n, m in model.named_modules():
        if n in names:
            hooks.append(m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, args[0].detach())))
    try:
        with torch.no_grad():
            model(**x) if isinstance(x, dict) or hasattr(x, "keys") else model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen
