"""A residual quantizer for Hugging Face's inline residual adds: ``LayerNorm(dropout(dense(h)) + input_tensor)``.

BERT-family encoders (``BertSelfOutput``, ``BertOutput``, and the classes of the same shape: Roberta, Electra,
XLM-R, ...) add the residual inside the forward of a small module::

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states

so no :class:`~.quant_add.ResidualAdd` can be put there. A finder on :data:`QuantModuleRegistry` turns each such
class (recognised by its structure: a ``transformers.models.*`` class whose own forward takes ``(hidden_states,
input_tensor)`` and is exactly those statements) into ``Quant<Name>(QuantHFResidualOutputMixin, <Name>)`` the first
time a model containing it is quantized. The quantized module computes::

    LayerNorm(dropout(dense(hidden_states)) + residual_input_quantizer(input_tensor))

TensorRT's placement (as :class:`~.quant_add.QuantResidualAdd`): Q/DQ on the skip branch only, so TensorRT fuses
the Add into the GEMM of ``dense``. ``residual_input_quantizer`` (QuantResidualAdd's name) is 8-bit per tensor and
**disabled** until a config enables it: the presets' ``"*input_quantizer"`` entries would reach it, so
:data:`~modelopt_lite.presets.base.DEFAULT_DISABLED` turns it off again in every preset (the presets keep
their behaviour); a later entry such as ``"*residual_input_quantizer": {"num_bits": 8, "axis": None, "enable":
True}`` turns it on. With it disabled the module runs its own float forward (bit-identical). Nothing global is
patched: only the converted instances change. The ``dense`` Linear child is converted as usual. Exported, the skip
branch is often also the input of the next GEMM (``BertSelfOutput``'s is the layer input, read by Q/K/V); with max
calibration both quantizers get the same amax and the exporter merges the two Q/DQ into one.

GPT-2 and Llama decoder layers add their residuals inline in the *layer's* forward (``residual + hidden_states``,
mixed with attention, MLP, caches and norms), not in a small module of this shape: they are not converted here.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from ...descriptor import QUANT_DESC_8BIT_PER_TENSOR, ScaledQuantDescriptor
from ..tensor_quantizer import TensorQuantizer
from ._base import module_device, recast_copy
from ._registry import QuantModuleRegistry

if TYPE_CHECKING:
    _MixinBase = nn.Module
else:
    _MixinBase = object

#: the statements of the forward this module re-implements (whitespace and type annotations ignored)
RESIDUAL_OUTPUT_BODY = (
    "hidden_states = self.dense(hidden_states)",
    "hidden_states = self.dropout(hidden_states)",
    "hidden_states = self.LayerNorm(hidden_states + input_tensor)",
    "return hidden_states",
)


@functools.cache
def _forward_body(cls: Any) -> tuple[str, ...] | None:
    fwd = vars(cls).get("forward")
    if fwd is None:
        return None
    try:
        params = list(inspect.signature(fwd).parameters)
        lines = inspect.getsource(fwd).splitlines()
    except (OSError, TypeError, ValueError):
        return None
    if params != ["self", "hidden_states", "input_tensor"]:
        return None
    body = [" ".join(line.split()) for line in lines[1:] if line.strip() and not line.strip().startswith("#")]
    return tuple(body)


def is_hf_residual_output_class(cls: type) -> bool:
    """A ``transformers.models.*`` module class whose own forward is ``LayerNorm(dropout(dense(h)) + input_tensor)``
    (the statements of :data:`RESIDUAL_OUTPUT_BODY`, taking ``(hidden_states, input_tensor)``)."""
    return (
        isinstance(cls, type)
        and issubclass(cls, nn.Module)
        and cls.__module__.startswith("transformers.models.")
        and _forward_body(cls) == RESIDUAL_OUTPUT_BODY  # type: ignore[arg-type]
    )


class QuantHFResidualOutputMixin(_MixinBase):
    """``LayerNorm(dropout(dense(h)) + residual_input_quantizer(input_tensor))``; see the module docstring."""

    default_quant_desc_input: ClassVar[ScaledQuantDescriptor] = QUANT_DESC_8BIT_PER_TENSOR
    _float_cls: ClassVar[type]
    residual_input_quantizer: TensorQuantizer
    dense: Any  # the float class's children
    dropout: Any
    LayerNorm: Any

    @classmethod
    def from_float(cls, module: nn.Module):
        """A quantized deep copy of ``module`` (exactly ``cls._float_cls``), residual quantizer disabled."""
        new = recast_copy(cls, module)
        new.residual_input_quantizer = TensorQuantizer(cls.default_quant_desc_input, disabled=True).to(
            module_device(new)
        )
        return new

    def forward(self, hidden_states, input_tensor):
        q = self.residual_input_quantizer
        if not q.is_enabled:
            return super().forward(hidden_states, input_tensor)
        if not q.fake_quant:
            raise ValueError(
                f"{type(self).__name__}: quantizer 'residual_input_quantizer' ({q.name or 'unnamed'}) has "
                "fake_quant=False; the residual add is only fake-quantized (the float add would run on integer codes)"
            )
        h = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(h + q(input_tensor))


@functools.cache
def _quant_class(cls: type) -> type:
    return type(
        f"Quant{cls.__name__}",
        (QuantHFResidualOutputMixin, cls),
        {
            "_float_cls": cls,
            "__module__": __name__,
            "__doc__": f"``{cls.__qualname__}`` with a residual quantizer on its inline residual add (disabled).",
        },
    )


def find_hf_residual_output(cls: type) -> type | None:
    """The registry finder: the quantized class of a Hugging Face residual-output class, else None."""
    return _quant_class(cls) if is_hf_residual_output_class(cls) else None


QuantModuleRegistry.add_finder(find_hf_residual_output)
