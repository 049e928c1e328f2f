"""Quantized normalization layers: ``output_quantizer(norm(input_quantizer(x)))`` (the affine parameters and the
running statistics stay float, as in ModelOpt and pytorch-quantization).

``QuantBatchNorm1d/2d/3d`` (ModelOpt) and ``QuantInstanceNorm1d/2d/3d`` (pytorch-quantization). The BatchNorm
classes are NOT in the registry by default: ModelOpt converts every BatchNorm and then disables its quantizers in
its presets; here ``quantize`` keeps the float BatchNorm (a Conv-BN export graph and its ORT agreement stay as
they were). Opt in with ``modelopt_lite.register(nn.BatchNorm2d, QuantBatchNorm2d)``; the presets still carry
ModelOpt's ``"nn.BatchNorm2d": {"*": {"enable": False}}`` entries.
"""

from __future__ import annotations

from torch import nn

from ._input_only import make_input_only

QuantBatchNorm1d = make_input_only(nn.BatchNorm1d, __name__, register=False)
QuantBatchNorm2d = make_input_only(nn.BatchNorm2d, __name__, register=False)
QuantBatchNorm3d = make_input_only(nn.BatchNorm3d, __name__, register=False)
QuantInstanceNorm1d = make_input_only(nn.InstanceNorm1d, __name__)
QuantInstanceNorm2d = make_input_only(nn.InstanceNorm2d, __name__)
QuantInstanceNorm3d = make_input_only(nn.InstanceNorm3d, __name__)

BatchNorm1d, BatchNorm2d, BatchNorm3d = QuantBatchNorm1d, QuantBatchNorm2d, QuantBatchNorm3d
InstanceNorm1d, InstanceNorm2d, InstanceNorm3d = QuantInstanceNorm1d, QuantInstanceNorm2d, QuantInstanceNorm3d
