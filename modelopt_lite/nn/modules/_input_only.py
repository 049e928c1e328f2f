"""Quantized modules with only an input quantizer: ``output_quantizer(float_forward(input_quantizer(x)))``.

Pooling, normalization and activation layers are made this way (one class per float class, built by
:func:`make_input_only`, registered in :data:`QuantModuleRegistry`). The output quantizer is disabled by default.
"""

from __future__ import annotations

from ._base import QuantModuleMixin
from ._registry import QuantModuleRegistry


class QuantInputOnlyMixin(QuantModuleMixin):
    """Accepts the float class's arguments plus ``quant_desc_input=`` (keyword only); no weight quantizer."""

    default_quant_desc_weight = None

    def __init__(self, *args, quant_desc_input=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input)

    def forward(self, input, *args, **kwargs):
        self._check_fake_quant()
        return self._quant_output(super().forward(self.input_quantizer(input), *args, **kwargs))


def make_input_only(float_cls: type, module: str, what: str = "quantized input", register: bool = True) -> type:
    """``Quant<Name>(QuantInputOnlyMixin, float_cls)``, registered for ``float_cls`` under ``"nn.<Name>"`` unless
    ``register`` is False."""
    doc = f"``nn.{float_cls.__name__}`` with a {what} (8-bit per tensor by default); output quantizer disabled."
    cls = type(
        f"Quant{float_cls.__name__}",
        (QuantInputOnlyMixin, float_cls),
        {"_float_cls": float_cls, "__doc__": doc, "__module__": module},
    )
    return QuantModuleRegistry.register({float_cls: f"nn.{float_cls.__name__}"})(cls) if register else cls
