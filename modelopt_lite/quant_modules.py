"""pytorch-quantization's automatic replacement API: patch ``torch.nn`` classes with quantized ones.

``initialize()`` makes ``torch.nn.Linear`` (and 14 other classes) *be* ``QuantLinear`` etc., so models built
afterwards get quantized modules; ``deactivate()`` restores the originals. This is global monkey patching, kept
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

from .nn import modules as qm

#: (parent module, attribute name, quantized class) patched by default (the pytorch-quantization list)
DEFAULT_QUANT_MAP = (
    (torch.nn, "Conv1d", qm.QuantConv1d),
    (torch.nn, "Conv2d", qm.QuantConv2d),
    (torch.nn, "Conv3d", qm.QuantConv3d),
    (torch.nn, "ConvTranspose1d", qm.QuantConvTranspose1d),
    (torch.nn, "ConvTranspose2d", qm.QuantConvTranspose2d),
    (torch.nn, "ConvTranspose3d", qm.QuantConvTranspose3d),
    (torch.nn, "Linear", qm.QuantLinear),
    (torch.nn, "LSTM", qm.QuantLSTM),
    (torch.nn, "LSTMCell", qm.QuantLSTMCell),
    (torch.nn, "AvgPool1d", qm.QuantAvgPool1d),
    (torch.nn, "AvgPool2d", qm.QuantAvgPool2d),
    (torch.nn, "AvgPool3d", qm.QuantAvgPool3d),
    (torch.nn, "AdaptiveAvgPool1d", qm.QuantAdaptiveAvgPool1d),
    (torch.nn, "AdaptiveAvgPool2d", qm.QuantAdaptiveAvgPool2d),
    (torch.nn, "AdaptiveAvgPool3d", qm.QuantAdaptiveAvgPool3d),
)

_lock = threading.RLock()
# (parent, name) -> (original object, patched object)
_patched: dict[tuple[object, str], tuple[object, object]] = {}


def _entries(float_module_list, custom_quant_modules):
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
    table = {(id(p), n): (p, n, q) for p, n, q in DEFAULT_QUANT_MAP if n not in skip}
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
