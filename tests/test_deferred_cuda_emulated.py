"""The CUDA path of a TensorQuantizer forward issues no host read in deferred mode (issue 24: no host sync), proven
on the CPU with the host-emulated CUDA bindings (tests/emulated_build.py; opt-in: ``MODELOPT_LITE_TEST_EMULATED=1``).

The public API is routed to the emulated extension for CPU tensors exactly as it routes CUDA tensors to the real
one (``kernels_for``, ``is_native_cuda``, the fused block kernel, deferred checks for the "cpu" device type). A
TorchDispatchMode sees every aten op the forward issues, inside our custom ops and the C++ bindings too (it runs
the ops' bodies under itself), fails on a host read (``_local_scalar_dense``: ``.item()``, ``bool(tensor)``) and
counts the ops: the exact counts below are the launches (plus metadata-only ops) of one forward.
"""

from __future__ import annotations

import collections
import contextlib
import math
import re

import pytest
import torch
from emulated_build import OPT_IN, build, cuda_path_on_host
from op_names import OpNames
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.functional import (
    deferred_errors,
    library_mx,
    microscaling,
)
from modelopt_lite.nn import TensorQuantizer

pytestmark = OPT_IN

HOST_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"}
#: a ``torch.tensor(...)`` constant: on a GPU it is copied from pageable host memory, which synchronizes the stream
HOST_COPIES = {"aten::lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (by schema name) and fails on a host read; a ``modelopt_lite::`` op is
    counted, then its Python body runs under this mode so that its own ops are seen too. A ``torch.tensor``
    constant (HOST_COPIES) fails too: the fixture fills scalars on the device as on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.ops[name] += 1
        if name in HOST_READS:
            raise AssertionError(f"host read: {name}")
        if name in HOST_COPIES:
            raise AssertionError(f"host-to-device copy: {name}")
        if name.startswith("modelopt_lite::"):
            with self:
                return OPDEFS[name]._init_fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def emulated():
    return build()


@pytest.fixture
def on_emulated_cuda(emulated):
    """CPU tensors take the CUDA path: the emulated kernels, their routing and deferred value checks."""
    with cuda_path_on_host(emulated):
        with deferred_errors.error_checks("deferred"):
            yield emulated
            deferred_errors.check_errors()


def _nvfp4():
    return QuantDescriptor(num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}, amax=3.0)


def _mxfp8():
    return QuantDescriptor(num_bits=(4, 3), block_sizes={-1: 32, "type": "dynamic", "scale_bits": (8, 0)})


# the amax check and scale_from_amax in one launch (amax_scale.checked_scale: the binding's scale_from_amax allocates
# the scale and a zeroed flag), where the torch ops took ten: clamp, ne, any (checks.check_amax_values), full, div,
# le, masked_fill (scales.scale_from_amax) and ge, mul, where (its overflow guard for bounds such as 127)
_CHECKED_SCALE = {"aten::empty": 1, "aten::zeros": 1}
_RING = {"aten::copy_": 1}  # the flag's non_blocking copy into the host ring (deferred_errors.defer)
_QUANT_BINDING = {"aten::to": 1, "aten::reshape": 1, "aten::expand": 1, "aten::empty": 1}  # quant_cuda_binding
_FLAGGED_BINDING = {"aten::empty": 1, "aten::zeros": 1}  # output and flag (mx / block bindings)


def _ops(*parts: dict, **extra: int) -> dict[str, int]:
    out: collections.Counter[str] = collections.Counter()
    for p in parts:
        out.update(p)
    out.update({k.replace("__", "::").replace("_DOT_", "."): v for k, v in extra.items()})
    return dict(out)


