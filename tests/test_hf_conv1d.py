"""Hugging Face's ``Conv1D`` (GPT-2's transposed linear layer) converts to a QuantLinear, as in ModelOpt."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.nn import QuantLinear, QuantModuleRegistry
from modelopt_lite.nn.modules.quant_conv1d_hf import QuantHFConv1D

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Conv1D(5, 3), nn.ReLU(), Conv1D(5, 5))  # Conv1D(nf=out, nx=in): weight (in, out)


def test_conv1d_is_registered_and_converts_to_a_linear_layout():
    assert Conv1D in QuantModuleRegistry and QuantModuleRegistry.get_key(Conv1D) == "Conv1D"
    ref = _model()
    model = mtq.replace_quant_module(_model())
    q = model[0]
    assert type(q) is QuantHFConv1D and isinstance(q, QuantLinear)
    assert q.weight.shape == (5, 3) and torch.equal(q.weight, ref[0].weight.t()) and q.weight.is_contiguous()
    assert (q.in_features, q.out_features) == (3, 5) and torch.equal(q.bias, ref[0].bias)
    assert ref[0].weight.shape == (3, 5)  # the float module is left as it was
    mtq.set_quantizer_attribute(model, "*", {"enable": False})
    x = torch.randn(2, 4, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-6, atol=1e-6)  # addmm vs linear: same math


def test_quantized_conv1d_equals_the_quantized_linear_it_is():
    x = torch.randn(6, 3)
    model = mtq.quantize(_model(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    w = model[0].weight
    assert torch.equal(model[0].weight_quantizer.amax, w.detach().abs().amax(1, keepdim=True))  # one row per output
    lin = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 5))
    lin = mtq.quantize(lin, mtq.INT8_DEFAULT_CFG)
    lin.load_state_dict(model.state_dict())  # the same state_dict layout as quantized Linears
    with torch.no_grad():
        assert torch.equal(lin(x), model(x))


def test_from_float_rejects_other_modules():
    with pytest.raises(TypeError, match="expects a transformers Conv1D, got Linear"):
        QuantHFConv1D.from_float(nn.Linear(3, 5))


def test_save_restore_into_a_float_model(tmp_path):
    x = torch.randn(6, 3)
    model = mtq.quantize(_model(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    mtq.save(model, tmp_path / "q")
    restored = mtq.restore(_model(), tmp_path / "q")  # a fresh float model with Conv1D layers
    assert type(restored[0]) is QuantHFConv1D and restored[0].weight.shape == (5, 3)
    with torch.no_grad():
        assert torch.equal(restored(x), model(x))
    assert QuantHFConv1D.converted_param_shapes(_model()[0]) == {"weight": [5, 3], "bias": [5]}


def test_modelopt_checkpoint_restores_into_a_float_model(tmp_path):
    import modelopt_lite.opt as mto

    x = torch.randn(6, 3)
    model = mtq.quantize(_model(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    mto.save(model, tmp_path / "ckpt.pth")
    restored = mto.restore(_model(), tmp_path / "ckpt.pth")
    assert type(restored[2]) is QuantHFConv1D
    with torch.no_grad():
        assert torch.equal(restored(x), model(x))
