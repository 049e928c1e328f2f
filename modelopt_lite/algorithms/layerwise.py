"""ModelOpt's layerwise calibration (``model_calib.layerwise_calibrate`` and ``"layerwise": {"enable": True}``).

The decoder layers (the ``nn.ModuleList`` of same-class blocks holding the most parameters, e.g. a Hugging Face
``model.layers``) are calibrated one at a time: layer ``i`` gets ``calib_func(layer, loop_i, **kwargs)`` where
``loop_i`` replays the inputs layer ``i`` received, and those inputs are the outputs of layer ``i - 1``: computed
with its quantizers off before it was calibrated (default), or through the calibrated, quantized layer with
``get_qdq_activations_from_prev_layer=True`` (GPTQ's choice: each layer sees the error of the ones before).

How the inputs are found, as ModelOpt does: the user's loop runs the whole model with every layer's ``forward``
patched: layers before ``i - 1`` return zero placeholders on the meta device (their outputs are never used), layer
``i - 1`` replays its recorded inputs instead of what it is given, and layer ``i`` records ``(args, kwargs)`` and
stops the forward (the model returns None). The parent model's own code between layers (masks, position
embeddings) thus runs as usual; a model that computes on the hidden state between layers is not supported (its
meta placeholders raise). Only the decoder layers are calibrated; quantizers outside them stay as they were.
Everything is undone at the end, also on an error.

Not provided: ModelOpt's per-layer checkpoints (``checkpoint_dir``, ``save_every``; a ValueError), and its weight
offloading (``calib_mutates_weights`` is accepted and changes nothing: weights live on their module).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..conversion.algorithm_registry import ALGORITHMS, register_algorithm
from ..conversion.cfg_context import set_quantizer_by_cfg_context
from ..conversion.model_quant import calibrate as calibrate_with

#: the keys of ModelOpt's ``LayerwiseConfig`` (``"layerwise": {...}`` in an algorithm config)
LAYERWISE_KEYS = (
    "enable",
    "checkpoint_dir",
    "get_qdq_activations_from_prev_layer",
    "save_every",
    "calib_mutates_weights",
)
PARAMS = ("calib", "checkpoint_dir", "get_qdq_activations_from_prev_layer", "save_every", "calib_mutates_weights")


class _Stop(Exception):
    """Raised by the capturing layer to end the model's forward once its inputs are recorded."""


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


def _meta(out):
    if isinstance(out, torch.Tensor):
        return ("tensor", out.shape, out.dtype)
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, [_meta(o) for o in out])
    return ("other", out)


def _zeros(meta):
    tag = meta[0]
    if tag == "tensor":
        return torch.zeros(meta[1], dtype=meta[2], device="meta")
    if tag in ("tuple", "list"):
        items = [_zeros(m) for m in meta[1]]
        return tuple(items) if tag == "tuple" else items
    return meta[1]


def _fresh_kwargs(kwargs: dict) -> dict:
    """A replay must not extend a KV cache across replays: reset it (or drop it), as ModelOpt does."""
    cache = kwargs.get("past_key_values")
    if cache is None:
        return kwargs
    kwargs = dict(kwargs)
    if hasattr(cache, "reset"):
        cache.reset()
    else:
        kwargs["past_key_values"] = None
    return kwargs


class _Patched:
    """The layers' and the model's patched forwards (modes: original, capture, run, skip)."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList):
        self.model, self.layers = model, list(layers)
        self.mode = ["original"] * len(self.layers)
        self.inputs: list[list] = [[] for _ in self.layers]  # recorded (args, kwargs) per layer
        self.replay: collections.deque = collections.deque()
        self.meta: list[Any] = [None] * len(self.layers)
        self._saved: list[tuple[nn.Module, Any]] = []

    def __enter__(self) -> _Patched:
        for i, layer in enumerate(self.layers):
            self._patch(layer, self._layer_forward(i, layer.forward))
        self._patch(self.model, self._model_forward(self.model.forward))
        return self

    def __exit__(self, *exc) -> None:
        for m, old in reversed(self._saved):
            if old is None:
                del m.forward
            else:
                m.forward = old
        self._saved.clear()

    def _patch(self, m: nn.Module, fn: Callable) -> None:
        self._saved.append((m, m.__dict__.get("forward")))
        m.forward = fn

    def _layer_forward(self, i: int, original: Callable) -> Callable:
        def forward(*args, **kwargs):
            mode = self.mode[i]
            if mode == "skip":
                return _zeros(self.meta[i])
            if mode == "run":
                real_args, real_kwargs = self.replay.popleft()
                out = original(*real_args, **_fresh_kwargs(real_kwargs))
                self.meta[i] = _meta(out)
                return out
            if mode == "capture":
                self.inputs[i].append((args, kwargs))
                raise _Stop
            return original(*args, **kwargs)

        return forward

    @staticmethod
    def _model_forward(original: Callable) -> Callable:
        def forward(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except _Stop:
                return None

        return forward

    def capture(self, i: int, forward_loop, run_prev: list | None) -> list:
        """Run the loop once to record layer ``i``'s inputs (layer ``i - 1`` replaying ``run_prev``)."""
        for j in range(len(self.layers)):
            self.mode[j] = "skip" if j < i - 1 else "original"
        if i > 0:
            self.mode[i - 1] = "run"
            self.replay = collections.deque(run_prev or [])
        self.mode[i] = "capture"
        self.inputs[i] = []
        try:
            with torch.no_grad():
                forward_loop(self.model)
        finally:
            self.mode = ["original"] * len(self.layers)
            self.replay.clear()
        if not self.inputs[i]:
            raise RuntimeError(f"layerwise: decoder layer {i} saw no input during the forward loop")
        return self.inputs[i]


def layerwise(model: nn.Module, forward_loop, calib_func: Callable, **calib_kwargs) -> None:
    """The loop of the module docstring: ``calib_func(layer, loop, **calib_kwargs)`` per decoder layer."""
    opts = {k: calib_kwargs.pop(k) for k in LAYERWISE_KEYS if k in calib_kwargs}
    check_options(opts)
    qdq_from_prev = opts.get("get_qdq_activations_from_prev_layer", False)
    if not callable(forward_loop):
        raise ValueError("layerwise: forward_loop must not be None (a callable taking the model)")
    found = decoder_layers(model)
    if found is None:
        raise ValueError("layerwise: no decoder layers found (an nn.ModuleList of same-class blocks) in the model")
    n = len(found)
    with _Patched(model, found) as p:
        inputs = p.capture(0, forward_loop, None)
        for i in range(n):
            layer = p.layers[i]

            def loop(m, _inputs=inputs):
                for args, kwargs in _inputs:
                    m(*args, **_fresh_kwargs(kwargs))

            nxt = None
            if i + 1 < n and not qdq_from_prev:
                with set_quantizer_by_cfg_context(layer, {"*": {"enable": False}}):
                    nxt = p.capture(i + 1, forward_loop, inputs)
            calib_func(layer, loop, **calib_kwargs)
            if i + 1 < n and qdq_from_prev:
                nxt = p.capture(i + 1, forward_loop, inputs)
            p.inputs[i] = []
            inputs = nxt if nxt is not None else []


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
