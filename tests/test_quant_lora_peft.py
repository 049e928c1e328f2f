"""peft LoRA Linear layers quantize their merged weight (ModelOpt's input/weight/output quantizers); needs peft."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite as mtq
import modelopt_lite.opt as mto
from modelopt_lite.nn import QuantLinear, QuantModuleRegistry, TensorQuantizer
from modelopt_lite.nn.modules.quant_lora_peft import QuantLoraLinearMixin, quant_lora_class

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: E402


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 12)
        self.v = nn.Linear(12, 8, bias=False)

    def forward(self, x):
        return self.v(torch.relu(self.q(x)))


def _peft(seed: int = 0, **cfg) -> nn.Module:
    torch.manual_seed(seed)
    model = get_peft_model(_Net(), LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"], **cfg))
    with torch.no_grad():  # lora_B starts at zero: give the adapters something to add
        for m in model.modules():
            if isinstance(m, LoraLinear):
                m.lora_B["default"].weight.copy_(torch.randn_like(m.lora_B["default"].weight) * 0.1)
    return model.eval()


def _x() -> torch.Tensor:
    return torch.randn(6, 16, generator=torch.Generator().manual_seed(3))


def _loras(model) -> list:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def test_lora_linear_gets_modelopt_quantizers_and_keeps_its_children_float():
    assert LoraLinear in QuantModuleRegistry and QuantModuleRegistry.get(LoraLinear) is quant_lora_class(LoraLinear)
    model = mtq.replace_quant_module(_peft())
    loras = _loras(model)
    assert len(loras) == 2
    for m in loras:
        assert type(m) is quant_lora_class(LoraLinear) and isinstance(m, QuantLoraLinearMixin)
        assert m.weight_quantizer.is_enabled and m.input_quantizer.is_enabled and not m.output_quantizer.is_enabled
        assert type(m.base_layer) is nn.Linear and type(m.lora_A["default"]) is nn.Linear
    names = [n for n, m in model.named_modules() if isinstance(m, TensorQuantizer)]
    assert len(names) == 6 and not any("base_layer" in n or "lora_" in n for n in names)


def test_outputs_equal_peft_with_quantizers_disabled():
    ref, model = _peft(), mtq.replace_quant_module(_peft())
    mtq.set_quantizer_attribute(model, "*", {"enable": False})
    with torch.no_grad():
        assert torch.equal(model(_x()), ref(_x()))


def test_quantized_output_is_the_merged_layer_quantized_and_survives_merge_and_unload():
    x = _x()
    model = mtq.quantize(_peft(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    q = _loras(model)[0]
    ref = _loras(_peft())[0]
    merged_w = ref.base_layer.weight + ref.get_delta_weight("default")
    assert torch.equal(q.weight_quantizer.amax, merged_w.abs().amax(1, keepdim=True))  # calibrated on W + delta
    with torch.no_grad():
        want = F.linear(q.input_quantizer(x), q.weight_quantizer(merged_w), ref.base_layer.bias)
        assert torch.equal(q(x), want)
        out = model(x)
        merged = copy.deepcopy(model).merge_and_unload()
    assert type(merged.q) is QuantLinear and merged.q.weight_quantizer.amax is not None
    with torch.no_grad():
        assert torch.equal(merged(x), out)


def test_weight_only_calibration_sees_the_merged_weight():
    model = mtq.quantize(_peft(), mtq.INT8_DEFAULT_CFG)  # no forward loop: weights only
    ref = _loras(_peft())[1]
    want = (ref.base_layer.weight + ref.get_delta_weight("default")).abs().amax(1, keepdim=True)
    assert torch.equal(_loras(model)[1].weight_quantizer.amax, want)


def test_gradients_reach_the_adapters_through_the_weight_quantizer():
    x = _x()
    model = mtq.quantize(_peft(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model(x).square().sum().backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trained)


def test_save_restore_and_mto_restore_into_a_fresh_peft_model(tmp_path):
    x = _x()
    model = mtq.quantize(_peft(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with torch.no_grad():
        want = model(x)
    mtq.save(model, tmp_path / "q")
    restored = mtq.restore(_peft(), tmp_path / "q")
    from_state = mto.restore_from_modelopt_state(_peft(), mto.modelopt_state(model))
    from_state.load_state_dict(model.state_dict())
    with torch.no_grad():
        for m in (restored, from_state):
            assert type(_loras(m)[0]) is quant_lora_class(LoraLinear)
            assert torch.equal(m(x), want)


def test_fan_in_fan_out_conv1d_base():
    transformers = pytest.importorskip("transformers")

    class _Gpt2Like(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = transformers.pytorch_utils.Conv1D(12, 16)  # weight (in=16, out=12)

        def forward(self, x):
            return self.c_attn(x)

    torch.manual_seed(0)
    cfg = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(_Gpt2Like(), cfg)
    lora = _loras(model)[0]
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_()
    ref = copy.deepcopy(model)
    x = _x()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    q = _loras(model)[0]
    w = (ref.base_model.model.c_attn.base_layer.weight + _loras(ref)[0].get_delta_weight("default")).t()
    assert q.weight_quantizer.amax.shape == (12, 1) and torch.equal(q.quantizer_weight(), w)
    mtq.set_quantizer_attribute(model, "*", {"enable": False})
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_unsupported_cases_raise():
    x = _x()
    model = mtq.quantize(_peft(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with pytest.raises(NotImplementedError, match="adapter_names"):
        _loras(model)[0](x, adapter_names=["default"] * 6)
    base_quantized = mtq.quantize(_Net(), mtq.INT8_DEFAULT_CFG)
    wrapped = get_peft_model(base_quantized, LoraConfig(r=2, target_modules=["q"]))
    with pytest.raises(TypeError, match=r"base layer \(QuantLinear\) is already quantized .*'input_quantizer'"):
        mtq.replace_quant_module(wrapped)
    dora = _peft(use_dora=True)
    with pytest.raises(NotImplementedError, match=r"adapter 'default' is a LoRA variant \(DoraLinearVariant\)"):
        mtq.quantize(dora, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    assert type(_loras(dora)[0]) is LoraLinear  # quantize is atomic
    with pytest.raises(TypeError, match="expects a peft LoRA Linear, got Linear"):
        quant_lora_class(LoraLinear).from_float(nn.Linear(2, 2))


def test_lora_bias_is_merged_into_the_bias():
    torch.manual_seed(0)
    model = get_peft_model(_Net(), LoraConfig(r=2, target_modules=["q"], lora_bias=True)).eval()
    lora = _loras(model)[0]
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_()
        lora.lora_B["default"].bias.normal_()
    x = _x()
    model = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with torch.no_grad():
        out = model(x)
        merged = copy.deepcopy(model).merge_and_unload()
        assert torch.equal(merged(x), out)
    mtq.set_quantizer_attribute(model, "*", {"enable": False})
    mtq.set_quantizer_attribute(merged, "*", {"enable": False})
    with torch.no_grad():
        assert torch.allclose(model(x), merged(x), rtol=1e-5, atol=1e-6)  # float LoRA branch vs merged weights


def test_weight_mse_search_reads_the_merged_weight():
    x = _x()
    cfg = {**mtq.INT8_DEFAULT_CFG, "algorithm": {"method": "mse", "step_size": 0.25}}
    model = mtq.quantize(_peft(), cfg, lambda m: m(x))
    ref = _loras(_peft())[0]
    merged = ref.base_layer.weight + ref.get_delta_weight("default")
    amax = _loras(model)[0].weight_quantizer.amax
    row_max = merged.abs().amax(1, keepdim=True)
    assert amax.shape == (12, 1)
    losses = []  # the search's squared error of each row at each multiplier, on the merged weight
    for m in torch.linspace(0.25, 4.0, 16):
        fq = mtq.tensor_quant.fake_tensor_quant(merged.detach(), (row_max * m).detach())
        losses.append(((fq - merged.detach()) ** 2).sum(1))
    best = torch.stack(losses).argmin(0)  # the first minimum wins, as in the search
    want = row_max.detach() * torch.linspace(0.25, 4.0, 16)[best].unsqueeze(1)
    torch.testing.assert_close(amax, want, rtol=1e-6, atol=0)


def test_calib_calibrate_weights_reads_the_merged_weight():
    from modelopt_lite.calib import calibrate_weights

    model = mtq.replace_quant_module(_peft())
    calibrate_weights(model, "max")
    ref = _loras(_peft())[0]
    want = (ref.base_layer.weight + ref.get_delta_weight("default")).abs().amax(1, keepdim=True)
    torch.testing.assert_close(_loras(model)[0].weight_quantizer.amax, want, rtol=0, atol=0)


def test_a_quantized_model_pickles(tmp_path):
    x = _x()
    model = mtq.quantize(_peft(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert type(_loras(loaded)[0]) is quant_lora_class(LoraLinear)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_merge_gives_a_quantized_base_layer_the_lora_quantizers():
    x = _x()
    model = mtq.quantize(_peft(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    lora = _loras(model)[0]
    lora.base_layer = QuantLinear.from_float(lora.base_layer)  # what a restored ModelOpt state holds
    with torch.no_grad():
        out = model(x)
        merged = model.merge_and_unload()
        assert merged.q.weight_quantizer is lora.weight_quantizer and merged.q.input_quantizer is lora.input_quantizer
        assert torch.equal(merged(x), out)
