"""Quantized activations: ``QuantLeakyReLU`` (the activation ModelOpt registers), input quantizer only.

The presets disable its quantizers (``"nn.LeakyReLU": {"*": {"enable": False}}``) as ModelOpt's do; enable them
with a config rule. With ``inplace=True`` the activation runs in place on the quantized copy of the input, so the
caller's tensor is not modified.
"""

from __future__ import annotations

from torch import nn

from ._input_only import make_input_only

QuantLeakyReLU = make_input_only(nn.LeakyReLU, __name__)

LeakyReLU = QuantLeakyReLU
