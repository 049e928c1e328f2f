"""Plain eager calls of this package's ``torch.library`` ops without the dispatcher's Python layers.

A ``torch.library.custom_op`` called from Python reaches its body through the dispatcher, the op's Python autograd
wrapper (an ``autograd.Function`` fed from the schema on every call: ``fill_defaults``, alias checks) and dynamo's
disable wrapper. Measured on the CPU with the CUDA path's host code (``bench/bench_call_overhead.py --cuda-path``),
those layers were about 80 of the 200 microseconds of an MX quantizer's forward + backward and a few of a forward
without grad: on a GPU, time it sits idle on a single call or a small QAT step.

:func:`call` runs an op's body directly where nothing in those layers can matter: plain eager mode, plain tensors.
When an input requires grad, it goes through one lean ``autograd.Function`` per op that runs the op's own
``setup_context`` and backward (registered with :func:`register_autograd`, which also registers them on the op).
The op itself runs (the dispatcher path) under torch.compile / torch.export / torch.jit tracing, a
TorchDispatchMode (FakeTensor, proxy tracing, the tests' op counters) or TorchFunctionMode, a functorch transform
(vmap, grad), the autograd profiler (so that profiles name the op), and for tensor subclasses. Both paths compute
the same values: they run the same body and the same backward. (A kernel registered on one of these ops with
``op.register_kernel(device, fn)`` is seen by the op path only: backends plug in through :mod:`.backend`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_PLAIN = (Tensor, torch.nn.Parameter)
#: op -> its autograd.Function for the direct path (ops with a registered autograd only)
_FUNCTIONS: dict[Any, type[torch.autograd.Function]] = {}


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """``op.register_autograd(backward, setup_context=setup_context)``, and the same pair for :func:`call`'s direct
    path (``backward`` may itself use :func:`call`)."""
    op.register_autograd(backward, setup_context=setup_context)
    body = op._init_fn

    def forward(ctx, *args):
        out = body(*args)
        setup_context(ctx, args, out)
        return out

    name = "".join(p.title() for p in str(op._name).split("::")[-1].split("_"))
    _FUNCTIONS[op] = type(
        f"{name}Eager",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__},
    )


def _traced() -> bool:
    """Whether anything but plain eager execution is active (see the module doc). The tracing check comes first:
    dynamo folds it and never traces the others."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    return bool(
        torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._is_tracing()
        or torch._C._autograd._profiler_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
    )


def _scan(args: tuple) -> int:
    """One pass over a call's arguments: -1 when a tensor is not a plain Tensor / Parameter (a subclass takes the
    op path), else 1 when a tensor requires grad, else 0."""
    grad = 0
    for a in args:
        if isinstance(a, Tensor):
            if type(a) not in _PLAIN:
                return -1
            if a.requires_grad:
                grad = 1
    return grad


def plain_eager(args: tuple) -> bool:
    """Whether a call with ``args`` may skip the dispatcher (see the module doc)."""
    return not _traced() and _scan(args) >= 0


def call(op, *args):
    """``op(*args)``, with the op's body run directly in plain eager mode (see the module doc). ``op`` may be any
    callable: one that is not a custom op (a wrapper, a test's stand-in) is simply called."""
    body = getattr(op, "_init_fn", None)
    if body is None or _traced():
        return op(*args)
    kind = _scan(args)
    if kind < 0:
        return op(*args)
    if kind and torch.is_grad_enabled():
        fn = _FUNCTIONS.get(op)
        return op(*args) if fn is None else fn.apply(*args)
    return body(*args)
