"""A TorchFunctionMode that fails on any true division of a tensor by a Python number.

On CUDA, PyTorch computes ``tensor / python_number`` as ``tensor * (1 / number)``, one ulp off the true quotient for
many inputs; the numerics contract promises true division, so the quantization paths divide by a tensor on the
dividend's device (``modelopt_lite.functional.division.true_div``). This guard catches the pattern on a CPU, where
both spellings give the same numbers.

Custom ops (``torch.ops.modelopt_lite.*``) hide their implementations from a mode: the mode is suspended while it
handles the op call. :func:`no_python_number_division` therefore also wraps the kernel modules the ops look up
(``kernels_for`` of the three op libraries), so the mode is active again inside every kernel the ops run.
"""

from __future__ import annotations

import contextlib
import numbers

import pytest
import torch
from torch.overrides import TorchFunctionMode

from modelopt_lite.functional import backend, library, library_minifloat, library_mx
from modelopt_lite.functional import microscaling as mx

#: every spelling of a true division (``/`` and ``/=`` arrive as ``Tensor.div`` / ``Tensor.div_``)
TRUE_DIVISIONS = {
    torch.Tensor.div,
    torch.Tensor.div_,
    torch.Tensor.__truediv__,
    torch.Tensor.__itruediv__,
    torch.Tensor.divide,
    torch.Tensor.divide_,
    torch.Tensor.true_divide,
    torch.Tensor.true_divide_,
    torch.div,
    torch.divide,
    torch.true_divide,
}


def _divisor(args, kwargs):
    if len(args) > 1:
        return args[1]
    return kwargs.get("other")


def _rounding_mode(args, kwargs):
    return args[2] if len(args) > 2 else kwargs.get("rounding_mode")


class PythonNumberDivisionError(AssertionError):
    """A tensor was divided by a Python number where true division is promised."""


class NoPythonNumberDivision(TorchFunctionMode):
    """Raise :class:`PythonNumberDivisionError` on ``tensor / number`` (every spelling; ``number / tensor`` and
    divisions with a ``rounding_mode`` are fine). ``seen`` counts the divisions checked (tensor divisors)."""

    def __init__(self):
        super().__init__()
        self.checked = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in TRUE_DIVISIONS
            and args
            and isinstance(args[0], torch.Tensor)
            and _rounding_mode(args, kwargs) is None
        ):
            d = _divisor(args, kwargs)
            if isinstance(d, numbers.Number):
                raise PythonNumberDivisionError(
                    f"{getattr(func, '__qualname__', func)}: a {args[0].dtype} tensor divided by the Python number "
                    f"{d!r}; on CUDA that is a multiplication by its reciprocal, not the true division the numerics "
                    "contract promises: divide by a tensor (modelopt_lite.functional.division.true_div)"
                )
            self.checked += 1
        return func(*args, **kwargs)


class _WatchedKernels:
    """The kernel module ``kernels_for`` gave, each function run with the mode active (the libraries' own pure-torch
    fallbacks, looked up when the module lacks a name, are wrapped too)."""

    def __init__(self, module, mode: NoPythonNumberDivision):
        self._module, self._mode = module, mode

    def __getattr__(self, name):
        fn = getattr(self._module, name, None) or getattr(mx, name, None) or library_minifloat._REFERENCE.get(name)
        if fn is None:
            raise AttributeError(name)

        def run(*args, **kwargs):
            with self._mode:
                return fn(*args, **kwargs)

        return run


@contextlib.contextmanager
def no_python_number_division():
    """Run a block with the pure-torch reference backend and the guard active (also inside the custom ops)."""
    mode = NoPythonNumberDivision()
    real = backend.kernels_for
    with pytest.MonkeyPatch.context() as mp, backend.use_backend("reference"):
        for lib in (library, library_minifloat, library_mx):
            mp.setattr(lib, "kernels_for", lambda device_type: _WatchedKernels(real(device_type), mode))
        with mode:
            yield mode
