"""``QuantModuleMixin``: what every quantized module shares (quantizer creation and ``from_float``).

Each quantized module owns ``input_quantizer``, ``weight_quantizer`` (modules with weights) and
``output_quantizer`` (disabled by default, applied to the output when enabled). The default descriptors are
immutable class constants; there is deliberately no ``set_default_quant_desc_*``: pass ``quant_desc_input=`` /
``quant_desc_weight=`` or configure the quantizers (``set_from_attribute_config`` / ``modelopt_lite.quantize``).
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
from torch import nn

from ...descriptor import (
    QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW,
    QUANT_DESC_8BIT_PER_TENSOR,
    ScaledQuantDescriptor,
)
from .._quantizer_config import as_descriptor
from ..tensor_quantizer import TensorQuantizer


def module_device(module: nn.Module) -> torch.device:
    """Device of the first parameter or buffer (CPU for a module without tensors)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


class QuantModuleMixin:
    """Mixin for ``QuantX(QuantModuleMixin, nn.X)``: builds the quantizers and converts float modules.

    Class attributes (immutable): ``default_quant_desc_input`` (8-bit per tensor), ``default_quant_desc_weight``
    (8-bit per channel on axis 0, or None for modules without weights), ``_float_cls`` (the torch class this one
    replaces).
    """

    #: "float" (default) or "integer": how a quantized Linear/Conv computes a quantized output (see
    #: ``_integer_requant``; set with :func:`modelopt_lite.set_requant` or a config's ``"requant"``)
    requant: str = "float"
    default_quant_desc_input: ClassVar[ScaledQuantDescriptor] = QUANT_DESC_8BIT_PER_TENSOR
    default_quant_desc_weight: ClassVar[ScaledQuantDescriptor | None] = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _float_cls: ClassVar[type]

    def _desc(self, value, default, what: str) -> ScaledQuantDescriptor:
        if value is None:
            return default
        return as_descriptor(value, f"{type(self).__name__} {what}")

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
        if type(module) is not cls._float_cls:
            raise TypeError(
                f"{cls.__name__}.from_float expects a {cls._float_cls.__module__}."
                f"{cls._float_cls.__qualname__}, got {type(module).__qualname__}"
            )
        new = copy.deepcopy(module)
        new.__class__ = cls
        new._init_quantizers(quant_desc_input, quant_desc_weight)
        return new

    # read-only aliases of pytorch-quantization's attribute names
    _input_quantizer = property(lambda self: self.input_quantizer, doc="Alias of ``input_quantizer``.")
    _weight_quantizer = property(lambda self: self.weight_quantizer, doc="Alias of ``weight_quantizer``.")

    def _quant_output(self, out):
        """Apply the output quantizer (to the first element of a tuple output)."""
        if isinstance(out, tuple):
            return (self.output_quantizer(out[0]), *out[1:])
        return self.output_quantizer(out)
