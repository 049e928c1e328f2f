"""Where AWQ's ``1 / s`` can go instead of a ``pre_quant_scale``: the op that produces the scaled layers' input.

During the first forward of the statistics pass, :class:`Tracer` records for every scaled Linear which tensor it
reads, which module produced that tensor (a module whose class is in :data:`FOLDERS` and whose output is that very
tensor) and every other torch operation that touched the tensor (a ``TorchFunctionMode``; shape/dtype queries do not
count). A producer whose output is read *only* by scaled Linears can absorb ``1 / s``: its output channels are
divided by ``s`` (LayerNorm/RMSNorm: the affine weight and bias; Linear: the weight rows and bias), and those
Linears share one scale, searched on their summed errors. Anything else (a residual connection, a reshape, an
activation, a norm without affine weight) keeps per-layer scales as ``pre_quant_scale``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def _fold_affine(m: nn.Module, inv: torch.Tensor) -> None:
    """Output channel ``j`` of a norm / Linear times ``inv_j``: weight (rows for a Linear) and bias."""
    w = cast(torch.Tensor, m.weight)
    if w.dim() == 1:
        w.mul_(inv.to(w.device, w.dtype))
    else:
        w.mul_(inv.to(w.device, w.dtype)[:, None])
    b = getattr(m, "bias", None)
    if isinstance(b, torch.Tensor):
        b.mul_(inv.to(b.device, b.dtype))


def _has_channel_weight(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1


def _plain_linear(m: nn.Module) -> bool:
    oq = getattr(m, "output_quantizer", None)
    return isinstance(m, nn.Linear) and (oq is None or not oq.is_enabled)


#: (is foldable, fold): checked in order; a norm needs its per-channel affine weight, a Linear no output quantizer
FOLDERS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module, torch.Tensor], None]]] = [
    (lambda m: isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and _has_channel_weight(m), _fold_affine),
    (lambda m: type(m).__name__.endswith("RMSNorm") and _has_channel_weight(m), _fold_affine),
    (_plain_linear, _fold_affine),
]


def _folder(m: nn.Module):
    for ok, fn in FOLDERS:
        if ok(m):
            return fn
    return None


_META = frozenset(
    {"__get__", "size", "dim", "numel", "is_floating_point", "stride", "is_contiguous", "data_ptr", "__len__"}
    | {"get_device", "nelement", "ndimension", "element_size", "__format__", "__repr__"}
)


class _Uses(TorchFunctionMode):
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _META:
            self.tracer._use(args, kwargs)
        return func(*args, **kwargs)


class Tracer:
    """Finds the foldable producer of each scaled Linear's input during one forward (see the module docstring)."""

    def __init__(self, model: nn.Module, mods: dict[str, nn.Module], fold_linear: bool = True):
        self.model, self.mods = model, mods
        self.producers = {
            n: (m, fn)
            for n, m in model.named_modules()
            if (fn := _folder(m)) is not None and n not in ("",) and (fold_linear or not isinstance(m, nn.Linear))
        }
        self.out_of: dict[int, str] = {}  # id(output tensor) -> producer name
        self.reads: dict[str, str | None] = {}  # Linear -> producer name of its input (None: not a producer output)
        self.readers: dict[str, list[str]] = {}  # producer -> Linears reading its output
        self.external: set[str] = set()  # producers whose output something else touched
        self.current: str | None = None
        self.alive: list[torch.Tensor] = []
        self.done = False

    def _use(self, args, kwargs) -> None:
        if self.current is not None:
            return
        stack = [*args, *kwargs.values()]
        while stack:
            a = stack.pop()
            if isinstance(a, torch.Tensor):
                p = self.out_of.get(id(a))
                if p is not None:
                    self.external.add(p)
            elif isinstance(a, (list, tuple)):
                stack.extend(a)
            elif isinstance(a, dict):
                stack.extend(a.values())

    @contextlib.contextmanager
    def active(self):
        """Trace the first forward of ``model`` run inside this block."""
        mode = _Uses(self)
        state = {"on": False}

        def start(_m, _inp):
            if not self.done and not state["on"]:
                mode.__enter__()
                state["on"] = True

        def stop(_m, _inp, _out):
            if state["on"]:
                mode.__exit__(None, None, None)
                state["on"] = False
                self.done = True
                self.alive.clear()

        def produced(name):
            def hook(_m, _inp, out):
                if state["on"] and isinstance(out, torch.Tensor):
                    self.out_of[id(out)] = name
                    self.alive.append(out)

            return hook

        def enter(name):
            def pre(_m, inp):
                if state["on"]:
                    x = inp[0] if inp else None
                    p = self.out_of.get(id(x)) if isinstance(x, torch.Tensor) else None
                    self.reads[name] = p
                    if p is not None and name not in self.readers.get(p, []):
                        self.readers.setdefault(p, []).append(name)
                    self.current = name

            return pre

        def leave(_m, _inp, _out):
            self.current = None

        handles = [self.model.register_forward_pre_hook(start), self.model.register_forward_hook(stop)]
        handles += [m.register_forward_hook(produced(n)) for n, (m, _) in self.producers.items()]
        for n, m in self.mods.items():
            handles += [m.register_forward_pre_hook(enter(n), prepend=True), m.register_forward_hook(leave)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            if state["on"]:
                mode.__exit__(None, None, None)
            self.alive.clear()
            self.out_of.clear()
            self.current = None

    def groups(self) -> list[tuple[list[str], tuple[str, nn.Module, Callable] | None]]:
        """``[(linear names, (producer name, module, fold) or None)]`` in model order: foldable producers with the
        Linears that read them (one shared scale), every other Linear alone."""
        out: list[tuple[list[str], tuple[str, nn.Module, Callable] | None]] = []
        grouped: set[str] = set()
        for n in self.mods:
            if n in grouped:
                continue
            p = self.reads.get(n)
            readers = self.readers.get(p, []) if p is not None else []
            if p is not None and p not in self.external and readers and all(r in self.mods for r in readers):
                m, fn = self.producers[p]
                if not any(m is self.mods[r] for r in readers):
                    out.append((list(readers), (p, m, fn)))
                    grouped.update(readers)
                    continue
            out.append(([n], None))
            grouped.add(n)
        return out


def fold(producer: tuple[str, nn.Module, Callable], scale: torch.Tensor) -> str:
    """Divide the producer's output channels by ``scale``; returns the producer's path."""
    name, m, fn = producer
    with torch.no_grad():
        fn(m, 1.0 / scale)
    return name
