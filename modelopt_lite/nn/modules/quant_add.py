"""``ResidualAdd`` / ``QuantResidualAdd``: a residual add with Q/DQ where TensorRT's fusions want it.

TensorRT fuses an element-wise Add into the Conv/GEMM that produces one of its inputs (the Add becomes the
layer's epilogue, computed on the accumulator) when the *other* input of the Add arrives quantized (Q/DQ on the
skip branch). A Q/DQ on the Conv/GEMM output instead forces the layer to write a quantized tensor and runs the
Add as a separate layer, and an Add with no Q/DQ at all stays in float. pytorch-quantization's ResNet example
places its ``residual_quantizer`` the same way, by hand.

``QuantResidualAdd`` is that placement as a module::

    self.add = ResidualAdd()                      # in the float model
    out = self.add(self.bn2(self.conv2(y)), identity)   # (main branch, skip branch)

``modelopt_lite.quantize`` converts it to ``QuantResidualAdd``: ``output_quantizer(input +
residual_input_quantizer(residual))``. ``input`` (the Conv/GEMM output) is never quantized; the residual quantizer
is 8-bit per tensor by default and its name ends in ``input_quantizer``, so presets' ``"*input_quantizer"`` entries
configure it. Exported, the graph is ``Add(conv_out, DequantizeLinear(QuantizeLinear(residual)))``.
(:class:`~.quant_functional.QuantAdd` quantizes both operands: the placement for an Add between two activations
that no Conv/GEMM produces.)
"""

from __future__ import annotations

from torch import nn

from ...descriptor import QUANT_DESC_8BIT_PER_TENSOR
from ..tensor_quantizer import TensorQuantizer
from ._base import QuantModuleMixin, module_device
from ._registry import QuantModuleRegistry


class ResidualAdd(nn.Module):
    """``input + residual`` as a module: ``input`` is the main branch (a Conv/GEMM output), ``residual`` the skip."""

    def forward(self, input, residual):
        return input + residual


@QuantModuleRegistry.register({ResidualAdd: "ResidualAdd"})
class QuantResidualAdd(QuantModuleMixin, ResidualAdd):
    """``output_quantizer(input + residual_input_quantizer(residual))``; the main branch stays in float."""

    default_quant_desc_weight = None
    _float_cls = ResidualAdd

    def __init__(self, *, quant_desc_input=None):
        super().__init__()
        self._init_quantizers(quant_desc_input)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        if quant_desc_weight is not None:
            raise TypeError(f"{type(self).__name__} has no weight; quant_desc_weight must be None")
        device = module_device(self)
        desc = self._desc(quant_desc_input, self.default_quant_desc_input, "quant_desc_input")
        self.residual_input_quantizer = TensorQuantizer(desc).to(device)
        self.output_quantizer = TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR, disabled=True).to(device)

    def forward(self, input, residual):
        self._check_fake_quant()
        return self.output_quantizer(input + self.residual_input_quantizer(residual))
