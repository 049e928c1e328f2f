"""``QuantLinear``: ``F.linear(input_quantizer(x), weight_quantizer(W), b)`` (the bias stays float)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...descriptor import QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
from .._svdquant_lora import lowrank_output
from . import _integer_requant
from ._base import QuantModuleMixin, reject_unused_keys
from ._integer_requant import IntegerRequantLayer
from ._registry import QuantModuleRegistry


@QuantModuleRegistry.register({nn.Linear: "nn.Linear"})
class QuantLinear(IntegerRequantLayer, QuantModuleMixin, nn.Linear):
    """``nn.Linear`` with quantized input and weight.

    Defaults: input 8-bit per tensor, weight 8-bit per row (axis 0, one amax per output feature). The output is
    exactly ``output_quantizer(F.linear(input_quantizer(x), weight_quantizer(self.weight), self.bias))``, or, with
    ``requant="integer"``, the integer requantization of an int8 kernel (see ``_integer_requant``). With SVDQuant
    factors on the weight quantizer (see ``nn._svdquant_lora``) the float low-rank branch is added before the output
    quantizer.
    """

    default_quant_desc_weight = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    _float_cls = nn.Linear

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        device=None,
        dtype=None,
        *,
        quant_desc_input=None,
        quant_desc_weight=None,
        **kwargs,
    ):
        reject_unused_keys(type(self), kwargs)
        super().__init__(in_features, out_features, bias, device, dtype)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def _float_forward(self, quantized_input, lowrank=None):
        """The float path from the input quantizer's output on (``lowrank``: SVDQuant's float branch, added before
        the output quantizer)."""
        out = F.linear(quantized_input, self.weight_quantizer(self.weight), self.bias)
        if lowrank is not None:
            out = out + lowrank
        return self.output_quantizer(out)

    def _integer_product(self, codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
        return F.linear(codes, weight_codes)

    def _integer_input_fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2  # a Gemm in ONNX

    def forward(self, input):
        self._check_fake_quant()
        if _integer_requant.active(self, input):
            return _integer_requant.integer_forward(self, input, self._float_forward)
        return self._float_forward(self.input_quantizer(input), lowrank_output(self, input))


Linear = QuantLinear
