"""The float -> quantized module registry used by :func:`modelopt_lite.quantize`, ``quant_modules`` and ``real``.

There is one registry, :data:`modelopt_lite.nn.QuantModuleRegistry` (defined in the ``nn`` layer, where the
quantized modules register themselves); this module re-exports it as ``REGISTRY`` and adds ModelOpt's functions.
``quantize`` replaces every child whose *exact* type is registered by ``QuantModuleRegistry.convert(child)``;
``torch.nn`` is never patched. Users add their own pairs with :func:`register` and remove pairs (defaults
included) with :func:`unregister`.
"""

from __future__ import annotations

from ..nn.modules._registry import QuantModuleRegistry, QuantModuleRegistryCls

#: The process-wide registry ``quantize`` uses (the same object as ``modelopt_lite.nn.QuantModuleRegistry``).
REGISTRY: QuantModuleRegistryCls = QuantModuleRegistry

__all__ = [
    "REGISTRY",
    "QuantModuleRegistry",
    "QuantModuleRegistryCls",
    "float_class_for",
    "quant_class_for",
    "register",
    "registered",
    "unregister",
]


def register(original_cls: type, quantized_cls: type) -> type:
    """Convert instances of ``original_cls`` to ``quantized_cls`` in :func:`modelopt_lite.quantize` (ModelOpt's
    ``mtq.register``). Returns ``quantized_cls``.

    ``quantized_cls`` either has a ``from_float(module)`` classmethod (the classes of :mod:`modelopt_lite.nn`), or
    is a ModelOpt-style subclass of ``original_cls`` whose ``_setup()`` creates its quantizers. Only exact types are
    matched: register a subclass of ``nn.Linear`` explicitly to have it converted.

    Raises:
        TypeError: ``original_cls`` is not an ``nn.Module`` class, or ``quantized_cls`` cannot convert it.
    """
    return REGISTRY.add(original_cls, quantized_cls)


def unregister(original_cls: type) -> type:
    """Stop converting ``original_cls`` (a default pair such as ``nn.Linear`` too). Returns the removed class.

    Raises:
        ValueError: ``original_cls`` is not registered.
    """
    return REGISTRY.unregister(original_cls)


def registered() -> dict[type, type]:
    """A copy of the current ``{float class: quantized class}`` map."""
    return dict(REGISTRY.items())


def quant_class_for(float_cls: type) -> type | None:
    """The quantized class registered for exactly ``float_cls`` (None when it is not converted)."""
    return REGISTRY.get(float_cls)


def float_class_for(quant_cls: type) -> type | None:
    """The float class ``quant_cls`` was registered for (None for a class that is not in the registry)."""
    return REGISTRY.float_class_of(quant_cls)
