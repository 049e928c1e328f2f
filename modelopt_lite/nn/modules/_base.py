"""``QuantModuleMixin``: what every quantized module shares (quantizer creation, class defaults, ``from_float``).

Each quantized module owns ``input_quantizer``, ``weight_quantizer`` (modules with weights) and
``output_quantizer`` (disabled by default, applied to the output when enabled). The descriptors a new instance
gets are the class attributes ``default_quant_desc_input`` / ``default_quant_desc_weight``; as in
pytorch-quantization, ``QuantConv2d.set_default_quant_desc_input(desc)`` / ``..._weight(desc)`` change them for
that class (and its subclasses) and every instance built afterwards: this is process-wide state, so prefer
``quant_desc_input=`` / ``quant_desc_weight=`` or a ``modelopt_lite.quantize`` config.

Quantized modules compute with fake-quantized values only: a quantizer in real-quant mode (``fake_quant=False``)
would feed integer codes into the float op (a Linear ~127x too large), so it is rejected with a ValueError when
the module is built and on every forward (:meth:`QuantModuleMixin._check_fake_quant`).
"""

from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ...descriptor import (
    QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW,
    QUANT_DESC_8BIT_PER_TENSOR,
    ScaledQuantDescriptor,
)
from .._quantizer_config import as_descriptor
from ..tensor_quantizer import TensorQuantizer

if TYPE_CHECKING:  # the mixin is always combined with an nn.Module
    _MixinBase = nn.Module
else:
    _MixinBase = object


def recast_copy(cls: type, module: nn.Module) -> Any:
    """A deep copy of ``module`` recast as the quantized class ``cls`` (the ``from_float`` of every quant module).

    ``module`` must be exactly ``cls._float_cls``: a subclass may have its own forward, which the quantized class would
    silently drop (register a quantized class for the subclass instead)."""
    float_cls = cls._float_cls  # type: ignore[attr-defined]
    if type(module) is not float_cls:
        raise TypeError(
            f"{cls.__name__}.from_float expects a {float_cls.__module__}.{float_cls.__qualname__}, "
            f"got {type(module).__qualname__}"
        )
    new: Any = copy.deepcopy(module)
    new.__class__ = cls
    return new


def module_device(module: nn.Module) -> torch.device:
    """Device of the first parameter or buffer (CPU for a module without tensors)."""
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def check_fake_descriptor(desc: ScaledQuantDescriptor, owner: str, what: str) -> ScaledQuantDescriptor:
    """``desc`` if it fake-quantizes; a ValueError naming the module class and the descriptor otherwise."""
    if not desc.fake_quant:
        raise ValueError(
            f"{owner}: {what} has fake_quant=False. Only fake quantization is supported in quantized modules (their "
            "float ops would run on integer codes). Use modelopt_lite.tensor_quant for codes, or modelopt_lite.fake2real "
            "for real INT8 modules"
        )
    return desc


def reject_unused_keys(cls: type, kwargs: dict) -> None:
    """TypeError naming the keyword arguments that neither the quantized module nor its float class takes.

    pytorch-quantization's message ("Unused keys: ...") is kept inside ours, as its users match on it."""
    float_cls = getattr(cls, "_float_cls", None)
    accepted = set(inspect.signature(float_cls.__init__).parameters) - {"self"} if float_cls else set()
    unused = sorted(k for k in kwargs if k not in accepted)
    if unused:
        raise TypeError(
            f"{cls.__name__}: Unused keys: {unused} (not arguments of {cls.__name__}: it takes the arguments of "
            f"{getattr(float_cls, '__name__', 'its float class')} plus quant_desc_input= / quant_desc_weight=)"
        )


def _quantizers(module: nn.Module):
    """The TensorQuantizers under ``module`` (not looking inside a quantizer)."""
    for child in module._modules.values():
        if isinstance(child, TensorQuantizer):
            yield child
        elif child is not None:
            yield from _quantizers(child)


