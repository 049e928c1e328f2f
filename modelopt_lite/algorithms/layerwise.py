"""ModelOpt's layerwise calibration (``model_calib.layerwise_calibrate`` and ``"layerwise": {"enable": True}``).

The decoder layers (the ``nn.ModuleList`` of same-class blocks holding the most parameters, e.g. a Hugging Face
``model.layers``) are calibrated one at a time: layer ``i`` gets ``calib_func(layer, loop_i, **kwargs)`` where
``loop_i`` replays the inputs layer ``i`` received, and those inputs are the outputs of layer ``i - 1``: computed
with its quantizers off before it was calibrated (default), or through the calibrated, quantized layer with
``get_qdq_activations_from_prev_layer=True`` (GPTQ's choice: each layer sees the error of the ones before).

How the inputs are found (every pass of the user's loop runs the whole model and returns its real output): one
pass records layer 0's calls (copies of ``(args, kwargs)``) and checks that the layers form a chain (layer ``k + 1``
gets layer ``k``'s output as its first argument and the very same other arguments, see
:class:`.block_replay.ChainWatch`); then each layer's inputs are the previous layer's outputs on its recorded calls,
with no further pass. When the layers do not chain (the parent computes between them), each layer costs one more
pass of the loop, in which layer ``i - 1`` replays its recorded calls (its real output replaces what it was given,
as ModelOpt's "run" mode does) and layer ``i``'s calls are recorded. Only the decoder layers are calibrated;
quantizers outside them stay as they were. Everything is undone at the end, also on an error.

Not provided: ModelOpt's per-layer checkpoints (``checkpoint_dir``, ``save_every``; a ValueError), and its weight
offloading (``calib_mutates_weights`` is accepted and changes nothing: weights live on their module).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..conversion.algorithm_registry import ALGORITHMS, register_algorithm
from ..conversion.cfg_context import set_quantizer_by_cfg_context
from ..conversion.model_quant import calibrate as calibrate_with
from .block_replay import ChainWatch, copied, fresh, run_element

#: the keys of ModelOpt's ``LayerwiseConfig`` (``"layerwise": {...}`` in an algorithm config)
LAYERWISE_KEYS = (
    "enable",
    "checkpoint_dir",
    "get_qdq_activations_from_prev_layer",
    "save_every",
    "calib_mutates_weights",
)
PARAMS = ("calib", "checkpoint_dir", "get_qdq_activations_from_prev_layer", "save_every", "calib_mutates_weights")


def check_options(opts: dict, what: str = "layerwise") -> None:
    """Validate the layerwise options (ValueError/TypeError naming the bad one)."""
    if opts.get("checkpoint_dir") is not None:
        raise ValueError(
            f"{what}: checkpoint_dir (per-layer checkpoints and resume) is not supported, got "
            f"{opts['checkpoint_dir']!r}"
        )
    for key in ("enable", "get_qdq_activations_from_prev_layer", "calib_mutates_weights"):
        if key in opts and not isinstance(opts[key], bool):
            raise TypeError(f"{what}: {key} must be a bool, got {opts[key]!r}")
    se = opts.get("save_every", 1)
    if isinstance(se, bool) or not isinstance(se, int) or se < 1:
        raise ValueError(f"{what}: save_every must be an int >= 1, got {se!r}")


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` of same-class blocks with the most parameters (None when the model has none)."""
    best, best_n = None, 0
    for m in model.modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0 or len({type(c) for c in m}) != 1:
            continue
        n = sum(p.numel() for p in m.parameters())
        if n > best_n:
            best, best_n = m, n
    return best


def _record(layer: nn.Module, into: list):
    """A forward pre-hook handle recording copies of each call's ``(args, kwargs)`` of ``layer`` into ``into``."""

    def hook(_m, args, kwargs):
        into.append((copied(args), copied(kwargs)))

    return layer.register_forward_pre_hook(hook, with_kwargs=True)


@contextlib.contextmanager
def _replaying(layer: nn.Module, calls: list):
    """``layer`` runs on its recorded ``calls``, in order, whatever it is given (one per call)."""
    queue = collections.deque(calls)
    original = layer.forward
    had = "forward" in vars(layer)

    def forward(*_args, **_kwargs):
        if not queue:
            raise RuntimeError("layerwise: a decoder layer was called more often than in the recorded pass")
        args, kwargs = queue.popleft()
        return original(*fresh(args), **fresh(kwargs))

    layer.forward = forward
    try:
        yield
    finally:
        if had:
            layer.forward = original
        else:
            del layer.forward


