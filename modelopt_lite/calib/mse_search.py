"""``MseCalibrator``: ModelOpt's amax search by a caller's quantization function (``calib.MseCalibrator``).

Candidates are ``amax * m`` for multipliers ``m`` evenly spaced from ``start_multiplier`` to ``stop_multiplier``
(``num_steps`` of them, or ``ceil((stop - start) / step_size) + 1`` as ModelOpt 0.47 counts them). ``collect(x)``
quantizes ``x`` with every candidate through ``quant_func(x, amax)`` and adds up the error, per tensor or per
channel (``axis``: the dimensions that keep their own amax, as a quantizer's ``axis``); ``compute_amax()`` returns,
per channel, the candidate with the smallest total error (the first one on a tie), shaped like the initial amax.

The error is ``error_func(x, xq)`` when given (a scalar, or an element-wise error summed per channel), else the
squared error ``(x - xq) ** 2`` summed per channel. The quantization itself is the caller's: this class only
searches (with a quantizer's own fake quantization as ``quant_func``, the numerics are the quantizer's). The
histogram-based ``"mse"`` method of :class:`~modelopt_lite.calib.HistogramCalibrator` is the search that needs no
quantization function.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["MseCalibrator"]


def _positive(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"MseCalibrator: {what} must be a finite number > 0, got {v!r}")
    return float(v)


class MseCalibrator:
    """Search ``amax * m`` over multipliers ``m`` for the smallest quantization error (see the module docstring).

    Args:
        amax: the initial amax (a tensor, or a number): per tensor, or per channel in the quantizer's keepdims shape.
        axis: None (one amax per tensor) or the kept dimension(s) of a per-channel amax.
        step_size: the spacing of the multipliers when ``num_steps`` is not given (default 0.1).
        start_multiplier, stop_multiplier: the multiplier range (default 0.25 to 4.0).
        quant_func: ``quant_func(x, amax) -> xq``, the fake quantization to score (required to collect).
        error_func: ``error_func(x, xq)``, scalar or element-wise; default the squared error.
        num_steps: the number of multipliers (overrides ``step_size``).

    Raises:
        ValueError: a negative or non-finite amax, a bad multiplier range or step count, NaN/Inf in a collected
            tensor or in the error, or a collected tensor whose per-channel error does not fit the amax.
    """

    def __init__(
        self,
        amax,
        axis=None,
        step_size: float = 0.1,
        start_multiplier: float = 0.25,
        stop_multiplier: float = 4.0,
        quant_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        error_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        num_steps: int | None = None,
    ):
        a = torch.as_tensor(amax).detach().to(torch.float32)
        if a.numel() == 0 or not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
            raise ValueError(f"MseCalibrator: amax must be finite and >= 0, got {amax!r}")
        start = _positive(start_multiplier, "start_multiplier")
        stop = _positive(stop_multiplier, "stop_multiplier")
        if stop < start:
            raise ValueError(f"MseCalibrator: stop_multiplier {stop} is below start_multiplier {start}")
        if num_steps is None:
            num_steps = math.ceil((stop - start) / _positive(step_size, "step_size")) + 1
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"MseCalibrator: num_steps must be an int >= 1, got {num_steps!r}")
        if quant_func is not None and not callable(quant_func):
            raise TypeError(f"MseCalibrator: quant_func must be callable, got {quant_func!r}")
        if error_func is not None and not callable(error_func):
            raise TypeError(f"MseCalibrator: error_func must be callable, got {error_func!r}")
        self._initial_amax = a
        self._axis = axis
        self._multipliers = torch.linspace(start, stop, num_steps, dtype=torch.float32)
        self._quant_func = quant_func
        self._error_func = error_func
        self._losses: torch.Tensor | None = None

    @property
    def num_steps(self) -> int:
        """The number of candidate multipliers."""
        return int(self._multipliers.numel())

    @property
    def multipliers(self) -> torch.Tensor:
        """The candidate multipliers (float32, ascending; a copy)."""
        return self._multipliers.clone()

    def reset(self) -> None:
        """Forget the collected errors (the initial amax and the multipliers stay)."""
        self._losses = None

    def _reduce(self, err: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if err.dim() == 0 or self._axis is None:
            return err.sum()
        kept = (self._axis,) if isinstance(self._axis, int) else tuple(self._axis)
        kept = tuple(a % x.dim() for a in kept)
        dims = [d for d in range(err.dim()) if d not in kept]
        return err.sum(dim=dims, keepdim=True) if dims else err

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Score every candidate amax on ``x`` (not modified) and add the errors to the running totals."""
        if self._quant_func is None:
            raise ValueError("MseCalibrator: no quant_func given, so there is nothing to score")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MseCalibrator.collect expects a torch.Tensor, got {type(x).__name__}")
        xf = x.detach().to(torch.float32)
        if not bool(torch.isfinite(xf).all()):
            raise ValueError("MseCalibrator.collect: the tensor holds NaN or Inf")
        init = self._initial_amax.to(xf.device)
        losses = []
        for m in self._multipliers.tolist():
            xq = self._quant_func(xf, init * m)
            err = self._error_func(xf, xq) if self._error_func is not None else (xf - xq.to(torch.float32)) ** 2
            loss = self._reduce(torch.as_tensor(err, dtype=torch.float32, device=xf.device), xf)
            if not bool(torch.isfinite(loss).all()):
                raise ValueError(f"MseCalibrator.collect: the error of candidate amax x{m:.4g} is NaN or Inf")
            losses.append(loss)
        stacked = torch.stack(losses)
        if self._losses is not None and self._losses.shape != stacked.shape:
            raise ValueError(
                f"MseCalibrator.collect: per-channel error shape {tuple(stacked.shape[1:])} differs from the earlier "
                f"batches' {tuple(self._losses.shape[1:])}"
            )
        self._losses = stacked if self._losses is None else self._losses + stacked

    def compute_amax(self, *args, **kwargs) -> torch.Tensor | None:
        """The amax with the smallest total error (float32, shaped like the initial amax), or None before data."""
        if self._losses is None:
            return None
        best = torch.argmin(self._losses, dim=0)  # the first minimum
        mult = self._multipliers.to(best.device)[best]
        init = self._initial_amax.to(best.device)
        if mult.numel() == init.numel():
            return init * mult.reshape(init.shape)
        return init * mult

    def __repr__(self) -> str:
        m = self._multipliers
        return (
            f"MseCalibrator(amax shape {tuple(self._initial_amax.shape)}, axis={self._axis}, "
            f"multipliers {float(m[0]):.4g}..{float(m[-1]):.4g} x{m.numel()}, collected={self._losses is not None})"
        )
