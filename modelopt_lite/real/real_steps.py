"""Temporal steps of real modules (the counterpart of :func:`modelopt_lite.quant_step` for fake quantizers).

A real module converted from a temporal input quantizer stores one input scale per step (``input_scale`` of shape
``(num_steps,)``) and uses ``input_scale[module.step]``. ``modelopt_lite.quant_step(model, t)`` selects the step of
these modules too; :func:`set_real_step` does it directly.
"""

from __future__ import annotations

from torch import nn


def temporal_real_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the real modules of ``model`` with ``num_steps > 1``."""
    from .modules import _RealQuantModule

    return [(n, m) for n, m in model.named_modules() if isinstance(m, _RealQuantModule) and m.num_steps > 1]


def set_real_step(model: nn.Module, t: int) -> dict[str, int]:
    """Select step ``t`` in every temporal real module; returns the previous ``{name: step}``.

    Raises:
        TypeError: t is not an int. ValueError: t is out of range for some module (named); nothing changes then.
    """
    if isinstance(t, bool) or not isinstance(t, int):
        raise TypeError(f"set_real_step: t must be an int, got {t!r}")
    mods = temporal_real_modules(model)
    for n, m in mods:
        if not 0 <= t < m.num_steps:
            raise ValueError(f"set_real_step: step {t} is out of range for module {n!r} (num_steps={m.num_steps})")
    prev = {n: m.step for n, m in mods}
    for _, m in mods:
        m.step = t
    return prev
