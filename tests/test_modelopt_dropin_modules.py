"""ModelOpt drop-in gaps of the quantized modules and the quantizer found by running ModelOpt's own unit tests
(test_quant_conv, test_quant_instancenorm, test_quant_rnn, test_mse_calibrator, test_affine_quant; imports changed
only): ModelOpt's module paths, its TensorQuantizer keywords and its calibrator and utility names."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelopt_lite.nn.modules import quant_norm
from modelopt_lite.nn.modules.quant_conv_transpose import QuantConvTranspose2d


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_transpose_classes_are_importable_from_quant_conv(dims):
    quant_conv = importlib.import_module("modelopt_lite.nn.modules.quant_conv")
    cls = getattr(quant_conv, f"QuantConvTranspose{dims}d")
    assert cls is getattr(importlib.import_module("modelopt_lite.nn.modules.quant_conv_transpose"), cls.__name__)
    m = cls(3, 5, 3, bias=False)
    m.input_quantizer.disable()
    m.weight_quantizer.disable()
    x = torch.randn((2, 3) + (6,) * dims)
    f = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[dims - 1]
    assert torch.equal(m(x), f(x, m.weight))


def test_conv_transpose_from_quant_conv_quantizes_its_weight_per_output_channel():
    from modelopt_lite.nn.modules.quant_conv import QuantConvTranspose2d as FromQuantConv

    assert FromQuantConv is QuantConvTranspose2d
    assert FromQuantConv(3, 5, 3).weight_quantizer.axis == 1


@pytest.mark.parametrize(
    ("module", "prefix"), [("quant_instancenorm", "QuantInstanceNorm"), ("quant_batchnorm", "QuantBatchNorm")]
)
def test_norm_module_paths_of_modelopt(module, prefix):
    mod = importlib.import_module(f"modelopt_lite.nn.modules.{module}")
    assert sorted(mod.__all__) == [f"{prefix}{d}d" for d in (1, 2, 3)]
    for d in (1, 2, 3):
        assert getattr(mod, f"{prefix}{d}d") is getattr(quant_norm, f"{prefix}{d}d")
    m = mod.__dict__[f"{prefix}2d"](3, affine=True)
    m.input_quantizer.disable()
    x = torch.randn(2, 3, 4, 4)
    ref = (nn.InstanceNorm2d if prefix == "QuantInstanceNorm" else nn.BatchNorm2d)(3, affine=True)
    assert torch.equal(m(x), ref(x))