class QuantModuleMixin(_MixinBase):
    """Mixin for ``QuantX(QuantModuleMixin, nn.X)``: builds the quantizers and converts float modules.

    Class attributes: ``default_quant_desc_input`` (8-bit per tensor), ``default_quant_desc_weight`` (8-bit per
    channel on the output-channel axis, or None for modules without weights), ``_float_cls`` (the torch class this
    one replaces).
    """

    #: "float" (default) or "integer": how a quantized Linear/Conv computes a quantized output (see
    #: ``_integer_requant``; set with :func:`modelopt_lite.set_requant` or a config's ``"requant"``)
    requant: str = "float"
    default_quant_desc_input: ClassVar[ScaledQuantDescriptor] = QUANT_DESC_8BIT_PER_TENSOR
    default_quant_desc_weight: ClassVar[ScaledQuantDescriptor | None] = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _float_cls: ClassVar[type]

    # --- class-wide defaults (pytorch-quantization's QuantMixin API) ----------------------------------------------
    @classmethod
    def set_default_quant_desc_input(cls, value) -> None:
        """Descriptor (or dict of its fields) of the input quantizer of every ``cls`` built from now on."""
        desc = as_descriptor(value, f"{cls.__name__}.set_default_quant_desc_input")
        cls.default_quant_desc_input = check_fake_descriptor(desc, cls.__name__, "the default input descriptor")

    @classmethod
    def set_default_quant_desc_weight(cls, value) -> None:
        """Descriptor (or dict of its fields) of the weight quantizer of every ``cls`` built from now on.

        Raises:
            TypeError: ``cls`` has no weight quantizer.
        """
        if cls.default_quant_desc_weight is None:
            raise TypeError(f"{cls.__name__} has no weight quantizer; set_default_quant_desc_weight does not apply")
        desc = as_descriptor(value, f"{cls.__name__}.set_default_quant_desc_weight")
        cls.default_quant_desc_weight = check_fake_descriptor(desc, cls.__name__, "the default weight descriptor")

    # --- construction ----------------------------------------------------------------------------------------------
    def _desc(self, value, default, what: str) -> ScaledQuantDescriptor:
        desc = default if value is None else as_descriptor(value, f"{type(self).__name__} {what}")
        return check_fake_descriptor(desc, type(self).__name__, what)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        """Create input/weight/output quantizers on the module's device."""
        has_weight = self.default_quant_desc_weight is not None
        if quant_desc_weight is not None and not has_weight:
            raise TypeError(f"{type(self).__name__} has no weight; quant_desc_weight must be None")
        device = module_device(self)
        self.input_quantizer = TensorQuantizer(
            self._desc(quant_desc_input, self.default_quant_desc_input, "quant_desc_input")
        ).to(device)
        if has_weight:
            self.weight_quantizer = TensorQuantizer(
                self._desc(quant_desc_weight, self.default_quant_desc_weight, "quant_desc_weight")
            ).to(device)
        self.output_quantizer = TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR, disabled=True).to(device)

    @classmethod
    def from_float(cls, module: nn.Module, quant_desc_input=None, quant_desc_weight=None):
        """A quantized copy of a float module.

        The copy holds its own parameters and buffers with exactly the same values, dtype, device, requires_grad
        and training mode, and shares NO storage with ``module`` (training one never changes the other). Hooks and
        other attributes are copied too. ``module`` must be exactly ``cls._float_cls`` (a subclass may have its own
        forward, which the quantized class would silently drop): register a quantized class for subclasses.
        """
        new = recast_copy(cls, module)
        new._init_quantizers(quant_desc_input, quant_desc_weight)
        return new

    # --- forward helpers -------------------------------------------------------------------------------------------
    def _check_fake_quant(self) -> None:
        """ValueError when an enabled quantizer of this module is in real-quant mode (``fake_quant=False``)."""
        for q in _quantizers(self):
            if not q.fake_quant and q.is_enabled:
                name = next(n for n, m in self.named_modules() if m is q)
                raise ValueError(
                    f"{type(self).__name__}: quantizer {name!r} ({q.name or 'unnamed'}) has fake_quant=False. "
                    "Only fake quantization is supported in quantized modules (the float op would run on integer codes). "
                    "Set fake_quant=True, or use modelopt_lite.fake2real for real INT8 modules"
                )

    # read-only aliases of pytorch-quantization's attribute names
    _input_quantizer = property(lambda self: self.input_quantizer, doc="Alias of ``input_quantizer``.")
    _weight_quantizer = property(lambda self: self.weight_quantizer, doc="Alias of ``weight_quantizer``.")

    def _quant_output(self, out):
        """Apply the output quantizer (to the first element of a tuple output)."""
        if isinstance(out, tuple):
            return (self.output_quantizer(out[0]), *out[1:])
        return self.output_quantizer(out)
