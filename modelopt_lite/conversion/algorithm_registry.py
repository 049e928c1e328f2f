"""The registry of calibration algorithms: what a config's ``"algorithm": {"method": NAME, **params}`` can name
besides the plain calibration methods (max, histogram, percentile, mse, entropy).

An algorithm registers itself by name with the parameters it accepts and a ``run`` function::

    @register_algorithm("smoothquant", params=("alpha",), check=_check)
    def _run(model, forward_loop, calibrate, *, alpha=0.5):
        smooth_quant(model, forward_loop, alpha)   # transform the model (weights, pre_quant_scale, amax, ...)
        calibrate()                                # then the max calibration (each quantizer's own calibrator)

``quantize(model, cfg, forward_loop)`` validates the parameters (``check(params)`` may raise ValueError/TypeError,
reported as a QuantConfigError before anything runs), snapshots every module that has a ``weight`` tensor, and calls
``run(model, forward_loop, calibrate, **params)``: ``forward_loop(model)`` runs the calibration data,
``calibrate()`` runs it once more inside a max calibration. If ``run`` raises, the weights and quantizers are put
back exactly. Adding an algorithm is one module under :mod:`modelopt_lite.algorithms` that registers here, imported by
``algorithms/__init__`` (the table lives in this layer because ``calibrate`` dispatches on it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """A registered calibration algorithm."""

    name: str
    params: frozenset[str]  #: the parameter names ``run`` accepts (besides model, forward_loop, calibrate)
    run: Callable[..., object]
    check: Callable[[dict], None] | None = None  #: validates the parameters before anything runs
    hint: str = ""  #: appended to the error that tells a user this is not a calibrate() method


#: every registered algorithm, by name
ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(
    name: str, params=(), check: Callable[[dict], None] | None = None, hint: str = ""
) -> Callable[[Callable], Callable]:
    """Decorator: register ``run`` as the algorithm ``name`` (ValueError if the name is taken)."""

    def deco(run: Callable) -> Callable:
        if name in ALGORITHMS:
            raise ValueError(f"calibration algorithm {name!r} is already registered")
        ALGORITHMS[name] = Algorithm(name, frozenset(params), run, check, hint)
        return run

    return deco
