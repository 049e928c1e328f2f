"""The scale of a validated amax, in one launch on a GPU: the public functions' path from amax to scale.

:func:`checked_scale` is :func:`.checks.check_amax_values` followed by :func:`.scales.scale_from_amax`. On CUDA in
the deferred error mode (:mod:`.deferred_errors`) both run in one kernel of the extension (``scale_from_amax``,
block_kernels.cu, bit-exact against the torch expression), where the torch ops take ten small launches, and the
check's flag is queued by the returned ``after`` callable: the caller runs it once it has launched its quantization
kernel, so that the host work of queuing overlaps the kernel. On the CPU the native extension does both in one call
too (``checked_scale``, quant_cpu.cpp: twelve torch ops and their dispatch were most of a small tensor's fake quant)
and the error is raised here, with :func:`.checks.check_amax_values`'s message. A learnable amax (``requires_grad``),
torch.compile / torch.export / torch.jit tracing (the scale stays an expression of amax in the traced graph), the
sync error mode on a GPU and the reference backend take the torch ops, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import deferred_errors
from .backend import is_native_cuda, kernels_for
from .checks import _compiling, amax_error, check_amax_values, deferred_amax_messages
from .devices import device_type
from .scales import scale_from_amax


def _nothing() -> None:
    return None


def checked_scale(amax: torch.Tensor, bound: float, what: str = "amax") -> tuple[torch.Tensor, Callable[[], None]]:
    """``(scale, after)`` for a float32 ``amax`` shaped by :func:`.checks.as_amax` with ``check_values=False``:
    ``scale = scale_from_amax(amax, bound)`` once ``amax`` passed the value check (finite, >= 0; ValueError
    otherwise). Call ``after()`` after launching the kernel that uses ``scale``: it queues the deferred check."""
    # a learnable amax and torch.jit tracing keep the differentiable, traceable torch expression
    if not (amax.requires_grad or torch.jit.is_tracing()):
        # deferring(): CUDA, the deferred mode, not under torch.compile / torch.export (check_amax_values skips its
        # check there)
        if deferred_errors.deferring(amax):
            mod = kernels_for(device_type(amax))
            if is_native_cuda(mod):
                scale, flag = mod.scale_from_amax(amax, float(bound))

                def after() -> None:
                    deferred_errors.defer(flag, f"{what} check", deferred_amax_messages(what), amax)

                return scale, after
        elif amax.is_cpu and amax.dtype == torch.float32 and not _compiling():
            native = getattr(kernels_for("cpu"), "checked_scale", None)  # the reference module has none
            if native is not None:
                scale, bad = native(amax, float(bound))
                if bad >= 0:
                    raise ValueError(amax_error(what, amax.reshape(-1)[bad].item()))
                return scale, _nothing
    check_amax_values(amax, what)
    return scale_from_amax(amax, bound), _nothing
