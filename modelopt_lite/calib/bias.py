"""The affine bias of a quantizer (``y = fq(x - b) + b``): what it is computed from, and its static calibrator.

The bias is reduced over the *listed* dimensions and kept (size 1, ``keepdim``) over the others, as ModelOpt 0.47
does: for keys and values in the attention layout ``[batch, heads, seq, head_dim]``, reducing ``(-2, -4)`` (seq and
batch) gives one bias per head and channel, of shape ``(1, heads, 1, head_dim)``.

Methods (ModelOpt's names):

- ``"mean"``: the mean over the reduced dimensions; calibrated as the running average of the per-batch means
  (``(b * n + b_new) / (n + 1)``, every batch weighted equally, whatever its size);
- ``"max_min"``: ``(max + min) / 2`` over the reduced dimensions; calibrated from the running max and min.

Everything is computed in float32 (the stored bias is float32 whatever the input's dtype), the mean on a contiguous
copy: torch's summation order (so the last bit of the mean) depends on the strides, and an attention's K/V are
often strided views (transposed, or heads expanded for grouped-query attention).
"""

from __future__ import annotations

import torch

from ..functional.checks import first_bad
from ..functional.division import true_div

BIAS_METHODS = ("mean", "max_min")


def reduce_dims(axes: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """The non-negative dimensions of a rank-``rank`` tensor that ``axes`` (negative allowed) reduce.

    Raises:
        ValueError: an axis out of range, or two axes naming the same dimension.
    """
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(f"bias axis {a} is out of range for an input of rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise ValueError(f"bias axes {tuple(axes)} name the same dimension twice for an input of rank {rank}")
    return tuple(sorted(out))


def _max_min(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.amax(x, dim=dims, keepdim=True), torch.amin(x, dim=dims, keepdim=True)


def _not_finite(what: str, *stats: torch.Tensor) -> ValueError:
    """The error for a bias statistic that NaN/Inf in the input made non-finite, naming the first bad value."""
    v = next(first_bad(t, ~torch.isfinite(t)) for t in stats if not bool(torch.isfinite(t).all()))
    return ValueError(f"the input contains NaN or Inf, so its bias is not finite ({what} got {v!r}); clean the input")


def compute_bias(x: torch.Tensor, axes: tuple[int, ...], method: str = "mean") -> torch.Tensor:
    """The bias of one tensor: float32, ``x``'s rank with size 1 on the reduced dimensions.

    Raises:
        ValueError: bad axes or method, an empty input, or a bias that is not finite (NaN/Inf in ``x``).
    """
    if method not in BIAS_METHODS:
        raise ValueError(f"bias method must be one of {BIAS_METHODS}, got {method!r}")
    if x.numel() == 0:
        raise ValueError(f"cannot compute a bias of an empty tensor of shape {tuple(x.shape)}")
    dims = reduce_dims(axes, x.dim())
    xf = x.detach().float().contiguous()  # the summation order of the mean must not depend on x's strides
    if method == "mean":
        b = torch.mean(xf, dim=dims, keepdim=True)
    else:
        hi, lo = _max_min(xf, dims)
        b = true_div(hi + lo, 2)
    if not bool(torch.isfinite(b).all()):
        raise _not_finite(f"the {method!r} bias", b)
    return b


class BiasCalibrator:
    """Static bias calibration: the running mean (``"mean"``) or running max/min (``"max_min"``) of the inputs.

    ``collect(x)`` folds one batch in and returns the bias so far (what the amax calibrator then sees subtracted,
    as in ModelOpt); ``compute_bias()`` returns it (None before any data). The kept dimensions must keep their
    sizes across batches.
    """

    def __init__(self, method: str = "mean", axes: tuple[int, ...] = (), name: str | None = None):
        if method not in BIAS_METHODS:
            raise ValueError(f"bias method must be one of {BIAS_METHODS}, got {method!r}")
        self._method = method
        self._axes = tuple(axes)
        self.name = name
        self.reset()

    def reset(self) -> None:
        """Forget everything collected."""
        self._bias: torch.Tensor | None = None
        self._max: torch.Tensor | None = None
        self._min: torch.Tensor | None = None
        self._count = 0

    @property
    def num_collected(self) -> int:
        """How many batches were collected."""
        return self._count

    def _check_shape(self, new: torch.Tensor) -> None:
        if self._bias is not None and new.shape != self._bias.shape:
            raise ValueError(
                f"bias shape changed from {tuple(self._bias.shape)} to {tuple(new.shape)}: the kept dimensions "
                f"(all but the reduced {self._axes}) must keep their sizes across calibration batches"
            )

    def collect(self, x: torch.Tensor) -> torch.Tensor:
        """Fold ``x`` into the statistics; returns the bias so far (float32)."""
        if self._method == "mean":
            b = compute_bias(x, self._axes, "mean")
            self._check_shape(b)
            if self._bias is None:
                self._bias = b
            else:
                self._bias = true_div(self._bias.to(b.device) * self._count + b, self._count + 1)
        else:
            dims = reduce_dims(self._axes, x.dim())
            if x.numel() == 0:
                raise ValueError(f"cannot compute a bias of an empty tensor of shape {tuple(x.shape)}")
            hi, lo = _max_min(x.detach().float(), dims)
            if not bool(torch.isfinite(hi).all() and torch.isfinite(lo).all()):
                raise _not_finite(f"the {self._method!r} bias" + (f" of {self.name!r}" if self.name else ""), hi, lo)
            self._check_shape(hi)
            if self._max is None or self._min is None:
                self._max, self._min = hi, lo
            else:
                self._max = torch.maximum(self._max.to(hi.device), hi)
                self._min = torch.minimum(self._min.to(lo.device), lo)
            self._bias = true_div(self._max + self._min, 2)
        self._count += 1
        return self._bias

    def compute_bias(self) -> torch.Tensor | None:
        """The calibrated bias (a float32 copy), or None before any data."""
        return None if self._bias is None else self._bias.clone()

    @property
    def _calib_bias(self) -> torch.Tensor | None:
        """ModelOpt's name for the bias collected so far (float32, not a copy), or None before any data."""
        return self._bias

    def __repr__(self) -> str:
        return f"BiasCalibrator(method={self._method!r}, axes={self._axes})"
