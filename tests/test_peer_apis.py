"""ModelOpt / pytorch-quantization APIs users call by their peers' names (issue 26): ``set_quantizer_by_cfg_context``,
``model_calib``, ``plugins.register_attention_for_kv_quant``, writable ``num_bits`` / ``unsigned``, int ``axis`` of
the per-channel defaults, unbound functional ops, and the peers' fake-quant error text."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import tensor_quant
from modelopt_lite.conversion.config import QuantConfigError
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import QuantLinear, SequentialQuantizer, TensorQuantizer


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(1))


def test_set_quantizer_by_cfg_context_restores_everything():
    x = _x()
    model = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with torch.no_grad():
        y0 = model(x)
    amax0 = model[0].weight_quantizer.amax.clone()
    cfg = {"*weight_quantizer": {"num_bits": 4, "axis": None}, "*input_quantizer": {"enable": False}}
    with mtq.set_quantizer_by_cfg_context(model, cfg) as applied:
        assert applied["0.weight_quantizer"] and model[0].weight_quantizer.num_bits == 4
        assert not model[0].input_quantizer.is_enabled and model[0].weight_quantizer.amax is None
    assert model[0].weight_quantizer.num_bits == 8 and model[0].input_quantizer.is_enabled
    assert torch.equal(model[0].weight_quantizer.amax, amax0)
    with (
        pytest.raises(RuntimeError, match="boom"),
        mtq.set_quantizer_by_cfg_context(
            model, {"*weight_quantizer": [{"num_bits": 4, "block_sizes": {-1: 8}}, {"num_bits": (4, 3)}]}
        ),
    ):
        assert isinstance(model[0].weight_quantizer, SequentialQuantizer)
        raise RuntimeError("boom")
    assert isinstance(model[0].weight_quantizer, TensorQuantizer)
    with torch.no_grad():
        assert torch.equal(model(x), y0)
    with (
        pytest.raises(QuantConfigError),
        mtq.set_quantizer_by_cfg_context(model, {"*weight_quantizer": {"num_bits": 99}}),
    ):
        pass
    with torch.no_grad():
        assert torch.equal(model(x), y0)


def test_model_calib_entry_points_match_the_config_algorithms():
    from modelopt_lite.model_calib import max_calibrate, smoothquant

    assert mtq.model_calib.max_calibrate is max_calibrate
    x = _x()
    ref = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model = mtq.quantize(_mlp(), {**mtq.INT8_DEFAULT_CFG, "algorithm": None})
    assert model[0].input_quantizer.amax is None
    assert max_calibrate(model, lambda m: m(x), distributed_sync=True) is model
    for (n, a), (_, b) in zip(ref.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    weights_only = mtq.quantize(_mlp(), {**mtq.INT8_DEFAULT_CFG, "algorithm": None})
    max_calibrate(weights_only)
    assert torch.equal(weights_only[0].weight_quantizer.amax, ref[0].weight_quantizer.amax)
    assert weights_only[0].input_quantizer.amax is None

    sq_cfg = {**mtq.INT8_SMOOTHQUANT_CFG, "algorithm": {"method": "smoothquant", "alpha": 1.0}}
    ref_sq = mtq.quantize(_mlp(), sq_cfg, lambda m: m(x))
    sq = smoothquant(mtq.quantize(_mlp(), {**mtq.INT8_SMOOTHQUANT_CFG, "algorithm": None}), lambda m: m(x))
    with torch.no_grad():
        assert torch.equal(sq(x), ref_sq(x))
    before = sq[0].weight.clone()
    with pytest.raises(QuantConfigError, match="unknown parameter"):
        mtq.model_calib.awq(sq, lambda m: m(x), algorithm="awq_lite", not_a_param=1)
    assert torch.equal(sq[0].weight, before)


def test_stats_collection_helpers():
    x = _x()
    model = mtq.quantize(_mlp(), {**mtq.INT8_DEFAULT_CFG, "algorithm": None})
    mtq.model_calib.enable_stats_collection(model)
    assert model[0].input_quantizer.is_calib_enabled and not model[0].input_quantizer.is_quant_enabled
    model(x)
    mtq.model_calib.finish_stats_collection(model)
    assert torch.equal(model[0].input_quantizer.amax, x.abs().amax())
    assert model[0].input_quantizer.is_quant_enabled and not model[0].input_quantizer.is_calib_enabled


class _MyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)


class _NoAttention(nn.Module):
    def forward(self, x):
        return x * 2


def test_register_attention_for_kv_quant():
    from modelopt_lite.plugins import register_attention_for_kv_quant

    assert register_attention_for_kv_quant(_NoAttention) is False
    assert register_attention_for_kv_quant(_MyAttention) is True
    try:
        model = mtq.quantize(nn.Sequential(_MyAttention()), mtq.FP8_KV_CFG)
        assert type(model[0]).__name__ == "Quant_MyAttention"
        names = [n for n, q in mtq.conversion.named_quantizers(model) if q.is_enabled]
        assert any("k_bmm_quantizer" in n for n in names) and any("v_bmm_quantizer" in n for n in names)
    finally:
        mtq.unregister(_MyAttention)
    with pytest.raises(TypeError, match="nn.Module class"):
        register_attention_for_kv_quant(len)


def test_num_bits_and_unsigned_are_writable_and_keep_the_state():
    q = TensorQuantizer(QD(num_bits=8), amax=2.0)
    q.num_bits = 4
    assert q.num_bits == 4 and q.quant_desc.num_bits == 4 and torch.equal(q.amax, torch.tensor(2.0))
    x = torch.linspace(-2, 2, 9)
    assert torch.equal(q(x), tensor_quant.fake_tensor_quant(x, torch.tensor(2.0), 4, False, False))
    q.unsigned = True
    assert q.unsigned and torch.equal(q(x.abs()), tensor_quant.fake_tensor_quant(x.abs(), torch.tensor(2.0), 4, True))
    with pytest.raises(ValueError, match="TensorQuantizer.*num_bits"):
        q.num_bits = 99
    assert q.num_bits == 4


def test_per_channel_defaults_report_an_int_axis():
    assert QuantLinear(4, 4).weight_quantizer.axis == 0
    assert nn.Conv2d(1, 2, 3) is not None and mtq.quant_nn.QuantConv2d(1, 2, 3).weight_quantizer.axis == 0
    assert mtq.quant_nn.QuantConvTranspose2d(1, 2, 3).weight_quantizer.axis == 1
    model = mtq.quantize(nn.Sequential(nn.Conv2d(1, 2, 3)), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(2, 1, 5, 5)))
    assert model[0].weight_quantizer.export_info()["axis"] == (0,)


class _Holder(nn.Module):
    fn = tensor_quant.fake_tensor_quant

    def __init__(self):
        super().__init__()
        self.quant = tensor_quant.tensor_quant


def test_functional_ops_stay_unbound_as_attributes():
    x, amax = torch.linspace(-1, 1, 7), torch.tensor(1.0)
    h = _Holder()
    assert torch.equal(h.fn(x, amax), tensor_quant.fake_tensor_quant(x, amax))
    assert torch.equal(h.quant(x, amax)[0], tensor_quant.tensor_quant(x, amax)[0])
    assert tensor_quant.fake_tensor_quant.__name__ == "fake_tensor_quant"
    for fn in (tensor_quant.scaled_e4m3, tensor_quant.fake_affine_tensor_quant, tensor_quant.fake_block_quant):
        assert type(h).__dict__.get("fn") is not None and not hasattr(fn, "__get__")


def test_fake_quant_false_on_a_quant_module_says_only_fake_quantization():
    with pytest.raises(ValueError, match="Only fake quantization is supported"):
        QuantLinear(4, 4, quant_desc_weight=QD(fake_quant=False))


class _HalfMax:
    """A user calibrator: half the running max of |x|."""

    def __init__(self, scale=0.5):
        self.scale, self.m = scale, None

    def collect(self, x):
        a = x.detach().abs().amax().float()
        self.m = a if self.m is None else torch.maximum(self.m, a)

    def compute_amax(self):
        return None if self.m is None else self.m * self.scale

    def reset(self):
        self.m = None


@pytest.mark.parametrize("spec", [_HalfMax, (_HalfMax, (), {"scale": 0.25})])
def test_a_calibrator_class_in_quant_cfg(spec):
    x = _x()
    cfg = {"quant_cfg": {"*input_quantizer": {"num_bits": 8, "calibrator": spec}}, "algorithm": "max"}
    model = mtq.quantize(_mlp(), cfg, lambda m: m(x))
    scale = 0.5 if spec is _HalfMax else 0.25
    assert isinstance(model[0].input_quantizer.calibrator, _HalfMax)
    assert torch.equal(model[0].input_quantizer.amax, x.abs().amax() * scale)
    assert model[0].input_quantizer.calibrator.scale == scale
    with pytest.raises(QuantConfigError, match="has no collect"):
        mtq.quantize(_mlp(), {"quant_cfg": {"*input_quantizer": {"calibrator": int}}, "algorithm": "max"})
    with pytest.raises(QuantConfigError, match="calibrator 'nope' is not supported"):
        mtq.quantize(_mlp(), {"quant_cfg": {"*input_quantizer": {"calibrator": "nope"}}, "algorithm": "max"})
