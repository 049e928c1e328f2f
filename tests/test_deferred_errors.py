"""Deferred value checks (modelopt_lite/functional/deferred_errors.py): the flag ring, its polling, flushing and the
two modes, with a fake event backend (``query()`` under the test's control) standing in for CUDA events.

CPU tensors never defer; these tests route "cpu" through the ring (``DEFER_DEVICE_TYPES``) with the fake backend.
"""

from __future__ import annotations

import math

import pytest
import torch

from modelopt_lite.descriptor import QuantDescriptor
from modelopt_lite.functional import deferred_errors as de
from modelopt_lite.functional.checks import check_amax_values
from modelopt_lite.nn import TensorQuantizer

MSG = {1: "NVFP4 input contains NaN or Inf", 2: "NVFP4 global amax must be finite"}


class FakeEvent:
    def __init__(self, log: list):
        self.done = False
        self.records = 0
        self.syncs = 0
        self.log = log

    def record(self):
        self.done = False
        self.records += 1
        self.log.append(self)

    def query(self):
        return self.done

    def synchronize(self):
        self.syncs += 1
        self.done = True


class FakeEvents:
    def __init__(self):
        self.events: list[FakeEvent] = []
        self.slots: list[torch.Tensor] = []
        self.log: list[FakeEvent] = []  # the events in the order they were recorded

    def host_slots(self, capacity, device):
        t = torch.zeros(capacity, dtype=torch.int32)
        self.slots.append(t)
        return t

    def new_event(self, device):
        e = FakeEvent(self.log)
        self.events.append(e)
        return e


@pytest.fixture
def fake(monkeypatch):
    """CPU tensors deferred through the fake backend, in deferred mode; nothing pending before or after."""
    monkeypatch.setattr(de, "DEFER_DEVICE_TYPES", ("cpu",))
    backend = FakeEvents()
    with de.use_event_backend(backend, "cpu"), de.error_checks("deferred"):
        yield backend
        for e in backend.events:
            e.done = True
        try:
            de.check_errors()
        except de.DeferredValueError:
            pass
    assert de.pending() == 0


def _flag(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int32)


X = torch.zeros(4, 8)


def test_error_is_raised_by_a_later_check_once_its_copy_completed(fake):
    with de.label("TensorQuantizer 'layer.weight_quantizer'"):
        de.defer(_flag(1), "fake_nvfp4", MSG, X)  # bad, but its copy has not completed: nothing raised
    de.defer(_flag(0), "fake_mx", MSG, X)
    assert de.pending() == 2
    de.poll()  # nothing completed yet
    fake.log[0].done = True  # the first call's copy completes
    with pytest.raises(de.DeferredValueError) as info:
        de.defer(_flag(0), "fake_mx", MSG, torch.zeros(2, 3, dtype=torch.float16))
    text = str(info.value)
    assert isinstance(info.value, ValueError)
    assert text.startswith(
        "TensorQuantizer 'layer.weight_quantizer': NVFP4 input contains NaN or Inf [detected "
        "asynchronously: this error belongs to an earlier call, fake_nvfp4 on a 4x8 float32 tensor "
        "(check #1 on this device), and was raised at a later check; run with "
        "modelopt_lite.set_error_checks('sync')"
    )
    assert "global amax" not in text  # only the set bit's message
    assert de.pending() == 2  # the two later checks are still in flight
    for e in fake.events:
        e.done = True
    de.check_errors()  # both fine
    assert de.pending() == 0


class InstantEvent(FakeEvent):
    """A copy that lands before the call returns (a fast GPU and a tiny tensor: the first H200 run)."""

    def record(self):
        super().record()
        self.done = True


def test_own_check_is_never_raised_by_its_own_call_even_when_its_copy_landed(fake):
    fake.new_event = lambda device: InstantEvent(fake.log)
    with de.use_event_backend(fake, "cpu"):
        with de.label("TensorQuantizer 'bad'"):
            de.defer(_flag(1), "fake_mx", MSG, X)  # deferred mode: this call returns although its flag is known
        assert de.pending() == 1
        with pytest.raises(de.DeferredValueError, match=r"^TensorQuantizer 'bad': NVFP4 input .*\(check #1 on"):
            de.defer(_flag(0), "fake_mx", MSG, X)  # the next call raises the earlier one's error
        assert de.pending() == 1  # its own check stays queued
        de.check_errors()
        assert de.pending() == 0


