"""PEFT LoRA layers (``peft.tuners.lora.layer.Linear``) quantized as ModelOpt does: the merged weight, one GEMM.

A LoRA layer computes ``base(x) + scaling * B(A(dropout(x)))``. Deployed, the adapter is merged into the base weight,
so (as in ModelOpt) the quantized layer quantizes what the merged layer computes::

    output_quantizer(F.linear(input_quantizer(x), weight_quantizer(W + sum_a delta_a), b + sum_a bias_a))

where ``delta_a`` is peft's own ``get_delta_weight(a)`` (``scaling * B @ A``, in the base layer's layout) of each
active adapter, and ``bias_a`` the ``lora_bias`` term: training with LoRA then sees the quantization error of the
weights it will ship, the gradients reach ``lora_A`` / ``lora_B`` through the weight quantizer (straight-through),
and ``merge()`` / ``merge_and_unload()`` keep the outputs: ``merge`` turns an ``nn.Linear`` base layer into a
``QuantLinear`` holding the same three quantizers (shared with the LoRA layer until it is unloaded; a base layer
that is a ``QuantLinear`` already, as a restored ModelOpt state makes it, gets them too).

The layer gets ModelOpt's ``input_quantizer``, ``weight_quantizer`` (per output channel) and ``output_quantizer``
(disabled). Its children are NOT converted: the base layer and ``lora_A`` / ``lora_B`` stay float (ModelOpt converts
them too, and their quantizers are never used in its forward). Differences from peft's float forward: the adapters'
``lora_dropout`` is not applied (the merged weight has no dropout, as in ModelOpt); with every quantizer disabled
the layer runs peft's own forward (outputs identical to the float layer). A base layer with ``fan_in_fan_out``
(GPT-2's ``Conv1D``) is handled (ModelOpt's forward is not). Not supported, with an error: mixed-adapter batches
(``adapter_names=``) and LoRA variants (DoRA, ...) while a quantizer is enabled, and a LoRA layer whose base layer
is already quantized (quantize the model once, after adding the adapters).

The class is found by a registry finder on first sight, so ``peft`` is never imported here (it is an optional
dependency): ``Quant<Name>(QuantLoraLinearMixin, peft's Linear)`` subclasses peft's class.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_quantizer import TensorQuantizer
from ._base import QuantModuleMixin, module_device, recast_copy
from ._registry import QuantModuleRegistry
from .quant_linear import QuantLinear

_LORA_MODULE = "peft.tuners.lora.layer"


def is_peft_lora_linear_class(cls) -> bool:
    """``peft.tuners.lora.layer.Linear`` exactly (recognised by module and name; peft is not imported)."""
    return isinstance(cls, type) and cls.__module__ == _LORA_MODULE and cls.__name__ == "Linear"


def _quantizer_children(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if isinstance(m, TensorQuantizer)]


class QuantLoraLinearMixin(QuantModuleMixin):
    """peft's LoRA ``Linear`` quantizing its merged weight (see the module docstring)."""

    #: _convert_tree leaves the children float (the base layer and the adapters are quantized here, merged)
    _quant_keep_children_float = True
    base_layer: nn.Module
    lora_A: nn.ModuleDict
    lora_B: nn.ModuleDict
    lora_bias: dict
    lora_variant: dict
    scaling: dict
    fan_in_fan_out: bool
    merged: bool
    disable_adapters: bool
    active_adapters: list
    get_delta_weight: Any

    @classmethod
    def from_float(cls, module: nn.Module, quant_desc_input=None, quant_desc_weight=None):
        """A quantized copy of a peft LoRA ``Linear`` (adapters, base layer and peft's state copied); ``module``
        itself is not changed."""
        if not is_peft_lora_linear_class(type(module)):
            raise TypeError(f"{cls.__name__}.from_float expects a peft LoRA Linear, got {type(module).__qualname__}")
        base = getattr(module, "base_layer", None)
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(
                f"{cls.__name__}.from_float: the LoRA base layer must hold a 2-D weight, got {type(base).__name__}"
            )
        held = _quantizer_children(base) if isinstance(base, nn.Module) else []
        if held:
            raise TypeError(
                f"{cls.__name__}.from_float: the LoRA layer's base layer ({type(base).__name__}) is already quantized "
                f"(it holds {held[0]!r}); quantize the model once, after adding the adapters"
            )
        new = recast_copy(cls, module)
        new._init_quantizers(quant_desc_input, quant_desc_weight)
        for a in getattr(new, "lora_variant", {}):
            new._check_plain(a)
        return new

    def _check_plain(self, adapter: str) -> None:
        variant = self.lora_variant.get(adapter)
        if variant is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: adapter {adapter!r} is a LoRA variant ({type(variant).__name__}); only plain "
                "LoRA is quantized"
            )

    # --- the merged weight -------------------------------------------------------------------------------------------
    def _adapters(self) -> list[str]:
        """The active adapters whose delta is added (none while merged or disabled)."""
        if self.merged or self.disable_adapters:
            return []
        return [a for a in self.active_adapters if a in self.lora_A]

    def quantizer_weight(self) -> torch.Tensor:
        """The weight the weight quantizer sees, in ``nn.Linear``'s ``(out, in)`` layout: the base weight plus the
        delta of every active adapter (peft's ``get_delta_weight``)."""
        w: Any = self.base_layer.weight
        for a in self._adapters():
            self._check_plain(a)
            w = (w + self.get_delta_weight(a)).to(w.dtype)  # as merge's in-place add: one sum in the wider dtype
        return w.t() if self.fan_in_fan_out else w

    def _merged_bias(self) -> torch.Tensor | None:
        b: Any = getattr(self.base_layer, "bias", None)
        for a in self._adapters():
            if self.lora_bias.get(a, False):
                extra = self.lora_B[a].bias * self.scaling[a]
                b = extra if b is None else (b + extra).to(b.dtype)
        return b

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not any(q.is_enabled for q in (self.input_quantizer, self.weight_quantizer, self.output_quantizer)):
            return super().forward(x, *args, **kwargs)  # peft's float forward
        self._check_fake_quant()
        if kwargs.get("adapter_names") is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: mixed-adapter batches (adapter_names=...) are not supported while a "
                "quantizer is enabled (the quantized layer computes one merged weight)"
            )
        if self.disable_adapters and self.merged:
            self.unmerge()  # type: ignore[operator]  # as peft's forward does
        out = F.linear(self.input_quantizer(x), self.weight_quantizer(self.quantizer_weight()), self._merged_bias())
        return self.output_quantizer(out)

    def merge(self, *args: Any, **kwargs: Any) -> None:
        """peft's merge; an ``nn.Linear`` base layer then becomes a ``QuantLinear`` sharing this layer's quantizers,
        so the layer ``merge_and_unload`` returns quantizes as this one does."""
        super().merge(*args, **kwargs)  # type: ignore[misc]
        base = self.base_layer
        if not self.merged:
            return
        if type(base) is nn.Linear:
            base = self.base_layer = QuantLinear.from_float(base).to(module_device(base))
        if isinstance(base, QuantLinear):  # also a base layer quantized by a ModelOpt state (its own are unused)
            base.input_quantizer = self.input_quantizer
            base.weight_quantizer = self.weight_quantizer
            base.output_quantizer = self.output_quantizer


@functools.cache
def quant_lora_class(float_cls: type) -> type:
    """``Quant<Name>(QuantLoraLinearMixin, float_cls)`` for peft's LoRA ``Linear``."""
    return type(
        "QuantLoraLinear",
        (QuantLoraLinearMixin, float_cls),
        {"_float_cls": float_cls, "__module__": __name__, "__doc__": QuantLoraLinearMixin.__doc__},
    )


def __getattr__(name: str) -> type:
    """``QuantLoraLinear`` by name (what unpickling a quantized model looks up); imports peft's LoRA layer only then."""
    if name == "QuantLoraLinear":
        return quant_lora_class(importlib.import_module(_LORA_MODULE).Linear)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def find_peft_lora(cls: type) -> type | None:
    """The registry finder: the quantized class of peft's LoRA ``Linear``, else None."""
    return quant_lora_class(cls) if is_peft_lora_linear_class(cls) else None


QuantModuleRegistry.add_finder(find_peft_lora)
