"""Deferred value checks for CUDA tensors: bad values (NaN/Inf inputs, bad amax) raise without a host sync per call.

CUDA reports its own kernel faults asynchronously; this module does the same for the value errors of our ops.
A kernel (or a few device ops) writes an int32 *flag* (0: fine; bit ``b`` set: condition ``b``) on the device.
In ``"deferred"`` mode (the default for CUDA tensors) :func:`defer` copies the flag ``non_blocking`` into a slot of
a preallocated host ring (pinned memory, one per device), records an event after the copy and keeps the message
context (the op, the quantizer from :func:`label`, the shape and dtype, a call number). Every later deferred call on
that device and :func:`poll` look at the completed slots without synchronizing (``event.query()``) and raise
:class:`DeferredValueError` (a ValueError) for the first set flag: it names the quantizer, the op and the call it came
from, says it was detected asynchronously, and how to get it raised at the offending call. A full ring waits for its
oldest event (bounded memory). :func:`check_errors` synchronizes and raises what is pending; the library calls it
at its natural sync points (end of calibration, export, save and load of quantizer state, amax readers).

``"sync"`` mode (:func:`set_error_checks`, the :func:`error_checks` context manager) reads every flag at once and
raises the same ValueError as the CPU path, at the offending call. CPU tensors never defer: their checks raise at
the call in both modes. No environment variable is read or written.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .devices import device_type

MODES = ("sync", "deferred")
#: Device types whose checks are deferred in "deferred" mode (the host-emulated tests add "cpu").
DEFER_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
RING_SIZE = 64  # flag slots per device: at most this many checks in flight before one waits

_state = {"mode": "deferred"}
_label: contextvars.ContextVar[Callable[[], str] | str | None] = contextvars.ContextVar(
    "modelopt_lite_error_label", default=None
)
_lock = threading.RLock()


class DeferredValueError(ValueError):
    """A value error of an earlier call on a CUDA device, detected asynchronously (see :mod:`.deferred_errors`).
    Callers that prefix errors with their own name leave it as it is: it belongs to the call it names."""


# --- mode ----------------------------------------------------------------------------------------------------------
def get_error_checks() -> str:
    """``"deferred"`` (default) or ``"sync"``: how value checks of CUDA tensors raise."""
    return _state["mode"]


def set_error_checks(mode: str) -> None:
    """``"sync"``: every CUDA value check reads its flag at once and raises at the offending call (one host sync
    per quantizer call; for debugging). ``"deferred"``: flags are read asynchronously (see the module doc).
    Switching to ``"sync"`` first raises what is pending (:func:`check_errors`), so nothing is lost."""
    if mode not in MODES:
        raise ValueError(f"error checks must be one of {MODES}, got {mode!r}")
    if mode == "sync" and _state["mode"] == "deferred":
        check_errors()
    _state["mode"] = mode


@contextlib.contextmanager
def error_checks(mode: str) -> Iterator[None]:
    """Run a block with the given error-check mode, restoring the previous one on exit (even on exceptions). Back
    from "deferred" to "sync" after a normal exit, the block's pending errors are raised (:func:`check_errors`)."""
    previous = get_error_checks()
    set_error_checks(mode)
    try:
        yield
    except BaseException:
        _state["mode"] = previous
        raise
    try:
        if previous == "sync" and mode == "deferred":
            check_errors()
    finally:
        _state["mode"] = previous


def deferring(t: torch.Tensor) -> bool:
    """Whether checks of values on ``t``'s device are deferred now (deferred mode, a CUDA tensor, eager: not while
    torch.compile / torch.export trace, where the value checks do not run, nor under torch.jit tracing (the
    TorchScript ONNX exporter), whose graph must not record the flag's copy into the host ring)."""
    if _state["mode"] != "deferred" or device_type(t) not in DEFER_DEVICE_TYPES:
        return False
    return not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch._C._is_tracing())


class _Label:
    def __init__(self, name: Callable[[], str] | str):
        self.name = name
        self.token: contextvars.Token | None = None

    def __enter__(self) -> None:
        self.token = _label.set(self.name)

    def __exit__(self, *exc) -> None:
        assert self.token is not None
        _label.reset(self.token)


