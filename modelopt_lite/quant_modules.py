"""pytorch-quantization's automatic replacement API: patch ``torch.nn`` classes with quantized ones.

``initialize()`` makes ``torch.nn.Linear`` (and 14 other classes) *be* ``QuantLinear`` etc. (the classes
registered in :data:`modelopt_lite.nn.QuantModuleRegistry`), so models built afterwards get quantized modules;
``deactivate()`` restores the originals. This is global monkey patching, kept
only for users of that familiar API: prefer ``modelopt_lite.quantize(model, config)``, which converts one model
instance and touches nothing global. Modules constructed before ``initialize()`` are not affected.

The state is one table of what is patched; ``initialize()`` first restores everything it patched before, so
calling it twice and ``deactivate()`` once restores the true originals. ``with enable(...):`` restores on exit,
also on exceptions, and re-applies the patches that were active before it (nesting works).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .nn.modules._registry import QuantModuleRegistry

#: the ``torch.nn`` classes patched by default (pytorch-quantization's list); the quantized class of each is looked
#: up in the one registry (:data:`modelopt_lite.nn.QuantModuleRegistry`) when patching, so ``modelopt_lite.register``
#: / ``unregister`` apply here too
DEFAULT_FLOAT_MODULES = (
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Linear",
    "LSTM",
    "LSTMCell",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
)


def _original(name: str) -> type:
    """The class torch defines under ``name`` (``torch.nn.modules`` is never patched by :func:`initialize`)."""
    return getattr(torch.nn.modules, name)


def default_quant_map() -> tuple[tuple[object, str, type], ...]:
    """``(torch.nn, "ClassName", QuantClass)`` for each default class the registry has a quantized class for."""
    out = []
    for name in DEFAULT_FLOAT_MODULES:
        quant_cls = QuantModuleRegistry.get(_original(name))
        if quant_cls is not None:
            out.append((torch.nn, name, quant_cls))
    return tuple(out)


#: (parent module, attribute name, quantized class) patched by default, as registered at import time (pytorch-
#: quantization's name; :func:`default_quant_map` gives the current registry's view)
DEFAULT_QUANT_MAP = default_quant_map()

_lock = threading.RLock()
# (parent, name) -> (original object, patched object)
_patched: dict[tuple[object, str], tuple[object, type]] = {}


def _entries(float_module_list, custom_quant_modules) -> list[tuple[object, str, type]]:
    skip = set()
    for item in float_module_list or ():
        if isinstance(item, str):
            skip.add(item)
        elif isinstance(item, type):
            skip.add(item.__name__)
        else:
            raise TypeError(f"float_module_list entries must be class names or classes, got {item!r}")
    custom = list(custom_quant_modules or ())
    for entry in custom:
        if not (
            isinstance(entry, tuple)
            and len(entry) == 3
            and isinstance(entry[1], str)
            and isinstance(entry[2], type)
            and hasattr(entry[0], entry[1])
        ):
            raise TypeError(
                "custom_quant_modules entries must be (parent_module, 'ClassName', QuantClass) with "
                f"parent_module having that attribute, got {entry!r}"
            )
    table = {(id(p), n): (p, n, q) for p, n, q in default_quant_map() if n not in skip}
    table.update({(id(p), n): (p, n, q) for p, n, q in custom})  # the custom map overrides the deny list
    return list(table.values())


def _restore_all() -> None:
    for (parent, name), (original, _) in list(_patched.items()):
        setattr(parent, name, original)
    _patched.clear()


def _apply(entries) -> None:
    for parent, name, quant_cls in entries:
        original = getattr(parent, name)
        _patched[(parent, name)] = (original, quant_cls)
        setattr(parent, name, quant_cls)


def initialize(float_module_list=None, custom_quant_modules=None) -> None:
    """Patch ``torch.nn`` so that newly built modules are quantized.

    Args:
        float_module_list: class names (or classes) of the default map to leave alone, e.g. ``["LSTM"]``.
        custom_quant_modules: extra ``(parent_module, "ClassName", QuantClass)`` entries; they override the
            default map and ``float_module_list``.
    """
    with _lock:
        entries = _entries(float_module_list, custom_quant_modules)  # validate before touching anything
        _restore_all()
        _apply(entries)


def deactivate() -> None:
    """Restore every class patched by :func:`initialize` (a no-op when nothing is patched)."""
    with _lock:
        _restore_all()


def active() -> dict[str, type]:
    """What is patched now: ``{"ClassName": QuantClass}``."""
    with _lock:
        return {name: patched for (_, name), (_, patched) in _patched.items()}


class QuantModuleReplacementHelper:
    """pytorch-quantization's object form of :func:`initialize` / :func:`deactivate`.

    ``prepare_state(float_module_list, custom_map)`` validates and records what to patch (same arguments as
    :func:`initialize`; nothing is patched yet), ``apply_quant_modules()`` patches ``torch.nn`` (first restoring
    whatever was patched before, as :func:`initialize` does) and ``restore_float_modules()`` restores the
    originals. The patches live in this module's one table, so :func:`deactivate` and :func:`active` see them too.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[object, str, type]] | None = None

    def prepare_state(self, float_module_list=None, custom_map=None) -> None:
        """Record the classes to patch: the default map minus ``float_module_list``, plus ``custom_map``."""
        with _lock:
            self._entries = _entries(float_module_list, custom_map)

    @property
    def quant_map(self) -> dict[str, type]:
        """``{"ClassName": QuantClass}`` that :meth:`apply_quant_modules` patches (empty before ``prepare_state``)."""
        return {name: quant_cls for _, name, quant_cls in self._entries or ()}

    def apply_quant_modules(self) -> None:
        """Patch ``torch.nn`` as prepared; RuntimeError when :meth:`prepare_state` was not called."""
        if self._entries is None:
            raise RuntimeError("QuantModuleReplacementHelper: call prepare_state() before apply_quant_modules()")
        with _lock:
            _restore_all()
            _apply(self._entries)

    def restore_float_modules(self) -> None:
        """Restore every patched class (a no-op when nothing is patched)."""
        deactivate()