#: descriptor factory -> the exact op counts of one forward on a (16, 64) float32 input (after a warm-up call);
#: every counted op but the metadata ones (view, reshape, expand, detach, to without a copy) is one launch on a GPU
FORMATS = {
    "int8_per_tensor": (
        lambda: QuantDescriptor(num_bits=8, amax=2.0),
        _ops(_CHECKED_SCALE, _RING, _QUANT_BINDING, modelopt_lite__fake_quant_int=1),
    ),
    "int8_per_channel": (
        lambda: QuantDescriptor(num_bits=8, axis=0, amax=[0.5 + 0.1 * i for i in range(16)]),
        _ops(_CHECKED_SCALE, _RING, _QUANT_BINDING, aten__view=1, modelopt_lite__fake_quant_int=1),
    ),
    "e4m3": (
        lambda: QuantDescriptor(num_bits=(4, 3), amax=2.0),
        _ops(_CHECKED_SCALE, _RING, _QUANT_BINDING, modelopt_lite__fake_e4m3=1),
    ),
    # the kernel computes the global scale from amax (fake_nvfp4_amax): no full, div, le, zeros_like, where
    "nvfp4": (
        _nvfp4,
        _ops(
            _FLAGGED_BINDING,
            _RING,
            {
                "aten::detach": 1,
                "aten::to": 1,
                "aten::reshape": 1,
            },  # the binding's view of amax as one float32 on x's device
            modelopt_lite__fake_nvfp4_amax=1,
        ),
    ),
    "mxfp8": (_mxfp8, _ops(_FLAGGED_BINDING, _RING, modelopt_lite__fake_mx=1)),
    "int4_dynamic_blocks": (
        lambda: QuantDescriptor(num_bits=4, block_sizes={-1: 16, "type": "dynamic"}),
        _ops(_FLAGGED_BINDING, _RING, modelopt_lite__fake_block_dynamic=1),
    ),
    # a static block amax: its check, the scale and the quantization in the fused kernel (one launch), where the
    # unfused path launched the scale kernel and the per-block quantization kernel
    "int4_static_blocks": (
        lambda: QuantDescriptor(
            num_bits=4, block_sizes={-1: 16}, amax=(torch.arange(64).reshape(16, 4) * 0.05 + 0.5).tolist()
        ),
        _ops(_FLAGGED_BINDING, _RING, modelopt_lite__fake_block_static=1),
    ),
}


def _x():
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(0))


def _count(q, x):
    with OpCounter() as c:
        y = q(x)
    return y, dict(c.ops)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_forward_makes_no_host_read_and_counts_its_ops(on_emulated_cuda, fmt):
    make, _ = FORMATS[fmt]
    q = TensorQuantizer(make())
    x = _x()
    q(x)  # warm-up: the ring of the device is allocated at the first deferred check
    y, ops = _count(q, x)
    with deferred_errors.error_checks("sync"):
        want = TensorQuantizer(make())(x)
    assert torch.equal(y, want)  # deferral changes no numerics
    assert not (HOST_READS | HOST_COPIES) & set(ops)
    assert ops == FORMATS[fmt][1]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sync_mode_reads_the_flag_at_the_call(on_emulated_cuda, fmt):
    """The sync mode is today's behaviour: at least one host read per forward (the counter fails on it)."""
    make, _ = FORMATS[fmt]
    q = TensorQuantizer(make())
    with deferred_errors.error_checks("sync"), pytest.raises(AssertionError, match="host read"):
        _count(q, _x())


@pytest.mark.parametrize("fmt", ["int8_per_tensor", "nvfp4", "mxfp8", "int4_dynamic_blocks", "int4_static_blocks"])
def test_training_step_makes_no_host_read(on_emulated_cuda, fmt):
    """Forward and backward (the QAT step) in deferred mode: no host read either (backward kernels flag too)."""
    q = TensorQuantizer(FORMATS[fmt][0]())
    x = _x().requires_grad_()
    q(x).sum().backward()
    x.grad = None
    with OpCounter() as c:
        q(x).sum().backward()
    assert not HOST_READS & set(c.ops)
    assert x.grad is not None and x.grad.shape == x.shape


