"""Real max pooling: ``QuantizedMaxPool1d/2d/3d`` pool the integer codes of their input and scale the result.

Max pooling commutes with a monotone quantizer: ``max(q_i) * s == max(q_i * s)`` for ``s >= 0`` (and casting to a
lower-precision float is monotone too), so pooling the codes gives exactly what the fake-quant
``QuantMaxPool`` (``pool(input_quantizer(x))``) returns, NaN included. State: ``input_scale`` (float32
``(num_steps,)``, 0 = dead range) like the other real modules; the spec (JSON-able, see :func:`pool_spec`) holds
the pooling arguments and the input format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import int_range
from ..functional import library

_POOL_KEYS = ("kernel_size", "stride", "padding", "dilation")


def _tuple(v, n: int) -> list[int]:
    return [int(x) for x in v] if isinstance(v, (tuple, list)) else [int(v)] * n


def pool_args(module: nn.Module, dims: int) -> dict:
    """The pooling arguments of a float (or fake-quant) ``nn.MaxPoolNd``, normalized to lists of ``dims`` ints."""
    out: dict[str, list[int] | bool] = {
        k: _tuple(getattr(module, k) if k != "stride" else (module.stride or module.kernel_size), dims)
        for k in _POOL_KEYS
    }
    out["ceil_mode"] = bool(module.ceil_mode)
    out["return_indices"] = bool(module.return_indices)
    return out


class _QuantizedMaxPoolNd(nn.Module):
    """Shared body; ``dims`` and ``_pool`` are set by the subclasses."""

    dims = 2
    #: ``F.max_poolNd`` (its stub types ``return_indices`` as ``Literal[False]``; the real function takes a bool)
    _pool: Callable[..., Any] = staticmethod(F.max_pool2d)
    input_scale: torch.Tensor  # buffer registered in __init__
    label: str  # set by fake2real / load_real, as on the weighted real modules
    validate: bool  # set by fake2real / set_validate (pooling has no input scan)

    def __init__(self, spec: dict, backend: str = "auto"):
        super().__init__()
        self.spec = spec
        self.backend = backend  # unused: there is no GEMM; kept for a uniform constructor
        p, inp = spec["pool"], spec["input"]
        self.kernel_size, self.stride = tuple(p["kernel_size"]), tuple(p["stride"])
        self.padding, self.dilation = tuple(p["padding"]), tuple(p["dilation"])
        self.ceil_mode, self.return_indices = bool(p["ceil_mode"]), bool(p["return_indices"])
        self.num_steps = int(inp["num_steps"])
        self.step = 0
        self.register_buffer("input_scale", torch.ones(self.num_steps, dtype=torch.float32))
        _, self._qmin, self._qmax = int_range(inp["num_bits"], inp["unsigned"], inp["narrow_range"])

    def current_input_scale(self) -> torch.Tensor:
        """float32 scalar scale of the selected temporal step (``self.step``)."""
        if not 0 <= self.step < self.num_steps:
            raise ValueError(f"{type(self).__name__}: step {self.step} is out of range (num_steps={self.num_steps})")
        return self.input_scale[self.step]

    def input_codes(self, x: torch.Tensor) -> torch.Tensor:
        """Integer codes of x (float32, NaN where x is NaN): the exact quantizer of the fake-quant module."""
        return library.quantize_int(x, self.current_input_scale(), self._qmin, self._qmax)

    def forward(self, x: torch.Tensor):
        scale = self.current_input_scale()
        out = self._pool(
            self.input_codes(x),
            self.kernel_size,
            self.stride,
            self.padding,
            self.dilation,
            ceil_mode=self.ceil_mode,
            return_indices=self.return_indices,
        )
        codes, idx = out if self.return_indices else (out, None)
        y = (codes * scale).to(x.dtype)
        return (y, idx) if self.return_indices else y

    def _apply(self, fn, recurse=True):
        keep = self.input_scale
        out = super()._apply(fn, recurse)
        self.input_scale = keep.to(self.input_scale.device)  # stays float32 through .half()
        return out

    def extra_repr(self) -> str:
        inp = self.spec["input"]
        s = f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"
        s += f", input=int{inp['num_bits']}{' unsigned' if inp['unsigned'] else ''}"
        return s + (f", num_steps={self.num_steps}" if self.num_steps > 1 else "")


class QuantizedMaxPool1d(_QuantizedMaxPoolNd):
    """``nn.MaxPool1d`` on integer input codes (exactly the fake-quant ``QuantMaxPool1d``)."""

    dims = 1
    _pool = staticmethod(F.max_pool1d)


class QuantizedMaxPool2d(_QuantizedMaxPoolNd):
    """``nn.MaxPool2d`` on integer input codes (exactly the fake-quant ``QuantMaxPool2d``)."""

    dims = 2
    _pool = staticmethod(F.max_pool2d)


class QuantizedMaxPool3d(_QuantizedMaxPoolNd):
    """``nn.MaxPool3d`` on integer input codes (exactly the fake-quant ``QuantMaxPool3d``)."""

    dims = 3
    _pool = staticmethod(F.max_pool3d)
