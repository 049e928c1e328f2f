"""The float -> quantized module registry used by :func:`modelopt_lite.quantize` (instance-level conversion).

``quantize`` replaces every child whose *exact* type is registered by ``QuantX.from_float(child)``; ``torch.nn`` is
never patched. The default map (``nn.Linear -> QuantLinear``, the convolutions, transposed convolutions, pooling
layers and LSTMs) is loaded lazily from :mod:`modelopt_lite.nn` on first use, so importing this module is cheap.
Users add their own pairs with :func:`register` and remove pairs (defaults included) with :func:`unregister`.
"""

from __future__ import annotations

import importlib
import logging
import threading

from torch import nn
from torch.nn.modules import conv as _conv
from torch.nn.modules import linear as _lin
from torch.nn.modules import pooling as _pool
from torch.nn.modules import rnn as _rnn

log = logging.getLogger(__name__)

#: float class (or the name of a float helper class in :mod:`modelopt_lite.nn`) -> name of its quantized twin there
DEFAULT_QUANT_MAP: dict[type | str, str] = {
    # the defining modules, not ``torch.nn`` attributes: those may be patched (``quant_modules.enable()``)
    _lin.Linear: "QuantLinear",
    _conv.Conv1d: "QuantConv1d",
    _conv.Conv2d: "QuantConv2d",
    _conv.Conv3d: "QuantConv3d",
    _conv.ConvTranspose1d: "QuantConvTranspose1d",
    _conv.ConvTranspose2d: "QuantConvTranspose2d",
    _conv.ConvTranspose3d: "QuantConvTranspose3d",
    _pool.MaxPool1d: "QuantMaxPool1d",
    _pool.MaxPool2d: "QuantMaxPool2d",
    _pool.MaxPool3d: "QuantMaxPool3d",
    _pool.AvgPool1d: "QuantAvgPool1d",
    _pool.AvgPool2d: "QuantAvgPool2d",
    _pool.AvgPool3d: "QuantAvgPool3d",
    _pool.AdaptiveAvgPool1d: "QuantAdaptiveAvgPool1d",
    _pool.AdaptiveAvgPool2d: "QuantAdaptiveAvgPool2d",
    _pool.AdaptiveAvgPool3d: "QuantAdaptiveAvgPool3d",
    _rnn.LSTM: "QuantLSTM",
    _rnn.LSTMCell: "QuantLSTMCell",
    "MatMul": "QuantMatMul",  # modelopt_lite.nn.MatMul / Add: functional ops written as modules
    "Add": "QuantAdd",
}


class QuantModuleRegistry:
    """A mapping ``float class -> quant class`` with lazily loaded defaults. Thread-safe for register/unregister."""

    def __init__(self, defaults: dict[type | str, str] | None = None, package: str = "modelopt_lite.nn"):
        self._defaults = dict(DEFAULT_QUANT_MAP if defaults is None else defaults)
        self._package = package
        self._map: dict[type, type] = {}
        self._removed: set[type] = set()
        self._loaded = False
        self._lock = threading.RLock()

    def _load_defaults(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            pkg = importlib.import_module(self._package)
            for float_cls, quant_name in self._defaults.items():
                if isinstance(float_cls, str):
                    float_cls = getattr(pkg, float_cls, None)
                    if float_cls is None:
                        continue
                if float_cls in self._map or float_cls in self._removed:
                    continue  # a user registration or removal made before the defaults were loaded wins
                quant_cls = getattr(pkg, quant_name, None)
                if quant_cls is None:
                    log.debug(
                        "%s has no %s; %s is not converted by default",
                        self._package,
                        quant_name,
                        getattr(float_cls, "__name__", float_cls),
                    )
                    continue
                self._map[float_cls] = quant_cls
            self._loaded = True

    def register(self, float_cls: type, quant_cls: type) -> type:
        """Map ``float_cls`` to ``quant_cls`` (replacing an earlier pair). Returns ``quant_cls``.

        Raises:
            TypeError: ``float_cls`` is not an ``nn.Module`` class, or ``quant_cls`` is not a class with a
                ``from_float`` classmethod.
        """
        if not (isinstance(float_cls, type) and issubclass(float_cls, nn.Module)):
            raise TypeError(f"register: float_cls must be an nn.Module subclass, got {float_cls!r}")
        if not isinstance(quant_cls, type) or not callable(getattr(quant_cls, "from_float", None)):
            raise TypeError(
                f"register: quant_cls must be a class with a from_float(module) classmethod, got {quant_cls!r}"
            )
        if float_cls is quant_cls:
            raise ValueError(f"register: float_cls and quant_cls are the same class {float_cls.__name__}")
        with self._lock:
            self._map[float_cls] = quant_cls
            self._removed.discard(float_cls)
        return quant_cls

    def unregister(self, float_cls: type) -> type:
        """Remove the pair of ``float_cls`` (a default one too). Returns the quant class it mapped to.

        Raises:
            ValueError: ``float_cls`` is not registered.
        """
        self._load_defaults()
        with self._lock:
            if float_cls not in self._map:
                name = getattr(float_cls, "__name__", repr(float_cls))
                raise ValueError(f"unregister: {name} is not registered for quantization")
            self._removed.add(float_cls)
            return self._map.pop(float_cls)

    def get(self, float_cls: type) -> type | None:
        """The quant class registered for exactly ``float_cls`` (subclasses are not converted), or None."""
        self._load_defaults()
        return self._map.get(float_cls)

    def float_class_of(self, quant_cls: type) -> type | None:
        """The float class whose twin is ``quant_cls`` (the first registered), or None."""
        self._load_defaults()
        for f, q in self._map.items():
            if q is quant_cls:
                return f
        return None

    def is_quant_class(self, cls: type) -> bool:
        """True when ``cls`` is the twin of some registered float class."""
        return self.float_class_of(cls) is not None

    def items(self) -> list[tuple[type, type]]:
        """A snapshot of the registered ``(float class, quant class)`` pairs."""
        self._load_defaults()
        with self._lock:
            return list(self._map.items())

    def __contains__(self, float_cls) -> bool:
        return self.get(float_cls) is not None

    def __len__(self) -> int:
        return len(self.items())


#: The process-wide registry ``quantize`` uses.
REGISTRY = QuantModuleRegistry()


def register(float_cls: type, quant_cls: type) -> type:
    """Convert instances of ``float_cls`` to ``quant_cls.from_float(instance)`` in :func:`modelopt_lite.quantize`.

    Only exact types are matched: register a subclass of ``nn.Linear`` explicitly to have it converted.
    """
    return REGISTRY.register(float_cls, quant_cls)


def unregister(float_cls: type) -> type:
    """Stop converting ``float_cls`` (a default pair such as ``nn.Linear`` too). Returns the removed quant class."""
    return REGISTRY.unregister(float_cls)


def registered() -> dict[type, type]:
    """A copy of the current ``{float class: quant class}`` map."""
    return dict(REGISTRY.items())