@contextlib.contextmanager
def enable(float_module_list=None, custom_quant_modules=None):
    """``with enable(): model = build()`` builds a quantized model; ``torch.nn`` is restored on exit, always.

    On exit the patches active before the block (from an outer ``enable`` or ``initialize``) are re-applied.
    """
    with _lock:
        entries = _entries(float_module_list, custom_quant_modules)
        previous = [(parent, name, patched) for (parent, name), (_, patched) in _patched.items()]
        _restore_all()
        _apply(entries)
    try:
        yield
    finally:
        with _lock:
            _restore_all()
            _apply(previous)


@contextlib.contextmanager
def enable_onnx_export():
    """pytorch-quantization's ``with enable_onnx_export():`` block, kept so its export scripts run unchanged.

    No global switch is needed: while any ``torch.onnx.export`` traces a model (TorchScript or dynamo), the
    modelopt_lite fake-quant ops write standard ``QuantizeLinear -> DequantizeLinear`` pairs
    (:mod:`modelopt_lite.functional.onnx_qdq`), bit-exact in ONNX Runtime for int8/uint8 grids (narrow range and
    sub-8-bit grids with a Max/Min clamp before Q), per-channel scales (opset >= 13) and FP8 E4M3 (opset >= 19).
    So this context changes nothing (no flag on ``TensorQuantizer``, nothing to restore) and nests freely;
    exceptions propagate. :func:`modelopt_lite.export_onnx` writes a smaller graph (weights folded to int8/int4/FP8
    initializers, scales as constants) and handles what a plain export cannot (16-bit grids, dead scales, INT4
    blocks at opset 21, the ORT integer layout).
    """
    yield
