"""Temporal (per-step) quantization: select the step of every temporal quantizer for a block.

A quantizer configured with ``num_steps > 1`` keeps one amax (and one calibrator) per step, for models whose
activation ranges change along a process such as diffusion sampling. ``with quant_step(model, t):`` selects step
``t`` in all of them; calibration inside the block collects into step ``t``'s statistics, and quantization uses step
``t``'s amax. Quantizers with ``num_steps == 1`` are not affected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .utils import named_quantizers

#: ``finder(model) -> [(name, module)]`` of other temporal modules (each with ``num_steps`` and a settable ``step``).
#: Higher layers register theirs (:mod:`modelopt_lite.real` does on import), so this layer never imports them.
_TEMPORAL_FINDERS: list[Callable[[nn.Module], list[tuple[str, nn.Module]]]] = []


def register_temporal_finder(finder: Callable[[nn.Module], list[tuple[str, nn.Module]]]) -> Callable:
    """Make :func:`quant_step` also select the step of the modules ``finder(model)`` returns; returns ``finder``."""
    if not callable(finder):
        raise TypeError(f"register_temporal_finder: finder must be callable, got {type(finder).__name__}")
    if finder not in _TEMPORAL_FINDERS:
        _TEMPORAL_FINDERS.append(finder)
    return finder


def temporal_quantizers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, quantizer)`` for every quantizer of ``model`` with ``num_steps > 1``, plus the temporal modules of
    the registered finders (e.g. real modules, which select their per-step input scale through ``step``)."""
    qs: list[tuple[str, nn.Module]] = [(n, q) for n, q in named_quantizers(model) if getattr(q, "num_steps", 1) > 1]
    for finder in _TEMPORAL_FINDERS:
        qs += finder(model)
    return qs


def _as_step(t) -> int:
    if isinstance(t, torch.Tensor):
        if t.numel() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"quant_step: t must be an int or a one-element integer tensor, got {t!r}")
        t = int(t.item())
    if isinstance(t, bool) or not isinstance(t, int):
        raise TypeError(f"quant_step: t must be an int, got {type(t).__name__} {t!r}")
    return t


def set_quant_step(model: nn.Module, t) -> dict[str, int]:
    """Set the step of every temporal quantizer to ``t``; returns the previous ``{name: step}``.

    Raises:
        TypeError: ``t`` is not an integer.
        ValueError: ``t`` is outside ``[0, num_steps)`` of some quantizer (named); nothing is changed then.
    """
    return select_step(temporal_quantizers(model), _as_step(t), "quant_step", "quantizer")


def select_step(items: list, t: int, caller: str, kind: str) -> dict[str, int]:
    """Set ``step = t`` on every ``(name, obj)`` of ``items`` (objects with ``num_steps``/``step``), all or none.

    Returns the previous ``{name: step}``; ValueError naming the first object whose ``num_steps`` excludes ``t``.
    """
    for n, o in items:
        if not 0 <= t < o.num_steps:
            raise ValueError(f"{caller}: step {t} is out of range for {kind} {n!r} (num_steps={o.num_steps})")
    previous = {n: o.step for n, o in items}
    for _, o in items:
        o.step = t
    return previous


@contextlib.contextmanager
def quant_step(model: nn.Module, t):
    """Within the block, every temporal quantizer of ``model`` uses (and calibrates) step ``t``; restored after.

    Example::

        for t in reversed(range(num_steps)):
            with modelopt_lite.quant_step(model, t):
                x = sampler_step(model(x, t), x, t)
    """
    qs: dict[str, Any] = dict(temporal_quantizers(model))  # modules with a settable ``step``
    previous = set_quant_step(model, t)
    try:
        yield model
    finally:
        for n, step in previous.items():
            qs[n].step = step
