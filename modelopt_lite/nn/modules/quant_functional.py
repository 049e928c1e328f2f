"""Functional ops as modules, so they can be quantized: ``MatMul`` / ``QuantMatMul`` and ``Add`` / ``QuantAdd``.

Write ``self.matmul = MatMul()`` (attention scores, ``attn @ v``) or ``self.add = Add()`` (residual adds) in a
model; ``QuantMatMul.from_float`` / ``QuantAdd.from_float`` (or ``modelopt_lite.quantize``) then quantizes both
operands: ``input_quantizer`` for the first, ``other_input_quantizer`` for the second (the names end in
``input_quantizer`` so ``"*input_quantizer"`` config patterns reach both).
"""

from __future__ import annotations

import torch
from torch import nn

from ..tensor_quantizer import TensorQuantizer
from ._base import QuantModuleMixin, module_device
from ._registry import QuantModuleRegistry


class MatMul(nn.Module):
    """``torch.matmul(input, other)`` as a module."""

    def forward(self, input, other):
        return torch.matmul(input, other)


class Add(nn.Module):
    """``input + other`` as a module (residual connections)."""

    def forward(self, input, other):
        return input + other


class _QuantBinary(QuantModuleMixin):
    """Two quantized operands: ``input_quantizer`` (first) and ``other_input_quantizer`` (second).

    Both use ``quant_desc_input`` (default 8-bit per tensor); the ``output_quantizer`` is disabled by default.
    """

    default_quant_desc_weight = None

    def __init__(self, *, quant_desc_input=None):
        super().__init__()
        self._init_quantizers(quant_desc_input)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        super()._init_quantizers(quant_desc_input, quant_desc_weight)
        desc = self._desc(quant_desc_input, self.default_quant_desc_input, "quant_desc_input")
        self.other_input_quantizer = TensorQuantizer(desc).to(module_device(self))


@QuantModuleRegistry.register({MatMul: "MatMul"})
class QuantMatMul(_QuantBinary, MatMul):
    """``output_quantizer(torch.matmul(input_quantizer(a), other_input_quantizer(b)))``."""

    _float_cls = MatMul

    def forward(self, input, other):
        self._check_fake_quant()
        out = torch.matmul(self.input_quantizer(input), self.other_input_quantizer(other))
        return self.output_quantizer(out)


@QuantModuleRegistry.register({Add: "Add"})
class QuantAdd(_QuantBinary, Add):
    """``output_quantizer(input_quantizer(a) + other_input_quantizer(b))``."""

    _float_cls = Add

    def forward(self, input, other):
        self._check_fake_quant()
        return self.output_quantizer(self.input_quantizer(input) + self.other_input_quantizer(other))
