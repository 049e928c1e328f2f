"""Quantized modules: output == the functional composition exactly, for every module family."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelopt_lite import quant_nn
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.tensor_quant import fake_tensor_quant


def _quantizers(m):
    return [q for q in m.modules() if isinstance(q, TensorQuantizer)]


def calibrate(m, *inputs):
    """One calibration pass over every enabled quantizer of m (weights included)."""
    for q in _quantizers(m):
        q.disable_quant()
        q.enable_calib()
    with torch.no_grad():
        m(*inputs)
    for q in _quantizers(m):
        if q.is_enabled:
            q.load_calib_amax()
        q.disable_calib()
        q.enable_quant()
    return m


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def fq_x(x, bits=8):
    return fake_tensor_quant(x, x.abs().amax(), bits, False, False)


def fq_w(w, axis, bits=8):
    red = [d for d in range(w.dim()) if d != axis]
    return fake_tensor_quant(w, w.abs().amax(red, keepdim=True), bits, False, False)


# --- linear ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7), (7,)])
def test_linear_equals_composition(bits, bias, shape):
    d_in, d_w = QD(num_bits=bits), QD(num_bits=bits, axis=0)
    m = quant_nn.QuantLinear(7, 4, bias=bias, quant_desc_input=d_in, quant_desc_weight=d_w)
    x = _x(*shape)
    calibrate(m, x)
    expect = F.linear(fq_x(x, bits), fq_w(m.weight, 0, bits), m.bias)
    assert torch.equal(m(x), expect)


def test_linear_per_tensor_weight_and_output_quantizer():
    m = quant_nn.QuantLinear(6, 3, quant_desc_weight=QD())
    x = _x(4, 6)
    m.output_quantizer.enable()
    calibrate(m, x)
    w = fake_tensor_quant(m.weight, m.weight.abs().amax(), 8, False, False)
    out = F.linear(fq_x(x), w, m.bias)
    out_amax = F.linear(x, m.weight, m.bias).abs().amax()  # calibrated on the float output (nothing quantized then)
    assert torch.equal(m.output_quantizer.amax, out_amax)
    assert torch.equal(m(x), fake_tensor_quant(out, out_amax, 8, False, False))


def test_linear_defaults_and_grad():
    m = quant_nn.QuantLinear(3, 2)
    assert m.input_quantizer.quant_desc == QD() and m.weight_quantizer.axis == 0
    assert not m.output_quantizer.is_enabled
    x = _x(4, 3).requires_grad_(True)
    calibrate(m, x)
    m(x).sum().backward()
    assert m.weight.grad is not None and x.grad is not None


# --- conv --------------------------------------------------------------------------------------------------------------
_CONV = [
    (quant_nn.QuantConv1d, F.conv1d, (2, 3, 9)),
    (quant_nn.QuantConv2d, F.conv2d, (2, 3, 7, 6)),
    (quant_nn.QuantConv3d, F.conv3d, (1, 3, 5, 4, 5)),
]


@pytest.mark.parametrize("cls, fn, shape", _CONV)
@pytest.mark.parametrize("bits, bias", [(8, True), (4, False)])
def test_conv_equals_composition(cls, fn, shape, bits, bias):
    m = cls(
        3,
        4,
        3,
        stride=1,
        padding=1,
        bias=bias,
        quant_desc_input=QD(num_bits=bits),
        quant_desc_weight=QD(num_bits=bits, axis=0),
    )
    x = _x(*shape)
    calibrate(m, x)
    expect = fn(fq_x(x, bits), fq_w(m.weight, 0, bits), m.bias, 1, 1)
    assert torch.equal(m(x), expect)


def test_conv_groups_dilation_padding_mode_unbatched():
    m = quant_nn.QuantConv2d(4, 6, 3, groups=2, dilation=2, padding=2, padding_mode="reflect")
    x = _x(4, 8, 8)  # unbatched
    calibrate(m, x)
    xp = F.pad(fq_x(x), (2, 2, 2, 2), mode="reflect")
    expect = F.conv2d(xp, fq_w(m.weight, 0), m.bias, 1, 0, 2, 2)
    assert torch.equal(m(x), expect)


# --- conv transpose ------------------------------------------------------------------------------------------------------
_CT = [
    (quant_nn.QuantConvTranspose1d, F.conv_transpose1d, (2, 4, 5), nn.ConvTranspose1d),
    (quant_nn.QuantConvTranspose2d, F.conv_transpose2d, (2, 4, 5, 4), nn.ConvTranspose2d),
    (quant_nn.QuantConvTranspose3d, F.conv_transpose3d, (1, 4, 3, 4, 3), nn.ConvTranspose3d),
]


@pytest.mark.parametrize("cls, fn, shape, float_cls", _CT)
def test_conv_transpose_equals_composition_axis1(cls, fn, shape, float_cls):
    m = cls(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    assert m.weight.shape[:2] == (4, 3)  # (in, out / groups, *k)
    assert m.weight_quantizer.axis == 1  # per output channel, as the peers' CONVTRANSPOSE constants
    x = _x(*shape)
    calibrate(m, x)
    assert m.weight_quantizer.amax.shape == (1, 3) + (1,) * (m.weight.dim() - 2)
    expect = fn(fq_x(x), fq_w(m.weight, 1), m.bias, 2, 1, 1, 2)
    assert torch.equal(m(x), expect)
    assert m.weight_quantizer.export_info()["axis"] == (1,)
    f = float_cls(4, 6, 3)
    assert quant_nn.__dict__[cls.__name__].from_float(f).weight_quantizer.axis == 1


def test_conv_transpose_output_size_and_axis0_override():
    m = quant_nn.QuantConvTranspose2d(2, 3, 3, stride=2, quant_desc_weight=QD(axis=0))  # per input channel (TRT)
    x = _x(1, 2, 4, 4)
    calibrate(m, x)
    out = m(x, output_size=[10, 10])
    assert out.shape == (1, 3, 10, 10)
    expect = F.conv_transpose2d(fq_x(x), fq_w(m.weight, 0), m.bias, 2, 0, 1)
    assert torch.equal(out, expect)
    with pytest.raises(ValueError, match="zeros"):
        quant_nn.QuantConvTranspose2d(2, 3, 3, padding_mode="reflect")(x)


# --- pooling -----------------------------------------------------------------------------------------------------------
_POOL = [
    (quant_nn.QuantMaxPool1d, (2,), F.max_pool1d, (2, 3, 8)),
    (quant_nn.QuantMaxPool2d, (2,), F.max_pool2d, (2, 3, 6, 6)),
    (quant_nn.QuantMaxPool3d, (2,), F.max_pool3d, (1, 2, 4, 4, 4)),
    (quant_nn.QuantAvgPool1d, (3,), F.avg_pool1d, (2, 3, 9)),
    (quant_nn.QuantAvgPool2d, (2,), F.avg_pool2d, (2, 3, 6, 6)),
    (quant_nn.QuantAvgPool3d, (2,), F.avg_pool3d, (1, 2, 4, 4, 4)),
    (quant_nn.QuantAdaptiveAvgPool1d, (3,), F.adaptive_avg_pool1d, (2, 3, 9)),
    (quant_nn.QuantAdaptiveAvgPool2d, ((2, 3),), F.adaptive_avg_pool2d, (2, 3, 6, 6)),
    (quant_nn.QuantAdaptiveAvgPool3d, (2,), F.adaptive_avg_pool3d, (1, 2, 4, 4, 4)),
]


@pytest.mark.parametrize("cls, args, fn, shape", _POOL)
def test_pooling_equals_composition(cls, args, fn, shape):
    m = cls(*args, quant_desc_input=QD(num_bits=4))
    assert not hasattr(m, "weight_quantizer")
    x = _x(*shape)
    calibrate(m, x)
    assert torch.equal(m(x), fn(fq_x(x, 4), *args))
    with pytest.raises(TypeError):
        cls(*args, quant_desc_weight=QD())


def test_maxpool_return_indices():
    m = quant_nn.QuantMaxPool2d(2, return_indices=True)
    x = _x(1, 1, 4, 4)
    calibrate(m, x)
    out, idx = m(x)
    ref, ref_idx = F.max_pool2d(fq_x(x), 2, return_indices=True)
    assert torch.equal(out, ref) and torch.equal(idx, ref_idx)


# --- functional wrappers -------------------------------------------------------------------------------------------------
def test_matmul_and_add():
    a, b = _x(2, 3, 4, seed=1), _x(2, 4, 5, seed=2)
    mm = quant_nn.QuantMatMul()
    calibrate(mm, a, b)
    assert torch.equal(mm(a, b), torch.matmul(fq_x(a), fq_x(b)))
    add = quant_nn.QuantAdd.from_float(quant_nn.Add(), quant_desc_input=QD(num_bits=4))
    c = _x(2, 3, 4, seed=3)
    calibrate(add, a, c)
    assert torch.equal(add(a, c), fq_x(a, 4) + fq_x(c, 4))
    names = [n for n, q in add.named_modules() if isinstance(q, TensorQuantizer)]
    assert names == ["input_quantizer", "output_quantizer", "other_input_quantizer"]
    assert torch.equal(quant_nn.MatMul()(a, b), a @ b) and torch.equal(quant_nn.Add()(a, c), a + c)
    with pytest.raises(TypeError):
        quant_nn.QuantMatMul.from_float(quant_nn.MatMul(), quant_desc_weight=QD())


# --- construction, from_float, state -------------------------------------------------------------------------------------
def test_unknown_kwargs_and_bad_desc_raise():
    with pytest.raises(TypeError, match="quant_desc_bogus"):
        quant_nn.QuantLinear(2, 2, quant_desc_bogus=QD())
    with pytest.raises(TypeError, match="foo"):
        quant_nn.QuantConv2d(2, 2, 3, foo=1)
    with pytest.raises(TypeError, match="QuantLinear quant_desc_input must be a ScaledQuantDescriptor"):
        quant_nn.QuantLinear(2, 2, quant_desc_input=8)
    m = quant_nn.QuantLinear(2, 2, quant_desc_input={"num_bits": 4})
    assert m.input_quantizer.num_bits == 4


_FLOATS = [
    (nn.Linear(4, 3), quant_nn.QuantLinear),
    (nn.Conv2d(2, 3, 3, padding_mode="circular"), quant_nn.QuantConv2d),
    (nn.Conv1d(2, 3, 3), quant_nn.QuantConv1d),
    (nn.ConvTranspose2d(2, 3, 3), quant_nn.QuantConvTranspose2d),
    (nn.AvgPool2d(2), quant_nn.QuantAvgPool2d),
    (nn.LSTM(3, 4), quant_nn.QuantLSTM),
    (nn.LSTMCell(3, 4), quant_nn.QuantLSTMCell),
]


@pytest.mark.parametrize("float_mod, cls", _FLOATS)
def test_from_float_exact_copy_no_shared_storage(float_mod, cls):
    float_mod.eval()
    q = cls.from_float(float_mod, quant_desc_input=QD(num_bits=6))
    assert type(q) is cls and not q.training
    fsd, qsd = float_mod.state_dict(), q.state_dict()
    for k, v in fsd.items():
        assert torch.equal(qsd[k], v) and qsd[k].dtype == v.dtype
        assert qsd[k].data_ptr() != v.data_ptr()
    for p in q.parameters():
        with torch.no_grad():
            p.add_(1.0)
    assert all(torch.equal(float_mod.state_dict()[k], v) for k, v in fsd.items())
    assert q.input_quantizer.num_bits == 6
    for k in vars(float_mod)["_parameters"]:
        assert getattr(q, k).requires_grad == getattr(float_mod, k).requires_grad


def test_from_float_rejects_other_types():
    class MyLinear(nn.Linear):
        pass

    with pytest.raises(TypeError, match="expects a torch.nn.modules.linear.Linear, got .*MyLinear"):
        quant_nn.QuantLinear.from_float(MyLinear(2, 2))
    with pytest.raises(TypeError):
        quant_nn.QuantConv2d.from_float(nn.Linear(2, 2))


def test_module_state_dict_round_trip_into_fresh_module():
    m = quant_nn.QuantConv2d(3, 4, 3)
    x = _x(2, 3, 6, 6)
    calibrate(m, x)
    sd = m.state_dict()
    assert sd["weight_quantizer._amax"].shape == (4, 1, 1, 1) and sd["input_quantizer._amax"].shape == ()
    assert "output_quantizer._amax" not in sd
    fresh = quant_nn.QuantConv2d(3, 4, 3)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh(x), m(x))
    bad = dict(sd, **{"weight_quantizer._amax": torch.ones(5, 1, 1, 1)})
    with pytest.raises(ValueError, match=r"'weight_quantizer'.*\(5, 1, 1, 1\).*\(4, 1, 1, 1\)"):
        fresh.load_state_dict(bad)


def test_module_to_dtype_keeps_quantizer_amax_float32():
    m = quant_nn.QuantLinear(4, 2)
    x = _x(3, 4)
    calibrate(m, x)
    a = m.weight_quantizer.amax.clone()
    m.half()
    assert m.weight.dtype == torch.float16 and torch.equal(m.weight_quantizer.amax, a)
    y = m(x.half())
    assert y.dtype == torch.float16


def test_instances_do_not_share_quantizers():
    a, b = quant_nn.QuantLinear(2, 2), quant_nn.QuantLinear(2, 2)
    assert a.input_quantizer is not b.input_quantizer
    assert isinstance(quant_nn.QuantLinear.default_quant_desc_input, QD)  # class defaults: see test_more_modules


def test_module_input_not_mutated():
    m = quant_nn.QuantConv1d(2, 2, 3)
    x = _x(1, 2, 8)
    before = x.clone()
    calibrate(m, x)
    m(x)
    assert torch.equal(x, before)


def test_exports_and_aliases():
    import modelopt_lite

    assert modelopt_lite.quant_nn is quant_nn and modelopt_lite.TensorQuantizer is TensorQuantizer
    assert quant_nn.Linear is quant_nn.QuantLinear and quant_nn.Conv2d is quant_nn.QuantConv2d
    for name in [
        "QuantLinear",
        "QuantConv1d",
        "QuantConv2d",
        "QuantConv3d",
        "QuantConvTranspose1d",
        "QuantConvTranspose2d",
        "QuantConvTranspose3d",
        "QuantMaxPool1d",
        "QuantMaxPool2d",
        "QuantMaxPool3d",
        "QuantAvgPool1d",
        "QuantAvgPool2d",
        "QuantAvgPool3d",
        "QuantAdaptiveAvgPool1d",
        "QuantAdaptiveAvgPool2d",
        "QuantAdaptiveAvgPool3d",
        "QuantLSTM",
        "QuantLSTMCell",
        "QuantMatMul",
        "QuantAdd",
        "TensorQuantizer",
    ]:
        assert name in quant_nn.__all__ and getattr(quant_nn, name).__doc__


def test_pytorch_quantization_aliases():
    m = quant_nn.QuantConv2d(2, 2, 3)
    assert m._input_quantizer is m.input_quantizer and m._weight_quantizer is m.weight_quantizer
    with pytest.raises(AttributeError):
        _ = quant_nn.QuantAvgPool2d(2)._weight_quantizer
    assert TensorQuantizer(QD(name="act")).name == "act"