def test_condition_bits_name_their_messages(fake):
    de.defer(_flag(3), "fake_nvfp4", MSG, X)
    with pytest.raises(de.DeferredValueError, match=r"^NVFP4 input contains NaN or Inf; NVFP4 global amax must be"):
        de.check_errors()
    de.defer(_flag(2), "fake_nvfp4", MSG, X)
    with pytest.raises(de.DeferredValueError, match=r"^NVFP4 global amax must be finite \[detected"):
        de.check_errors("cpu")


def test_check_errors_waits_and_raises_then_is_clear(fake):
    de.defer(_flag(0), "op_a", MSG, X)
    de.defer(_flag(1), "op_b", MSG, X)
    de.defer(_flag(1), "op_c", MSG, X)
    with pytest.raises(de.DeferredValueError, match=r"op_b on a 4x8 float32 tensor \(check #2 on this device\)"):
        de.check_errors()
    assert sum(e.syncs for e in fake.events) == 3  # waited for every copy
    de.check_errors()  # nothing left: op_c's error was reported with op_b's
    de.defer(_flag(1), "op_d", MSG, X)
    de.defer(_flag(1), "op_e", MSG, X)
    de.defer(_flag(0), "op_f", MSG, X)
    de.defer(_flag(1), "op_g", MSG, X)
    for e in fake.log[3:6]:  # op_d, op_e, op_f complete; op_g still in flight
        e.done = True
    with pytest.raises(de.DeferredValueError, match=r"op_d .*offending call\] \(1 later check\(s\) on this device"):
        de.poll()
    with pytest.raises(de.DeferredValueError, match=r"op_g .*call\]$"):
        de.check_errors()
    de.check_errors(torch.device("cpu"))
    assert de.pending() == 0


def test_ring_is_bounded_a_full_ring_waits_for_its_oldest_event(fake):
    n = de.RING_SIZE
    for _ in range(n):
        de.defer(_flag(0), "op", MSG, X)
    assert de.pending() == n and sum(e.syncs for e in fake.events) == 0
    de.defer(_flag(0), "op", MSG, X)  # full: waits for the oldest copy, reuses its slot
    assert de.pending() == n
    assert [e.syncs for e in fake.events].count(1) == 1
    assert len(fake.events) == n and len(fake.slots) == 1  # preallocated: no growth
    for _ in range(3 * n):
        de.defer(_flag(0), "op", MSG, X)
    assert de.pending() == n and len(fake.events) == n


def test_full_ring_raises_the_error_it_waited_for(fake):
    de.defer(_flag(1), "first_op", MSG, X)
    for _ in range(de.RING_SIZE - 1):
        de.defer(_flag(0), "op", MSG, X)
    with pytest.raises(de.DeferredValueError, match="first_op"):
        de.defer(_flag(0), "op", MSG, X)


def test_sync_mode_raises_at_the_call_and_flushes_pending_on_entry(fake):
    de.defer(_flag(1), "deferred_op", MSG, X)
    with pytest.raises(de.DeferredValueError, match="deferred_op"):
        de.set_error_checks("sync")  # nothing pending is lost
    assert de.get_error_checks() == "deferred"  # the switch did not happen
    de.set_error_checks("sync")
    try:
        assert not de.deferring(X)
        calls = []
        de.check_flag(_flag(0), lambda: calls.append(1), "op", MSG, X)
        assert calls == [] and de.pending() == 0

        def now():
            raise ValueError("the sync mode's own message")

        with pytest.raises(ValueError, match="^the sync mode's own message$"):
            de.check_flag(_flag(1), now, "op", MSG, X)
        with pytest.raises(ValueError, match=r"^amax must be finite and >= 0, got nan$"):
            check_amax_values(torch.tensor([1.0, math.nan]))
    finally:
        de.set_error_checks("deferred")


def test_leaving_a_deferred_block_for_sync_mode_raises_its_pending_errors(fake):
    with de.error_checks("sync"):
        with pytest.raises(de.DeferredValueError, match="inner_op"):
            with de.error_checks("deferred"):
                de.defer(_flag(1), "inner_op", MSG, X)  # pending at the block's end
        assert de.get_error_checks() == "sync" and de.pending() == 0
    assert de.get_error_checks() == "deferred"


def test_modes_and_context_manager():
    assert de.get_error_checks() == "deferred"
    with pytest.raises(ValueError, match=r"error checks must be one of \('sync', 'deferred'\), got 'async'"):
        de.set_error_checks("async")
    with pytest.raises(RuntimeError):
        with de.error_checks("sync"):
            assert de.get_error_checks() == "sync"
            raise RuntimeError
    assert de.get_error_checks() == "deferred"
    import modelopt_lite

    assert modelopt_lite.set_error_checks is de.set_error_checks
    assert modelopt_lite.check_errors is de.check_errors
    assert modelopt_lite.error_checks is de.error_checks


