"""Temporal steps of real modules (the counterpart of :func:`modelopt_lite.quant_step` for fake quantizers).

A real module converted from a temporal input quantizer stores one input scale per step (``input_scale`` of shape
``(num_steps,)``) and uses ``input_scale[module.step]``. ``modelopt_lite.quant_step(model, t)`` selects the step of
these modules too; :func:`set_real_step` does it directly.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from ..conversion.quant_steps import register_temporal_finder, select_step
from .real_types import REAL_CLASSES, RealModule


def temporal_real_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the real modules of ``model`` with ``num_steps > 1``."""
    kinds = tuple(REAL_CLASSES.values())
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds) and cast(RealModule, m).num_steps > 1]


register_temporal_finder(temporal_real_modules)  # modelopt_lite.quant_step(model, t) selects their step too


def set_real_step(model: nn.Module, t: int) -> dict[str, int]:
    """Select step ``t`` in every temporal real module; returns the previous ``{name: step}``.

    Raises:
        TypeError: t is not an int. ValueError: t is out of range for some module (named); nothing changes then.
    """
    if isinstance(t, bool) or not isinstance(t, int):
        raise TypeError(f"set_real_step: t must be an int, got {t!r}")
    return select_step(temporal_real_modules(model), t, "set_real_step", "module")