class PendingEvents:
    """Copies that complete only at a synchronization (check_errors): the asynchronous case."""

    def host_slots(self, capacity, device):
        return torch.zeros(capacity, dtype=torch.int32)

    def new_event(self, device):
        return PendingEvent()


class PendingEvent:
    done = False

    def record(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def _bad_x():
    x = _x()
    x[3, 40] = math.nan
    return x


#: format -> (deferred message, sync-mode message: today's, raised at the call)
NONFINITE = {
    "nvfp4": (
        r"NVFP4 input contains NaN or Inf; NVFP4/MX formats cannot represent it: clean the input \[detected "
        r"asynchronously: this error belongs to an earlier call, fake_nvfp4 on a 16x64 float32 tensor",
        r"NVFP4 input contains NaN or Inf \(nan\); NVFP4/MX formats cannot represent it: clean the input$",
    ),
    "mxfp8": (
        r"MX \(e4m3\) input contains NaN or Inf; NVFP4/MX formats cannot represent it: clean the input \[detected "
        r"asynchronously: this error belongs to an earlier call, fake_mx on a 16x64 float32 tensor",
        r"MX \(e4m3\) input contains NaN or Inf \(nan\); NVFP4/MX formats cannot represent it: clean the input$",
    ),
    "int4_dynamic_blocks": (
        r"the input contains NaN or Inf, so its block amax is not finite; clean the input \[detected asynchronously: "
        r"this error belongs to an earlier call, fake_block_dynamic on a 16x64 float32 tensor",
        r"the input contains NaN or Inf, so its block amax is not finite \(block \(3, 2\) of \(16, 4\) blocks has "
        r"amax nan\); clean the input$",
    ),
}


@pytest.mark.parametrize("fmt", list(NONFINITE))
def test_nonfinite_input_raises_at_check_errors_or_at_the_call(on_emulated_cuda, fmt):
    deferred_msg, sync_msg = NONFINITE[fmt]
    q = TensorQuantizer(FORMATS[fmt][0](), name="layer.input_quantizer")
    with deferred_errors.use_event_backend(PendingEvents(), "cpu"):
        y = q(_bad_x())  # deferred: returns; the error is pending
        assert y.shape == (16, 64) and deferred_errors.pending() == 1
        q(_x())  # a later call does not wait for it either
        with pytest.raises(
            deferred_errors.DeferredValueError, match="^TensorQuantizer 'layer.input_quantizer': " + deferred_msg
        ):
            deferred_errors.check_errors()
        assert deferred_errors.pending() == 0
    with deferred_errors.error_checks("sync"):
        with pytest.raises(ValueError, match="^TensorQuantizer 'layer.input_quantizer': " + sync_msg) as info:
            q(_bad_x())
        assert not isinstance(info.value, deferred_errors.DeferredValueError)


def test_bad_amax_raises_at_check_errors_or_at_the_call(on_emulated_cuda):
    q = TensorQuantizer(QuantDescriptor(num_bits=8, axis=0, amax=[0.5 + 0.1 * i for i in range(16)]), name="w")
    q._amax.data[5] = -1.0  # as a learned amax gone negative (the setter refuses it)
    with deferred_errors.use_event_backend(PendingEvents(), "cpu"):
        q(_x())
        with pytest.raises(
            deferred_errors.DeferredValueError,
            match=r"^TensorQuantizer 'w': amax must be finite and >= 0 \(NaN, Inf or < 0\) \[detected asynchronously",
        ):
            deferred_errors.check_errors()
    with (
        deferred_errors.error_checks("sync"),
        pytest.raises(ValueError, match=r"^TensorQuantizer 'w': amax must be finite and >= 0, got -1.0$"),
    ):
        q(_x())


def test_bad_static_block_amax_raises_the_unfused_paths_errors(on_emulated_cuda, monkeypatch):
    """A static block amax gone NaN: the fused kernel's flag gives the unfused path's deferred error (same op name,
    message and shape) and, in sync mode, its ValueError naming the first bad value."""
    from modelopt_lite.functional import library_block_cuda

    def run(fused: bool) -> tuple[str, str]:
        q = TensorQuantizer(FORMATS["int4_static_blocks"][0](), name="w")
        q._amax.data[7, 2] = math.nan
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(library_block_cuda, "FUSED_DEVICE_TYPES", ("cuda",))
            with deferred_errors.use_event_backend(PendingEvents(), "cpu"):
                q(_x())
                with pytest.raises(deferred_errors.DeferredValueError) as deferred:
                    deferred_errors.check_errors()
            with deferred_errors.error_checks("sync"), pytest.raises(ValueError) as sync:
                q(_x())
        return str(deferred.value), str(sync.value)

    fused, unfused = run(True), run(False)
    assert fused == unfused
    assert fused[0].startswith(
        "TensorQuantizer 'w': block amax must be finite and >= 0 (NaN, Inf or < 0) [detected asynchronously: this "
        "error belongs to an earlier call, block amax check on a 16x4 float32 tensor"
    )
    assert fused[1] == "TensorQuantizer 'w': block amax must be finite and >= 0, got nan"


def test_checked_scale_keeps_a_learnable_amax_differentiable(on_emulated_cuda):
    """amax_scale.checked_scale: a plain amax takes the one-launch native scale (no torch scale ops), a learnable one
    (requires_grad) the torch expression, so that its gradient flows; both give the sync mode's output."""
    from modelopt_lite import tensor_quant as tq

    x, fixed = _x(), torch.tensor(2.0)
    tq.fake_tensor_quant(x, fixed, 8)  # warm-up: the ring of the device is allocated at the first deferred check
    with OpCounter() as c:
        y = tq.fake_tensor_quant(x, fixed, 8)
    assert "aten::div" not in c.ops and c.ops["aten::zeros"] == 1
    amax = torch.tensor(2.0, requires_grad=True)
    with OpCounter() as c:
        y_learn = tq.fake_tensor_quant(x, amax, 8)
    assert c.ops["aten::div"] == 1  # scales.scale_from_amax on the device
    y_learn.sum().backward()
    assert amax.grad is not None and amax.grad.dtype == torch.float32 and amax.grad.shape == ()
    with deferred_errors.error_checks("sync"):
        want = tq.fake_tensor_quant(x, fixed, 8)
    assert torch.equal(y, want) and torch.equal(y_learn.detach(), want)


def _uint8():
    return QuantDescriptor(num_bits=8, unsigned=True, amax=2.0)


def test_unsigned_input_check_is_the_kernels_own_pass(on_emulated_cuda):
    """An unsigned quantizer on CUDA: the kernel flags a negative or NaN element in its quantizing pass (no amin
    over the input, no host read); the flag raises asynchronously when deferred, at the call in sync mode, with the
    messages of the separate check (checks.check_unsigned_input)."""
    q = TensorQuantizer(_uint8())
    x = _x().abs()
    q(x)
    y, ops = _count(q, x)
    with deferred_errors.error_checks("sync"):
        assert torch.equal(y, TensorQuantizer(_uint8())(x))
    # the binding's flag and its deferral (a second ring slot); no aten::amin over the input
    assert ops == _ops(_CHECKED_SCALE, _RING, _RING, _QUANT_BINDING, aten__zeros=1, modelopt_lite__fake_quant_uint=1)
    for bad, sync_error in ((-0.5, "Negative values encountered"), (float("nan"), "contains NaN")):
        x2 = x.clone()
        x2[3, 17] = bad
        # raised by a later deferred check or check_errors() (the host emulation's copies complete at once)
        with pytest.raises(deferred_errors.DeferredValueError, match="negative value or NaN.*unsigned input check"):
            q(x2)
            deferred_errors.check_errors()
        with deferred_errors.error_checks("sync"), pytest.raises(ValueError, match=sync_error):
            q(x2)
    x3 = x.clone()
    x3[0, 0] = -0.0
    q(x3)
    deferred_errors.check_errors()  # -0.0 passes


@pytest.mark.parametrize("bad", [-1.0, -1e-30, math.nan, math.inf])
def test_bad_nvfp4_amax_raises_at_check_errors_or_at_the_call(on_emulated_cuda, bad):
    """NVFP4 on CUDA: the kernel computes the global scale from the amax (fake_nvfp4_amax) and flags a bad amax. The
    deferred mode used to turn a negative amax into a global scale of 0 (every output 0, no error)."""
    q = TensorQuantizer(_nvfp4(), name="w")
    q._amax.data.fill_(bad)  # as a learned amax gone bad (the setter refuses it)
    with deferred_errors.use_event_backend(PendingEvents(), "cpu"):
        assert q(_x()).shape == (16, 64)  # deferred: returns; the error is pending
        assert deferred_errors.pending() == 1
        with pytest.raises(
            deferred_errors.DeferredValueError,
            match=r"^TensorQuantizer 'w': NVFP4 global amax must be finite and >= 0 \[detected asynchronously: "
            r"this error belongs to an earlier call, fake_nvfp4 on a 16x64 float32 tensor",
        ):
            deferred_errors.check_errors()
    with (
        deferred_errors.error_checks("sync"),
        pytest.raises(
            ValueError,
            match=rf"^TensorQuantizer 'w': NVFP4 global amax must be finite and >= 0, got {re.escape(repr(float(torch.tensor(bad))))}$",
        ),
    ):
        q(_x())


def test_nvfp4_global_scale_is_the_kernels_in_the_training_step(on_emulated_cuda):
    """The deferred NVFP4 forward and backward compute the global scale in their kernels: no scale ops (full, div,
    where) and the reference's output and gradient bit for bit; -0.0 and a dead amax pass."""
    for amax in (3.0, -0.0, 1e-30):
        x, a = _x().requires_grad_(), torch.tensor(amax)
        with OpCounter() as c:
            y = library_mx.nvfp4_fake_quant(x, a, 16)
            y.backward(torch.ones_like(y))
        assert c.ops["modelopt_lite::fake_nvfp4_amax"] == 1 and c.ops["modelopt_lite::nvfp4_backward_amax"] == 1
        assert not {"aten::div", "aten::full", "aten::where"} & set(c.ops)
        deferred_errors.check_errors()
        gs = microscaling.nvfp4_global_scale(torch.tensor(amax))
        assert torch.equal(y, microscaling.fake_nvfp4(x.detach(), gs, 16))
        want = microscaling.nvfp4_backward(torch.ones(16, 64), x.detach(), gs, 16)
        assert x.grad is not None and torch.equal(x.grad, want)


def test_jit_tracing_does_not_defer(on_emulated_cuda):
    """torch.jit tracing (the TorchScript ONNX exporter) checks at once: no flag copy into the host ring is traced."""
    x = _x()
    assert deferred_errors.deferring(x)
    seen = []

    def fn(t):
        seen.append(deferred_errors.deferring(t))
        return t * 2

    torch.jit.trace(fn, (x,), check_trace=False)
    assert seen == [False]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_direct_eager_path_equals_the_op(on_emulated_cuda, fmt):
    """functional/eager.py on the CUDA path: a quantizer's forward and backward through the direct path and through
    the op give the same output and gradient bit for bit (tests/gpu/test_cuda_deferred.py runs it on a GPU)."""

    def step(mode):
        q = TensorQuantizer(FORMATS[fmt][0]())
        x = _x().requires_grad_()
        with mode:
            y = q(x)
            y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        return y.detach(), x.grad, type(y.grad_fn).__name__

    y, g, fn = step(contextlib.nullcontext())
    want, want_g, want_fn = step(OpNames())  # a dispatch mode that changes nothing: the op path
    assert fn.endswith("EagerBackward") and not want_fn.endswith("EagerBackward"), (fn, want_fn)
    assert torch.equal(y, want) and torch.equal(g, want_g)