def test_cpu_tensors_never_defer():
    """The default: only CUDA tensors defer; a CPU check raises at the call in both modes."""
    assert de.DEFER_DEVICE_TYPES == ("cuda",)
    for mode in ("deferred", "sync"):
        with de.error_checks(mode):
            assert not de.deferring(X)
            with pytest.raises(ValueError, match=r"^amax must be finite and >= 0, got -1.0$"):
                check_amax_values(torch.tensor(-1.0))
            q = TensorQuantizer(QuantDescriptor(num_bits=8, dynamic=True))
            with pytest.raises(ValueError, match="dynamic amax is not finite"):
                q(torch.tensor([1.0, math.inf]))
    assert de.pending() == 0


def test_amax_check_on_device_defers(fake):
    check_amax_values(torch.tensor([1.0, 2.0]), "block amax")
    check_amax_values(torch.tensor([1.0, -2.0]), "block amax")
    with pytest.raises(
        de.DeferredValueError,
        match=r"^block amax must be finite and >= 0 \(NaN, Inf or < 0\) .*"
        r"block amax check on a 2 float32 tensor \(check #2",
    ):
        de.check_errors()
    for bad in (math.nan, math.inf, -math.inf):
        check_amax_values(torch.tensor([bad]))
        with pytest.raises(de.DeferredValueError):
            de.check_errors()


def test_quantizer_error_keeps_the_label_of_its_own_call(fake):
    """A dynamic quantizer fed NaN: its deferred error names it, and another quantizer's call that raises it does
    not prefix its own name; the amax reader of a quantizer is a sync point."""
    bad = TensorQuantizer(QuantDescriptor(num_bits=8, dynamic=True), name="a.input_quantizer")
    good = TensorQuantizer(QuantDescriptor(num_bits=8, dynamic=True), name="b.input_quantizer")
    y = bad(torch.tensor([1.0, math.nan]))  # no raise: deferred
    assert y.shape == (2,)
    for e in fake.events:
        e.done = True
    with pytest.raises(de.DeferredValueError) as info:
        good(torch.tensor([1.0, 2.0]))
    assert str(info.value).startswith(
        "TensorQuantizer 'a.input_quantizer': the input contains NaN or Inf, so its dynamic amax is not finite "
        "[detected asynchronously: this error belongs to an earlier call, dynamic amax on a 2 float32 tensor"
    )
    static = TensorQuantizer(QuantDescriptor(num_bits=8, amax=2.0), name="c")
    bad(torch.tensor([math.inf]))
    with pytest.raises(de.DeferredValueError, match="'a.input_quantizer'"):
        _ = static.amax  # a reader: waits and raises what is pending
    assert float(static.amax) == 2.0


def test_unsigned_input_check_on_device_defers(fake):
    """No kernel flags a negative input to an unsigned grid: the flag is computed on the device (amin >= 0)."""
    from modelopt_lite import tensor_quant as tq
    from modelopt_lite.functional.backend import use_backend

    with use_backend("reference"):  # the separate check (the native CPU kernels fuse it into their pass)
        tq.fake_tensor_quant(torch.tensor([0.0, 3.0]), 4.0, unsigned=True)
        de.check_errors()
        for bad in (-1.0, math.nan):
            tq.fake_tensor_quant(torch.tensor([bad, 3.0]), 4.0, unsigned=True)  # deferred: no raise here
            with pytest.raises(de.DeferredValueError, match=r"^unsigned quantization of inputs: the input holds a neg"):
                de.check_errors()


def test_cuda_event_stream_object_is_reused_while_the_current_stream_stays(monkeypatch):
    """_current_stream (what every CUDA deferred check records its event on): one Stream object per device while
    the device's current stream id is unchanged, a fresh one when it changes (stand-ins: no GPU here)."""
    ids = {0: 11, 1: 21}
    made = []

    def current_stream(device):
        made.append((device.index, ids[device.index]))
        return ("stream", device.index, ids[device.index])

    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda i: (ids[i], i, 1), raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(de, "_streams", {})
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = de._current_stream(d0)
    assert first == ("stream", 0, 11) and de._current_stream(d0) is first
    assert de._current_stream(d1) == ("stream", 1, 21)
    ids[0] = 12  # e.g. inside `with torch.cuda.stream(s):`
    assert de._current_stream(d0) == ("stream", 0, 12)
    assert made == [(0, 11), (1, 21), (0, 12)]
