"""``QuantEmbedding``: ``F.embedding(indices, weight_quantizer(W))``, the rows of the fake-quantized table.

The input is indices, so there is no input quantizer. Default weight quantization: 8-bit per row (axis 0, one amax
per embedding vector). ``max_norm`` renormalizes the float table in place first, as ``nn.Embedding`` does; the
quantized rows are then looked up. ``output_quantizer`` (disabled by default) applies to the looked-up vectors.
Any weight format works: per-row INT8/INT4 (``axis=0``), FP8 E4M3 per row or per tensor, INT4 blocks along the row.

ONNX export: the table is stored quantized (INT8/INT4/FLOAT8E4M3FN initializer) and dequantized *before* the
lookup, ``codes -> DequantizeLinear(axis 0) -> Gather(indices)``. Gathering after dequantization copies exact
values, so ONNX Runtime reproduces torch bit for bit; it is also the layout ModelOpt's ONNX INT4 pass writes for
Gather weights, which TensorRT parses as a weight DequantizeLinear feeding Gather. (The other order, ``Gather`` of
the codes then ``DequantizeLinear``, would need per-index scales, which standard DequantizeLinear cannot take.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...descriptor import QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW, QUANT_DESC_8BIT_PER_TENSOR
from ..tensor_quantizer import TensorQuantizer
from ._base import QuantModuleMixin, module_device
from ._registry import QuantModuleRegistry


@QuantModuleRegistry.register({nn.Embedding: "nn.Embedding"})
class QuantEmbedding(QuantModuleMixin, nn.Embedding):
    """``nn.Embedding`` with a quantized weight (``weight_quantizer``, per row by default) and no input quantizer."""

    default_quant_desc_weight = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _float_cls = nn.Embedding

    if TYPE_CHECKING:
        weight: torch.Tensor

    def __init__(self, *args, quant_desc_weight=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(None, quant_desc_weight)

    @classmethod
    def set_default_quant_desc_input(cls, value) -> None:
        raise TypeError(f"{cls.__name__} has no input quantizer (its input are indices)")

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        if quant_desc_input is not None:
            raise TypeError(f"{type(self).__name__} has no input quantizer (its input are indices)")
        device = module_device(self)
        desc = self._desc(quant_desc_weight, self.default_quant_desc_weight, "quant_desc_weight")
        self.weight_quantizer = TensorQuantizer(desc).to(device)
        self.output_quantizer = TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR, disabled=True).to(device)

    def forward(self, input):
        self._check_fake_quant()
        if self.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, input.contiguous(), self.max_norm, self.norm_type)
        out = F.embedding(
            input,
            self.weight_quantizer(self.weight),
            self.padding_idx,
            None,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )
        return self.output_quantizer(out)


Embedding = QuantEmbedding