def label(name: Callable[[], str] | str) -> contextlib.AbstractContextManager:
    """A context manager naming the caller (a quantizer: a string, or a callable evaluated only when an error is
    raised) in the deferred errors of the checks run inside it. A no-op under torch.compile / torch.export (no
    value checks run there, and dynamo cannot trace a ContextVar)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return contextlib.nullcontext()
    return _Label(name)


def current_label() -> str | None:
    v = _label.get()
    return v() if callable(v) else v


# --- event backends ------------------------------------------------------------------------------------------------
class _CudaEvents:
    """Pinned host slots and CUDA events recorded on the device's current stream."""

    def host_slots(self, capacity: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(capacity, dtype=torch.int32, pin_memory=True)

    def new_event(self, device: torch.device):
        return _CudaEvent(device)


#: device index -> (the current stream's id, its torch.cuda.Stream): see _current_stream
_streams: dict[int, tuple[int, object]] = {}


def _current_stream(device: torch.device):
    """``torch.cuda.current_stream(device)``, the Python object reused while the device's current stream stays the
    same: building one (device index parsing, a Stream object) is most of the host time of recording an event, which
    every deferred check does. One C call compares the current stream's id."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = getattr(torch._C, "_cuda_getCurrentStream", None)
    if current is None:
        return torch.cuda.current_stream(device)
    sid = current(index)[0]
    hit = _streams.get(index)
    if hit is not None and hit[0] == sid:
        return hit[1]
    stream = torch.cuda.current_stream(device)
    _streams[index] = (sid, stream)
    return stream


class _CudaEvent:
    def __init__(self, device: torch.device):
        self.device = device
        self.event = torch.cuda.Event()

    def record(self) -> None:
        self.event.record(_current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


class _HostEvents:
    """Host tensors (the host-emulated kernels): a copy is complete when it returns."""

    def host_slots(self, capacity: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(capacity, dtype=torch.int32)

    def new_event(self, device: torch.device):
        return _DoneEvent()


class _DoneEvent:
    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_backends: dict[str, object] = {"cuda": _CudaEvents()}
_DEFAULT_BACKEND = _HostEvents()


@contextlib.contextmanager
def use_event_backend(backend, device_type: str = "cpu") -> Iterator[None]:
    """Tests: use ``backend`` (``host_slots(capacity, device)``, ``new_event(device)`` with ``record()``,
    ``query()``, ``synchronize()``) for the rings of ``device_type``; the rings are rebuilt before and after."""
    previous = _backends.get(device_type)
    with _lock:
        _rings.clear()
        _backends[device_type] = backend
    try:
        yield
    finally:
        with _lock:
            _rings.clear()
            if previous is None:
                _backends.pop(device_type, None)
            else:
                _backends[device_type] = previous


# --- the rings -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Context:
    """What a deferred error says about the call it came from."""

    op: str
    messages: Mapping[int, str]  # condition bit -> the error text (as the sync mode's, without the bad value)
    shape: tuple[int, ...]
    dtype: torch.dtype
    label: Callable[[], str] | str | None
    call: int


#: Context's fields but ``call``: what a pending check keeps (the Context is built only for a failed one)
_Info = tuple[str, Mapping[int, str], tuple[int, ...], torch.dtype, "Callable[[], str] | str | None"]


class _Ring:
    def __init__(self, device: torch.device, backend):
        self.device = device
        self.host = backend.host_slots(RING_SIZE, device)
        self.values = self.host.numpy()  # read without dispatching a torch op
        self.views = [self.host[i : i + 1] for i in range(RING_SIZE)]
        self.events = [backend.new_event(device) for _ in range(RING_SIZE)]
        self.free = list(range(RING_SIZE - 1, -1, -1))
        self.pending: collections.deque[tuple[int, int, _Info]] = collections.deque()  # (slot, call, info)
        self.calls = 0

    def push(self, flag: torch.Tensor, info: _Info) -> tuple[Context, int, int] | None:
        """Queue ``flag`` of the call described by ``info`` (Context's fields up to ``label``); the first error of the
        slots retired to make room (a full ring waits for its oldest)."""
        found = None
        if not self.free:  # full: wait for the oldest copy (bounded memory), then take its slot
            self.events[self.pending[0][0]].synchronize()
            found = self.collect(block=False)
        slot = self.free.pop()
        self.views[slot].copy_(flag, non_blocking=True)
        self.events[slot].record()
        self.calls += 1
        self.pending.append((slot, self.calls, info))
        return found

    def collect(self, block: bool, before: int | None = None) -> tuple[Context, int, int] | None:
        """Retire the completed slots (all of them with ``block``) in order: ``(context, flag, later)`` of the
        first error found (``later``: how many of the slots retired after it failed too, usually the same bad
        input seen by the next check), or None. Slots still in flight stay pending, and so do the checks numbered
        ``before`` and later (a call's own check: on a fast GPU its copy may land before the call returns, and
        the deferred mode must still return from that call)."""
        found = None
        later = 0
        while self.pending:
            slot, call, info = self.pending[0]
            if before is not None and call >= before:
                break
            if block:
                self.events[slot].synchronize()
            elif not self.events[slot].query():
                break
            self.pending.popleft()
            value = int(self.values[slot])
            self.values[slot] = 0
            self.free.append(slot)
            if value and found is None:
                found = (Context(*info, call), value)
            elif value:
                later += 1
        return None if found is None else (*found, later)


_rings: dict[torch.device, _Ring] = {}


def _ring(device: torch.device) -> _Ring:
    r = _rings.get(device)
    if r is None:
        r = _rings[device] = _Ring(device, _backends.get(device.type, _DEFAULT_BACKEND))
    return r


def message(ctx: Context, value: int, later: int = 0) -> str:
    """The text of the deferred error for flag ``value`` of the call ``ctx`` (``later``: failed checks after it)."""
    bits = [b for b in sorted(ctx.messages) if value & b] or sorted(ctx.messages)[:1]
    text = "; ".join(ctx.messages[b] for b in bits) if bits else f"bad value (flag {value})"
    who = ctx.label() if callable(ctx.label) else ctx.label
    shape = "x".join(str(n) for n in ctx.shape) or "scalar"
    return (
        f"{who + ': ' if who else ''}{text} [detected asynchronously: this error belongs to an earlier call, "
        f"{ctx.op} on a {shape} {str(ctx.dtype).replace('torch.', '')} tensor (check #{ctx.call} on this device), "
        "and was raised at a later check; run with modelopt_lite.set_error_checks('sync') (or inside "
        "`with modelopt_lite.error_checks('sync'):`) to raise it at the offending call]"
        + (f" ({later} later check(s) on this device failed too)" if later else "")
    )


def _raise(found: tuple[Context, int, int] | None) -> None:
    if found is not None:
        raise DeferredValueError(message(*found))


def defer(flag: torch.Tensor, op: str, messages: Mapping[int, str], x: torch.Tensor) -> None:
    """Queue the check of ``flag`` (a one-element int32/bool tensor on x's device, 0 when fine) for the call
    ``op`` on ``x``; then raise the first error of an earlier call that has completed (no synchronization)."""
    with _lock:
        r = _ring(flag.device)
        who = _label.get()
        found = r.push(flag, (op, messages, tuple(x.shape), x.dtype, who))
        _raise(found or r.collect(block=False, before=r.calls))


def poll(device: torch.device | None = None) -> None:
    """Raise the first error among the completed checks (of ``device``, else of every device), without waiting."""
    with _lock:
        for r in [_rings[device]] if device in _rings else [] if device is not None else list(_rings.values()):
            _raise(r.collect(block=False))


def check_errors(device: torch.device | str | None = None) -> None:
    """Wait for the pending checks (of ``device``, else of every device) and raise the first error
    (:class:`DeferredValueError`). Cheap when nothing is pending."""
    dev = torch.device(device) if isinstance(device, str) else device
    with _lock:
        rings = [r for d, r in _rings.items() if dev is None or d == dev or (dev.index is None and d.type == dev.type)]
        for r in rings:
            _raise(r.collect(block=True))


def pending() -> int:
    """How many checks are in flight (all devices)."""
    with _lock:
        return sum(len(r.pending) for r in _rings.values())


def check_flag(flag: torch.Tensor, raise_now: Callable[[], object], op: str, messages: Mapping[int, str], x) -> None:
    """The one entry point of the ops: defer ``flag`` (deferred mode, CUDA), else read it now and, when set, call
    ``raise_now`` (which raises the sync mode's ValueError, as the CPU path)."""
    if deferring(flag):
        defer(flag, op, messages, x)
    elif bool(flag.reshape(-1)[0]):
        raise_now()
