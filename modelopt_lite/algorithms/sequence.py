"""A list of algorithms in one config: ``"algorithm": ["awq_lite", {"method": "gptq", "clip_search": True}]``.

ModelOpt 0.47 accepts a list under ``"algorithm"`` (its ``QuantizeAlgoCfgType``): each entry becomes one calibration
mode and the modes are applied in order to the same model, each with the same forward loop, each exactly as it
would run alone (so a later step sees the weights, ``pre_quant_scale`` and amaxes the earlier steps left). Here
:func:`~.config.normalize_algorithm` turns a list into ``("sequence", {"steps": ((method, params), ...)})`` (every
entry validated before anything runs; a nested list or an empty list is refused, a ``None`` entry is a step that
does nothing, as ModelOpt's no-calibration mode) and this module runs it: a registered algorithm
(:mod:`.algorithm_registry`) runs with the loop and the max calibration, a plain method (``"max"``, ``"mse"``, ...)
is one calibration pass with that method. ``{"method": "sequence", "steps": [...]}`` is the same thing spelled as a
dict. If a step raises, ``quantize`` puts the weights and quantizers back as they were before the first step.
"""

from __future__ import annotations

from ..conversion.algorithm_registry import ALGORITHMS, register_algorithm
from ..conversion.model_quant import calibrate as _calibrate


def _check(params: dict) -> None:
    steps = params.get("steps")
    if not isinstance(steps, (list, tuple)) or not steps:
        raise ValueError(f"sequence: 'steps' must be a non-empty list of algorithms, got {steps!r}")
    for i, step in enumerate(steps):
        ok = step is None or (
            isinstance(step, tuple) and len(step) == 2 and isinstance(step[0], str) and isinstance(step[1], dict)
        )
        if not ok:
            raise ValueError(f"sequence: step {i} must be a normalized (method, params) pair or None, got {step!r}")


@register_algorithm("sequence", params=("steps",), check=_check)
def run_sequence(model, forward_loop, calibrate, *, steps) -> None:
    """Run every step in order on ``model`` (see the module docstring)."""
    for step in steps:
        if step is None:
            continue
        method, params = step
        if method in ALGORITHMS:
            ALGORITHMS[method].run(model, forward_loop, calibrate, **params)
        else:  # "max" is every quantizer's own calibrator, as a config's "algorithm": "max"
            _calibrate(model, None if method == "max" else method, forward_loop=forward_loop, **params)
