"""``QuantModuleRegistry``: the one map from float module classes to their quantized classes.

The quantized modules register themselves where they are defined, as in ModelOpt::

    @QuantModuleRegistry.register({nn.Linear: "nn.Linear"})
    class QuantLinear(QuantModuleMixin, nn.Linear): ...

Everything that converts or patches reads this map: :func:`modelopt_lite.quantize` (``replace_quant_modules``),
:mod:`modelopt_lite.quant_modules` and the real-quantization converter (through :meth:`~QuantModuleRegistryCls.get`
/ :meth:`~QuantModuleRegistryCls.float_class_of`). Only exact types match: a subclass of ``nn.Linear`` with its own
forward is not converted unless it is registered itself.

A quantized class converts a float instance in one of two ways:

- ``QuantX.from_float(module)`` (every class in :mod:`modelopt_lite.nn`): a new module holding copies of the
  parameters; the float module is left as it was;
- a ModelOpt-style class with a ``_setup()`` method that creates its quantizers (it must subclass the float class):
  a deep copy of the float module becomes an instance of it and ``_setup()`` runs.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn


def _name(cls) -> str:
    return getattr(cls, "__qualname__", None) or repr(cls)


def _check_float_cls(float_cls, what: str) -> None:
    if not (isinstance(float_cls, type) and issubclass(float_cls, nn.Module)):
        raise TypeError(f"{what}: the float class must be an nn.Module subclass, got {float_cls!r}")


def check_pair(float_cls, quant_cls, what: str = "register") -> None:
    """Raise TypeError/ValueError unless ``quant_cls`` can convert instances of ``float_cls``."""
    _check_float_cls(float_cls, what)
    if not isinstance(quant_cls, type):
        raise TypeError(f"{what}: the quantized class must be a class, got {quant_cls!r}")
    if float_cls is quant_cls:
        raise ValueError(f"{what}: the float and quantized classes are the same class {_name(float_cls)}")
    if callable(getattr(quant_cls, "from_float", None)):
        return
    if callable(getattr(quant_cls, "_setup", None)):
        if not issubclass(quant_cls, float_cls):
            raise TypeError(
                f"{what}: {_name(quant_cls)} has a _setup() method but does not subclass {_name(float_cls)} "
                "(a ModelOpt-style quantized class must subclass the float class)"
            )
        return
    raise TypeError(
        f"{what}: the quantized class must have a from_float(module) classmethod or a _setup() method, "
        f"got {_name(quant_cls)}"
    )


class QuantModuleRegistryCls:
    """A thread-safe map ``float class -> (quantized class, key)``; ``key`` is a label such as ``"nn.Linear"``."""

    def __init__(self) -> None:
        self._map: dict[type, tuple[type, str]] = {}
        self._lock = threading.RLock()
        self._finders: list[Callable[[type], type | None]] = []
        self._asked: set[type] = set()  # classes the finders were asked about (each is asked once)
        self._removed: set[type] = set()  # unregistered classes: never brought back by a finder

    # --- finders: classes registered on first sight ----------------------------------------------------------------
    def add_finder(self, finder: Callable[[type], type | None]) -> None:
        """Ask ``finder(float_cls) -> quantized class or None`` about each unregistered class looked up (once per
        class); a class it answers for is registered (key: the class name). Used for families of third-party
        classes, e.g. Hugging Face attention modules (see ``quant_attention_hf``)."""
        if not callable(finder):
            raise TypeError(f"add_finder: expected a callable, got {finder!r}")
        with self._lock:
            self._finders.append(finder)
            self._asked = set(self._removed)

    def _entry(self, float_cls) -> tuple[type, str] | None:
        entry = self._map.get(float_cls)
        if entry is not None or not self._finders or not isinstance(float_cls, type):
            return entry
        with self._lock:
            if float_cls in self._asked:
                return self._map.get(float_cls)
            self._asked.add(float_cls)
            for finder in self._finders:
                quant_cls = finder(float_cls)
                if quant_cls is not None:
                    self.add(float_cls, quant_cls, float_cls.__name__)
                    break
            return self._map.get(float_cls)

    # --- registration ------------------------------------------------------------------------------------------
    def register(self, cls_to_key: Mapping[type, str]) -> Callable[[type], type]:
        """Decorator: ``@registry.register({nn.Linear: "nn.Linear"})`` maps each float class to the decorated one.

        A float class registered before is re-mapped (the last registration wins).
        """
        if not isinstance(cls_to_key, Mapping) or not cls_to_key:
            raise TypeError(f"register: expected a non-empty dict {{float class: key}}, got {cls_to_key!r}")
        for float_cls, key in cls_to_key.items():
            _check_float_cls(float_cls, "register")
            if not isinstance(key, str) or not key:
                raise TypeError(f"register: the key of {_name(float_cls)} must be a non-empty str, got {key!r}")

        def decorator(quant_cls: type) -> type:
            for float_cls, key in cls_to_key.items():
                self.add(float_cls, quant_cls, key)
            return quant_cls

        return decorator

    def add(self, float_cls: type, quant_cls: type, key: str | None = None) -> type:
        """Map ``float_cls`` to ``quant_cls`` (key default: ``"nn.<Name>"`` for torch classes). Returns ``quant_cls``."""
        check_pair(float_cls, quant_cls)
        if key is None:
            key = f"nn.{float_cls.__name__}" if float_cls.__module__.startswith("torch.") else _name(float_cls)
        with self._lock:
            self._map[float_cls] = (quant_cls, key)
            self._removed.discard(float_cls)
        return quant_cls

    def unregister(self, float_cls: type) -> type:
        """Remove the pair of ``float_cls`` (a default one too); returns the quantized class it mapped to.

        Raises:
            ValueError: ``float_cls`` is not registered.
        """
        with self._lock:
            if float_cls not in self._map:
                raise ValueError(f"unregister: {_name(float_cls)} is not registered for quantization")
            self._asked.add(float_cls)  # a finder does not bring it back
            self._removed.add(float_cls)
            return self._map.pop(float_cls)[0]

    # --- lookup --------------------------------------------------------------------------------------------------
    def get(self, float_cls: type, default: type | None = None) -> type | None:
        """The quantized class registered for exactly ``float_cls`` (subclasses do not match), or ``default``."""
        entry = self._entry(float_cls)
        return default if entry is None else entry[0]

    def __getitem__(self, float_cls: type) -> type:
        entry = self._entry(float_cls)
        if entry is None:
            raise KeyError(f"{_name(float_cls)} is not registered for quantization")
        return entry[0]

    def get_key(self, float_cls: type) -> str | None:
        """The key (``"nn.Linear"``) ``float_cls`` was registered with, or None."""
        entry = self._entry(float_cls)
        return None if entry is None else entry[1]

    def float_class_of(self, quant_cls: type) -> type | None:
        """The float class whose quantized class is ``quant_cls`` (the first registered), or None."""
        with self._lock:
            for f, (q, _) in self._map.items():
                if q is quant_cls:
                    return f
        return None

    def is_quant_class(self, cls: type) -> bool:
        """True when ``cls`` is the quantized class of some registered float class."""
        return self.float_class_of(cls) is not None

    def items(self) -> list[tuple[type, type]]:
        """A snapshot of the ``(float class, quantized class)`` pairs."""
        with self._lock:
            return [(f, q) for f, (q, _) in self._map.items()]

    def __contains__(self, cls_or_module) -> bool:
        """``nn.Linear in registry`` or ``module in registry`` (exact type)."""
        cls = cls_or_module if isinstance(cls_or_module, type) else type(cls_or_module)
        return self._entry(cls) is not None

    def __len__(self) -> int:
        return len(self._map)

    # --- conversion ----------------------------------------------------------------------------------------------
    def convert(self, module: nn.Module) -> nn.Module:
        """The quantized counterpart of one module (its exact type must be registered); ``module`` is not changed.

        Raises:
            KeyError: the module's type is not registered.
            TypeError: the quantized class returned something that is not an ``nn.Module``.
        """
        quant_cls: Any = self[type(module)]
        new: Any
        if callable(getattr(quant_cls, "from_float", None)):
            new = quant_cls.from_float(module)
        else:  # ModelOpt-style: a copy of the module becomes the quantized class, whose _setup adds the quantizers
            new = copy.deepcopy(module)
            new.__class__ = quant_cls
            new._setup()
        if not isinstance(new, nn.Module):
            raise TypeError(
                f"{_name(quant_cls)} converted {type(module).__name__} to {type(new).__name__}, not a module"
            )
        new.train(module.training)
        return new


#: The process-wide registry (ModelOpt's name); the quantized modules of :mod:`modelopt_lite.nn` register here.
QuantModuleRegistry = QuantModuleRegistryCls()
