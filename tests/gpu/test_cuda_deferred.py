"""Deferred value checks on a real GPU (functional/deferred_errors.py): a quantizer forward/backward of every format
makes no host synchronization in deferred mode (``torch.cuda.set_sync_debug_mode("error")`` raises on any), the
pinned ring and CUDA events deliver a NaN/Inf or bad-amax error at ``check_errors()``, and the sync mode raises it
at the call with the CPU path's message. Skipped without a GPU (conftest.py); tests/test_deferred_cuda_emulated.py
proves the same on the CPU with the host-emulated kernels and counts the ops.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from op_names import OpNames

from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.functional import backend, deferred_errors
from modelopt_lite.nn import TensorQuantizer

FORMATS = {
    "int8_per_tensor": lambda: QuantDescriptor(num_bits=8, amax=2.0),
    "int8_per_channel": lambda: QuantDescriptor(num_bits=8, axis=0, amax=[0.5 + 0.1 * i for i in range(16)]),
    "e4m3": lambda: QuantDescriptor(num_bits=(4, 3), amax=2.0),
    "nvfp4": lambda: QuantDescriptor(
        num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, amax=3.0
    ),
    "mxfp8": lambda: QuantDescriptor(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)}),
    "int4_dynamic_blocks": lambda: QuantDescriptor(num_bits=4, block_sizes={-1: 16, "type": "dynamic"}),
}


def _x(bad: bool = False) -> torch.Tensor:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    if bad:
        x[3, 40] = math.nan
    return x.cuda()


@pytest.fixture
def native(cuda_module):
    with backend.use_backend("native"), deferred_errors.error_checks("deferred"):
        yield cuda_module
        deferred_errors.check_errors()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_training_step_makes_no_host_sync(native, fmt):
    q = TensorQuantizer(FORMATS[fmt]()).cuda()
    x = _x().requires_grad_()
    q(x).sum().backward()  # warm-up: the device's ring (pinned slots, events) is allocated at the first check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = q(x)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with deferred_errors.error_checks("sync"):
        want = TensorQuantizer(FORMATS[fmt]()).cuda()(_x())
    assert torch.equal(y.detach(), want)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "int4_dynamic_blocks"])
def test_nonfinite_input_raises_at_check_errors_or_at_the_call(native, fmt):
    q = TensorQuantizer(FORMATS[fmt](), name="layer.input_quantizer").cuda()
    q(_x(bad=True))  # deferred: returns
    with pytest.raises(deferred_errors.DeferredValueError, match=r"^TensorQuantizer 'layer.input_quantizer': .*NaN"):
        deferred_errors.check_errors()
    with deferred_errors.error_checks("sync"), pytest.raises(ValueError, match=r"^TensorQuantizer 'layer.input_qu"):
        q(_x(bad=True))


def test_a_later_call_raises_once_the_copy_completed(native):
    bad = TensorQuantizer(FORMATS["mxfp8"](), name="bad").cuda()
    good = TensorQuantizer(FORMATS["mxfp8"](), name="good").cuda()
    bad(_x(bad=True))
    torch.cuda.synchronize()  # the flag's copy has landed: the next check polls it (event.query())
    with pytest.raises(deferred_errors.DeferredValueError, match=r"^TensorQuantizer 'bad': MX \(e4m3\) input"):
        good(_x())


def test_bad_amax_raises_at_check_errors(native):
    q = TensorQuantizer(FORMATS["int8_per_channel"](), name="w").cuda()
    q._amax.data[5] = -1.0
    q(_x())
    with pytest.raises(deferred_errors.DeferredValueError, match=r"^TensorQuantizer 'w': amax must be finite"):
        deferred_errors.check_errors()
    with deferred_errors.error_checks("sync"), pytest.raises(ValueError, match=r"got -1.0$"):
        q(_x())


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_nvfp4_amax_raises_at_check_errors(native, bad):
    """The NVFP4 kernel computes its global scale from the amax on the device and flags a bad one (a negative amax
    used to give a global scale of 0 and silent zeros in deferred mode)."""
    q = TensorQuantizer(FORMATS["nvfp4"](), name="w").cuda()
    q._amax.data.fill_(bad)
    q(_x())
    with pytest.raises(deferred_errors.DeferredValueError, match=r"^TensorQuantizer 'w': NVFP4 global amax must be"):
        deferred_errors.check_errors()
    with deferred_errors.error_checks("sync"), pytest.raises(ValueError, match=r"NVFP4 global amax must be finite"):
        q(_x())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_direct_eager_path_equals_the_op_on_the_gpu(native, fmt):
    """functional/eager.py on CUDA tensors: a quantizer's forward and backward through the direct path (no
    dispatcher layers) and through the op give the same output and gradient bit for bit."""

    def step(mode):
        q = TensorQuantizer(FORMATS[fmt]()).cuda()
        x = _x().requires_grad_()
        with mode:
            y = q(x)
            y.backward(torch.linspace(-1, 1, y.numel(), device="cuda").reshape(y.shape))
        return y.detach(), x.grad, type(y.grad_fn).__name__

    y, g, fn = step(contextlib.nullcontext())
    want, want_g, want_fn = step(OpNames())  # a dispatch mode that changes nothing: the op path
    assert fn.endswith("EagerBackward") and not want_fn.endswith("EagerBackward"), (fn, want_fn)
    assert torch.equal(y, want) and torch.equal(g, want_g)
