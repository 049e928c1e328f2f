"""Normalization, activation and embedding quant modules, Clip / nn.functional.clip, class-level default
descriptors (pytorch-quantization's set_default_quant_desc_*), and the fake_quant=False guard of every module."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import quant_nn
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.nn.functional import clip
from modelopt_lite.tensor_quant import fake_tensor_quant


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fq(t, amax, bits=8):
    return fake_tensor_quant(t, torch.as_tensor(amax), bits, False, False)


def _calibrate(m, *xs):
    qs = [q for q in m.modules() if isinstance(q, TensorQuantizer) and q.is_enabled]
    for q in qs:
        q.disable_quant()
        q.enable_calib()
    with torch.no_grad():
        for x in xs:
            m(x)
    for q in qs:
        q.load_calib_amax()
        q.disable_calib()
        q.enable_quant()


# --- normalization and activations -----------------------------------------------------------------------------------
_NORM = [
    (quant_nn.QuantBatchNorm1d, nn.BatchNorm1d, (4, 3, 5)),
    (quant_nn.QuantBatchNorm2d, nn.BatchNorm2d, (4, 3, 5, 5)),
    (quant_nn.QuantBatchNorm3d, nn.BatchNorm3d, (2, 3, 3, 4, 4)),
    (quant_nn.QuantInstanceNorm1d, nn.InstanceNorm1d, (4, 3, 5)),
    (quant_nn.QuantInstanceNorm2d, nn.InstanceNorm2d, (4, 3, 5, 5)),
    (quant_nn.QuantInstanceNorm3d, nn.InstanceNorm3d, (2, 3, 3, 4, 4)),
]


@pytest.mark.parametrize("cls, float_cls, shape", _NORM)
def test_norm_is_float_norm_of_quantized_input(cls, float_cls, shape):
    torch.manual_seed(0)
    f = float_cls(3, affine=True)
    with torch.no_grad():
        f.weight.uniform_(0.5, 1.5)
        f.bias.uniform_(-1, 1)
    m = mtq.QuantModuleRegistry.convert(f)
    assert type(m) is cls and not hasattr(m, "weight_quantizer") and not m.output_quantizer.is_enabled
    x = _x(*shape) * 3
    m.eval()
    f.eval()
    _calibrate(m, x)
    assert torch.equal(m.input_quantizer.amax, x.abs().amax())
    assert torch.equal(m(x), f(_fq(x, x.abs().amax())))
    m.train()
    f.train()
    assert torch.equal(m(x), f(_fq(x, x.abs().amax())))  # training: batch statistics of the quantized input
    if f.track_running_stats:
        assert torch.equal(m.running_mean, f.running_mean)


def test_leaky_relu_quantizes_input_and_leaves_caller_tensor():
    m = quant_nn.QuantLeakyReLU(0.1, inplace=True)
    assert mtq.QuantModuleRegistry[nn.LeakyReLU] is quant_nn.QuantLeakyReLU
    x = _x(3, 7) * 2
    before = x.clone()
    m.input_quantizer.amax = 2.0
    assert torch.equal(m(x), F.leaky_relu(_fq(before, 2.0), 0.1))
    assert torch.equal(x, before)
    m.output_quantizer.enable()
    m.output_quantizer.amax = 0.5
    assert torch.equal(m(x), _fq(F.leaky_relu(_fq(before, 2.0), 0.1), 0.5))


def test_presets_disable_batchnorm_and_leaky_relu_quantizers():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.LeakyReLU())
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG)
    assert type(model[1]) is quant_nn.QuantBatchNorm2d and type(model[2]) is quant_nn.QuantLeakyReLU
    assert not model[1].input_quantizer.is_enabled and not model[2].input_quantizer.is_enabled
    assert model[0].input_quantizer.is_enabled


# --- embedding -------------------------------------------------------------------------------------------------------
def test_embedding_rows_of_the_fake_quantized_table():
    torch.manual_seed(0)
    f = nn.Embedding(10, 6, padding_idx=0)
    m = mtq.QuantModuleRegistry.convert(f)
    assert type(m) is quant_nn.QuantEmbedding and not hasattr(m, "input_quantizer")
    assert m.weight_quantizer.axis == 0
    idx = torch.tensor([[1, 4, 0], [9, 9, 2]])
    _calibrate(m, idx)
    amax = f.weight.detach().abs().amax(1, keepdim=True)
    assert torch.equal(m.weight_quantizer.amax, amax)
    ref_table = _fq(f.weight.detach(), amax)
    out = m(idx)
    assert out.shape == (2, 3, 6) and torch.equal(out, F.embedding(idx, ref_table))
    out.sum().backward()  # straight-through: gradients reach the float table; padding_idx row gets none
    assert m.weight.grad is not None and torch.equal(m.weight.grad[0], torch.zeros(6))
    assert torch.equal(m.weight.grad[9], torch.full((6,), 2.0))


def test_embedding_options_and_errors():
    m = quant_nn.QuantEmbedding(5, 3, max_norm=1.0, quant_desc_weight=QD(num_bits=4, axis=None, amax=2.0))
    with torch.no_grad():
        m.weight.mul_(10)
    idx = torch.tensor([1, 3])
    out = m(idx)
    assert torch.all(m.weight[idx].norm(dim=1) <= 1.0 + 1e-6)  # renormalized in place, as nn.Embedding does
    assert torch.equal(out, _fq(m.weight.detach(), 2.0, 4)[idx])
    with pytest.raises(TypeError, match="QuantEmbedding has no input quantizer"):
        quant_nn.QuantEmbedding.set_default_quant_desc_input(QD())
    with pytest.raises(TypeError, match="quant_desc_input"):
        quant_nn.QuantEmbedding(5, 3, quant_desc_input=QD())


# --- Clip and nn.functional.clip -------------------------------------------------------------------------------------
def test_functional_clip_values_and_gradients():
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.0, 5.0], requires_grad=True)
    lo = torch.tensor(-1.0, requires_grad=True)
    hi = torch.tensor(2.0, requires_grad=True)
    y = clip(x, lo, hi)
    assert torch.equal(y, torch.tensor([-1.0, -1.0, 0.0, 1.0, 2.0, 2.0]))
    g = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    y.backward(g)
    assert torch.equal(x.grad, torch.tensor([0.0, 0.0, 3.0, 4.0, 0.0, 0.0]))  # strictly inside (min, max)
    assert lo.grad.item() == 3.0 and hi.grad.item() == 11.0  # sum of g where x <= min / x >= max
    assert torch.equal(clip(torch.tensor([-5.0, 5.0]), -1, 1), torch.tensor([-1.0, 1.0]))
    per_ch = clip(torch.full((2, 3), 4.0), torch.zeros(2, 1), torch.tensor([[1.0], [3.0]]))
    assert torch.equal(per_ch, torch.tensor([[1.0] * 3, [3.0] * 3]))
    with pytest.raises(ValueError, match="clip_value_min must be <= clip_value_max"):
        clip(x, 2.0, 1.0)
    with pytest.raises(ValueError, match="clip_value_max is NaN"):
        clip(x, 0.0, float("nan"))
    bad = torch.ones(2, requires_grad=True)
    with pytest.raises(ValueError, match="learnable clip_value_max must be a scalar"):
        clip(torch.ones(2), torch.zeros(()), bad).sum().backward()


def test_clip_module_learns_its_bounds():
    assert quant_nn.functional.clip is clip
    c = quant_nn.Clip(-1.0, 1.0, learn_max=True)
    assert isinstance(c.clip_value_max, nn.Parameter) and not isinstance(c.clip_value_min, nn.Parameter)
    assert "clip_value_min" in dict(c.named_buffers())
    x = torch.tensor([-2.0, 0.5, 3.0, 4.0])
    assert torch.equal(c(x), torch.tensor([-1.0, 0.5, 1.0, 1.0]))
    c(x).sum().backward()
    assert c.clip_value_max.grad.item() == 2.0
    with pytest.raises(ValueError, match="learnable clip_value_min must be a scalar"):
        quant_nn.Clip([0.0, 1.0], 2.0, learn_min=True)
    assert "learn_max=True" in repr(c)


# --- class-level default descriptors -----------------------------------------------------------------------------------
@pytest.fixture
def restore_defaults(monkeypatch):
    for cls in (quant_nn.QuantConv2d, quant_nn.QuantLinear, quant_nn.QuantMaxPool2d):
        for attr in ("default_quant_desc_input", "default_quant_desc_weight"):
            monkeypatch.setattr(cls, attr, getattr(cls, attr))


def test_set_default_quant_desc_applies_to_later_instances_of_that_class(restore_defaults):
    before = quant_nn.QuantConv2d(2, 2, 3)
    quant_nn.QuantConv2d.set_default_quant_desc_input(QD(num_bits=6, unsigned=True))
    quant_nn.QuantConv2d.set_default_quant_desc_weight({"num_bits": 4, "axis": (0,)})
    after = quant_nn.QuantConv2d(2, 2, 3)
    assert (after.input_quantizer.num_bits, after.input_quantizer.unsigned) == (6, True)
    assert after.weight_quantizer.num_bits == 4
    assert before.input_quantizer.num_bits == 8  # existing instances keep theirs
    assert quant_nn.QuantConv1d(2, 2, 3).input_quantizer.num_bits == 8  # other classes are unaffected
    assert quant_nn.QuantLinear(2, 2).weight_quantizer.num_bits == 8
    converted = quant_nn.QuantConv2d.from_float(nn.Conv2d(2, 2, 3))
    assert converted.weight_quantizer.num_bits == 4
    assert quant_nn.QuantConv2d(2, 2, 3, quant_desc_input=QD(num_bits=5)).input_quantizer.num_bits == 5
    quant_nn.QuantMaxPool2d.set_default_quant_desc_input(QD(num_bits=7))
    assert quant_nn.QuantMaxPool2d(2).input_quantizer.num_bits == 7
    with pytest.raises(TypeError, match="QuantMaxPool2d has no weight quantizer"):
        quant_nn.QuantMaxPool2d.set_default_quant_desc_weight(QD())
    with pytest.raises(TypeError, match="must be a ScaledQuantDescriptor or a dict"):
        quant_nn.QuantLinear.set_default_quant_desc_input(8)
    with pytest.raises(ValueError, match="QuantLinear: the default input descriptor has fake_quant=False"):
        quant_nn.QuantLinear.set_default_quant_desc_input(QD(fake_quant=False))


# --- fake_quant=False is rejected --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build",
    [
        lambda d: quant_nn.QuantLinear(3, 2, quant_desc_input=d),
        lambda d: quant_nn.QuantLinear(3, 2, quant_desc_weight=d),
        lambda d: quant_nn.QuantConv2d(1, 1, 1, quant_desc_weight=d),
        lambda d: quant_nn.QuantConvTranspose2d(1, 1, 1, quant_desc_input=d),
        lambda d: quant_nn.QuantMaxPool2d(2, quant_desc_input=d),
        lambda d: quant_nn.QuantBatchNorm2d(2, quant_desc_input=d),
        lambda d: quant_nn.QuantLSTM(2, 2, quant_desc_weight=d),
        lambda d: quant_nn.QuantGRUCell(2, 2, quant_desc_input=d),
        lambda d: quant_nn.QuantEmbedding(4, 2, quant_desc_weight=d),
        lambda d: quant_nn.QuantMatMul(quant_desc_input=d),
    ],
)
def test_real_quant_descriptor_rejected_at_construction(build):
    with pytest.raises(ValueError, match=r"Quant\w+: quant_desc_(input|weight) has fake_quant=False"):
        build(QD(fake_quant=False, amax=1.0))


def test_real_quant_quantizer_rejected_at_forward():
    m = quant_nn.QuantLinear(3, 2)
    m.input_quantizer.amax = 1.0
    m.weight_quantizer.amax = 1.0
    m.weight_quantizer.set_from_attribute_config({"fake_quant": False})
    with pytest.raises(ValueError, match="QuantLinear: quantizer 'weight_quantizer' .* has fake_quant=False"):
        m(torch.ones(1, 3))
    m.weight_quantizer.disable()  # a disabled quantizer does not compute anything: allowed
    assert m(torch.ones(1, 3)).shape == (1, 2)
    lstm = quant_nn.QuantLSTM(2, 2, fused_gemm=False)
    lstm.gate_quantizers["l0"].hh.input_quantizer.set_from_attribute_config({"fake_quant": False})
    with pytest.raises(ValueError, match="QuantLSTM: quantizer 'gate_quantizers.l0.hh.input_quantizer'"):
        lstm(torch.ones(3, 1, 2))
    fused = quant_nn.QuantLSTM(2, 2)  # pytorch-quantization's layout
    fused._input_quantizers[0].set_from_attribute_config({"fake_quant": False})
    with pytest.raises(ValueError, match="QuantLSTM: quantizer '_input_quantizers.0'"):
        fused(torch.ones(3, 1, 2))
    pool = quant_nn.QuantAvgPool1d(2)
    pool.input_quantizer.set_from_attribute_config({"fake_quant": False, "amax": 1.0})
    with pytest.raises(ValueError, match="QuantAvgPool1d: quantizer 'input_quantizer'"):
        pool(torch.ones(1, 1, 4))
