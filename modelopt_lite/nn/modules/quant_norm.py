"""Quantized normalization layers: ``output_quantizer(norm(input_quantizer(x)))`` (the affine parameters and the
running statistics stay float, as in ModelOpt and pytorch-quantization).

``QuantBatchNorm1d/2d/3d`` (ModelOpt) and ``QuantInstanceNorm1d/2d/3d`` (pytorch-quantization). The presets
disable the BatchNorm quantizers (``"nn.BatchNorm2d": {"*": {"enable": False}}``), as ModelOpt's do: a BatchNorm
usually folds into the convolution before it.
"""

from __future__ import annotations

from torch import nn

from ._input_only import make_input_only

QuantBatchNorm1d = make_input_only(nn.BatchNorm1d, __name__)
QuantBatchNorm2d = make_input_only(nn.BatchNorm2d, __name__)
QuantBatchNorm3d = make_input_only(nn.BatchNorm3d, __name__)
QuantInstanceNorm1d = make_input_only(nn.InstanceNorm1d, __name__)
QuantInstanceNorm2d = make_input_only(nn.InstanceNorm2d, __name__)
QuantInstanceNorm3d = make_input_only(nn.InstanceNorm3d, __name__)

BatchNorm1d, BatchNorm2d, BatchNorm3d = QuantBatchNorm1d, QuantBatchNorm2d, QuantBatchNorm3d
InstanceNorm1d, InstanceNorm2d, InstanceNorm3d = QuantInstanceNorm1d, QuantInstanceNorm2d, QuantInstanceNorm3d