def _outputs(layer: nn.Module, calls: list, modes: list) -> list:
    """The next layer's calls of a chain: ``layer`` run on each of ``calls``, its output as the first argument."""
    return run_element(layer, [calls], modes)[0]


class _Inputs:
    """The recorded calls of each decoder layer, from the chain or from one more pass per layer."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList, forward_loop):
        self.model, self.layers, self.loop = model, layers, forward_loop
        first: list = []
        watch = ChainWatch(model, [layers])
        handle = _record(layers[0], first)
        try:
            with watch.watching(), torch.no_grad():
                forward_loop(model)
        finally:
            handle.remove()
        if not first:
            raise RuntimeError("layerwise: the first decoder layer saw no input during the forward loop")
        self.first = first
        self.chained = watch.chained(layers)
        self.modes = {id(layer): watch.modes.get(id(layer), []) for layer in layers}

    def next(self, i: int, calls: list) -> list:
        """Layer ``i + 1``'s calls, layer ``i`` (in its current state) fed ``calls``."""
        layer, nxt = self.layers[i], self.layers[i + 1]
        with torch.no_grad():
            if self.chained:
                return _outputs(layer, calls, self.modes[id(layer)])
            out: list = []
            handle = _record(nxt, out)
            try:
                with _replaying(layer, calls):
                    self.loop(self.model)
            finally:
                handle.remove()
        if len(out) != len(calls):
            raise RuntimeError(f"layerwise: decoder layer {i + 1} was called {len(out)} times, layer {i} {len(calls)}")
        return out


def layerwise(model: nn.Module, forward_loop, calib_func: Callable, **calib_kwargs) -> None:
    """The loop of the module docstring: ``calib_func(layer, loop, **calib_kwargs)`` per decoder layer."""
    opts = {k: calib_kwargs.pop(k) for k in LAYERWISE_KEYS if k in calib_kwargs}
    check_options(opts)
    qdq_from_prev = opts.get("get_qdq_activations_from_prev_layer", False)
    if not callable(forward_loop):
        raise ValueError("layerwise: forward_loop must not be None (a callable taking the model)")
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError("layerwise: no decoder layers found (an nn.ModuleList of same-class blocks) in the model")
    n = len(layers)
    inputs = _Inputs(model, layers, forward_loop)
    calls = inputs.first
    for i in range(n):
        layer = layers[i]

        def loop(m, _calls=calls):
            for args, kwargs in _calls:
                m(*fresh(args), **fresh(kwargs))

        nxt = None
        if i + 1 < n and not qdq_from_prev:
            with set_quantizer_by_cfg_context(layer, {"*": {"enable": False}}):
                nxt = inputs.next(i, calls)
        calib_func(layer, loop, **calib_kwargs)
        if i + 1 < n and qdq_from_prev:
            nxt = inputs.next(i, calls)
        calls = nxt if nxt is not None else []


def per_layer(calib: tuple) -> Callable:
    """``calib_func`` running a normalized ``(method, params)`` (a registered algorithm or a calibration method)."""
    method, params = calib

    def run(layer: nn.Module, loop, **_):
        if method in ALGORITHMS:
            ALGORITHMS[method].run(layer, loop, lambda: calibrate_with(layer, None, loop), **params)
        else:
            calibrate_with(layer, None if method == "max" else method, loop, **params)

    return run


def _check(params: dict) -> None:
    check_options(params)
    calib = params.get("calib")
    if not (isinstance(calib, tuple) and len(calib) == 2 and isinstance(calib[1], dict)):
        raise ValueError(f"layerwise: calib must be a normalized (method, params) pair, got {calib!r}")


@register_algorithm("layerwise", params=PARAMS, check=_check)
def run(model: nn.Module, forward_loop, calibrate, *, calib, **opts) -> None:
    """ModelOpt's ``{"method": M, ..., "layerwise": {"enable": True, ...}}``: ``M`` decoder layer by layer."""
    layerwise(model, forward_loop, per_layer(calib), **opts)
