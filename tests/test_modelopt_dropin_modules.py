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


# --- TensorQuantizer(quant_attribute_cfg=...), QuantizerAttributeConfig with ModelOpt's extra settings ------------
def test_tensor_quantizer_takes_modelopts_quant_attribute_cfg_keyword():
    from modelopt_lite import QuantDescriptor
    from modelopt_lite.nn import TensorQuantizer

    q = TensorQuantizer(quant_attribute_cfg=QuantDescriptor(num_bits=4, axis=0), amax=torch.tensor([[1.0], [2.0]]))
    assert q.num_bits == 4 and q.axis == 0
    assert torch.equal(q.amax, torch.tensor([[1.0], [2.0]]))
    with pytest.raises(TypeError, match="not both"):
        TensorQuantizer(QuantDescriptor(num_bits=4), quant_attribute_cfg=QuantDescriptor(num_bits=8))


def test_quantizer_attribute_config_carries_the_affine_bias_to_the_quantizer():
    import modelopt_lite as mtq
    from modelopt_lite.nn import TensorQuantizer

    bias = {-1: None, -3: None, "type": "dynamic", "method": "mean"}
    cfg = mtq.QuantizerAttributeConfig(num_bits=8, bias=bias)
    assert isinstance(cfg, mtq.QuantDescriptor)
    assert cfg.extras == {"bias": {-1: None, -3: None, "type": "dynamic", "method": "mean"}}
    assert cfg != mtq.QuantDescriptor(num_bits=8) and hash(cfg) == hash(
        mtq.QuantizerAttributeConfig(num_bits=8, bias=bias)
    )
    assert mtq.QuantizerAttributeConfig(num_bits=8) == mtq.QuantDescriptor(num_bits=8)
    q = TensorQuantizer(quant_attribute_cfg=cfg)
    assert q.bias == bias and q.bias_type == "dynamic"
    assert type(q.quant_desc) is mtq.ScaledQuantDescriptor  # the settings live on the quantizer
    x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    b = x.mean(dim=(-1, -3), keepdim=True)
    ref = TensorQuantizer(mtq.QuantDescriptor(num_bits=8))
    assert torch.equal(q(x), ref(x - b) + b)
    with pytest.raises(ValueError, match="QuantizerAttributeConfig"):
        mtq.QuantizerAttributeConfig(bias={-1: None, "type": "sometimes"})
    with pytest.raises(TypeError, match="unknown keyword"):
        mtq.QuantizerAttributeConfig(num_bitz=8)


def test_quantizer_attribute_config_num_steps_and_module_descriptors():
    import pickle

    import modelopt_lite as mtq
    from modelopt_lite.nn import QuantLinear, TensorQuantizer

    cfg = mtq.QuantizerAttributeConfig(num_bits=8, num_steps=3, trt_high_precision_dtype="Half")
    q = TensorQuantizer(cfg, amax=2.0)
    assert q.num_steps == 3 and q.amax is not None
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.extras == {"num_steps": 3, "trt_high_precision_dtype": "Half"}
    with pytest.raises(ValueError, match="num_steps"):
        mtq.QuantizerAttributeConfig(num_steps=0)
    lin = QuantLinear(4, 3, quant_desc_input={"num_bits": 8, "bias": {-1: None, "type": "dynamic"}})
    assert lin.input_quantizer.bias_type == "dynamic"


# --- utils.enable_fake_quant, TensorQuantizer._fake_quant, calib.MseCalibrator ----------------------------------
def test_enable_fake_quant_switches_weight_quantizers_and_restores():
    from modelopt_lite import QuantDescriptor, utils
    from modelopt_lite.nn import TensorQuantizer

    holder = nn.Module()
    holder.weight_quantizer = TensorQuantizer(
        QuantDescriptor(num_bits=8, axis=0, fake_quant=False), amax=[[1.0], [2.0]]
    )
    holder.input_quantizer = TensorQuantizer(QuantDescriptor(num_bits=8, fake_quant=False), amax=1.0)
    w = torch.tensor([[0.3, -0.7], [1.1, 2.0]])
    assert torch.equal(holder.weight_quantizer(w), torch.tensor([[38.0, -89.0], [70.0, 127.0]]))  # codes
    with utils.enable_fake_quant(holder):
        assert holder.weight_quantizer._fake_quant is True and holder.weight_quantizer.fake_quant is True
        assert holder.input_quantizer.fake_quant is False  # weight quantizers only, as ModelOpt
        assert torch.equal(
            holder.weight_quantizer(w),
            torch.tensor([[38.0, -89.0], [70.0, 127.0]]) * torch.tensor([[1 / 127], [2 / 127]]),
        )
    assert holder.weight_quantizer.fake_quant is False
    assert torch.equal(holder.weight_quantizer.amax, torch.tensor([[1.0], [2.0]]))


def _int8_fake(x, amax):
    from modelopt_lite.tensor_quant import fake_tensor_quant

    return fake_tensor_quant(x, amax)


def test_mse_calibrator_per_tensor_picks_the_smallest_error_candidate():
    from modelopt_lite import calib

    x = torch.ones(1024)
    x[0] = 10.0
    cal = calib.MseCalibrator(
        amax=x.abs().max(), num_steps=20, start_multiplier=0.1, stop_multiplier=1.5, quant_func=_int8_fake
    )
    assert cal.compute_amax() is None
    cal.collect(x)
    best = cal.compute_amax()
    mult = torch.linspace(0.1, 1.5, 20)
    errors = torch.stack([((x - _int8_fake(x, 10.0 * m)) ** 2).sum() for m in mult])
    assert best.shape == () and best.dtype == torch.float32
    assert torch.equal(best, torch.tensor(10.0) * mult[int(torch.argmin(errors))])
    cal.reset()
    assert cal.compute_amax() is None
    assert calib.MseCalibrator(amax=1.0, start_multiplier=0.25, stop_multiplier=4.0).num_steps == 39  # step 0.1


def test_mse_calibrator_per_channel_and_bad_input():
    from modelopt_lite import calib

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4000, generator=g) * torch.tensor([[1.0], [50.0]])
    x[1, 0] = -1000.0
    init = x.abs().amax(dim=1, keepdim=True)
    mult = torch.linspace(0.25, 1.0, 16)
    cal = calib.MseCalibrator(
        amax=init, axis=0, num_steps=16, start_multiplier=0.25, stop_multiplier=1.0, quant_func=_int8_fake
    )
    cal.collect(x)
    cal.collect(x)
    best = cal.compute_amax()
    errors = torch.stack([((x - _int8_fake(x, init * m)) ** 2).sum(dim=1) for m in mult])  # (16, 2)
    assert best.shape == (2, 1)
    assert torch.equal(best, init * mult[torch.argmin(errors, dim=0)].reshape(2, 1))
    assert float(best[1, 0]) < 1000.0  # the outlier is clipped
    with pytest.raises(ValueError, match="NaN or Inf"):
        cal.collect(torch.full((2, 4000), float("nan")))
    with pytest.raises(ValueError, match="amax must be finite"):
        calib.MseCalibrator(amax=torch.tensor(float("inf")))
    with pytest.raises(ValueError, match="no quant_func"):
        calib.MseCalibrator(amax=1.0).collect(x)


# --- QuantLSTM/GRU/RNN: ModelOpt's quantizer switches and quant_rnn.VFRNNForward -------------------------------------
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_rnn_switches_of_modelopt(cls):
    from modelopt_lite.nn import QuantModuleRegistry

    rnn = QuantModuleRegistry.convert(cls(4, 4, 2, bidirectional=True))
    ins = [q for n, q in rnn.named_modules() if n.endswith("input_quantizer") and "gate_quantizers" in n]
    ws = [q for n, q in rnn.named_modules() if n.endswith("weight_quantizer")]
    assert len(ins) == len(ws) == 8
    rnn._disable_input_quantizers()
    assert not any(q.is_enabled for q in ins) and all(q.is_enabled for q in ws)
    rnn._disable_weight_quantizers()
    assert not any(q.is_enabled for q in ws)
    rnn._enable_input_quantizers()
    rnn._enable_weight_quantizer()
    assert all(q.is_enabled for q in ins + ws)


def _identity(x):
    return x


@pytest.mark.parametrize(("cls", "mode"), [(nn.LSTM, "LSTM"), (nn.GRU, "GRU"), (nn.RNN, "RNN_TANH")])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_vfrnn_forward_without_quantization_is_torchs_rnn(cls, mode, bidirectional):
    from modelopt_lite.nn.modules.quant_rnn import VFRNNForward

    torch.manual_seed(0)
    rnn = cls(4, 6, 2, bidirectional=bidirectional)
    n = 2 * (2 if bidirectional else 1)
    vf = VFRNNForward(rnn.mode, bidirectional, 2, False, True, [_identity] * n)
    x = torch.randn(5, 3, 4)
    h0 = torch.zeros(n, 3, 6)
    hidden = (h0, h0) if mode == "LSTM" else h0
    with torch.no_grad():
        out = vf(x, hidden, rnn._flat_weights, True, 2, 0.0, False, bidirectional, False)
        ref = rnn(x)
    refs = (ref[0], *ref[1]) if mode == "LSTM" else (ref[0], ref[1])
    assert len(out) == len(refs)
    for a, b in zip(out, refs):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6)
    # packed: the _VF call torch makes for a PackedSequence
    seqs = [torch.randn(5, 4), torch.randn(3, 4), torch.randn(2, 4)]
    packed = torch.nn.utils.rnn.pack_sequence(seqs)
    with torch.no_grad():
        out = vf(packed.data, packed.batch_sizes, hidden, rnn._flat_weights, True, 2, 0.0, False, bidirectional)
        ref = rnn(packed)
    assert torch.allclose(out[0], ref[0].data, atol=1e-6)
    assert torch.allclose(out[1], ref[1][0] if mode == "LSTM" else ref[1], atol=1e-6)


def test_vfrnn_forward_quantizes_every_steps_input_and_state_as_modelopt():
    from modelopt_lite.nn.modules.quant_rnn import VFRNNForward
    from modelopt_lite.tensor_quant import fake_tensor_quant

    torch.manual_seed(0)
    lstm = nn.LSTM(4, 4, 1)
    seen = []

    def q(x):
        seen.append(tuple(x.shape))
        return fake_tensor_quant(x, x.abs().amax())

    x = torch.randn(3, 2, 4)
    h0 = torch.zeros(1, 2, 4)
    with torch.no_grad():
        out = VFRNNForward("LSTM", False, 1, False, True, [q])(
            x, (h0, h0), lstm._flat_weights, True, 1, 0.0, False, False, False
        )
    assert seen == [(2, 4)] * 9  # h, c and x at each of the 3 steps
    w_ih, w_hh, b_ih, b_hh = lstm._flat_weights
    h, c = torch.zeros(2, 4), torch.zeros(2, 4)
    for t in range(3):
        qh, qc = fake_tensor_quant(h, h.abs().amax()), fake_tensor_quant(c, c.abs().amax())
        gates = F.linear(fake_tensor_quant(x[t], x[t].abs().amax()), w_ih, b_ih) + F.linear(qh, w_hh, b_hh)
        i, f, g, o = gates.detach().chunk(4, dim=-1)
        c = torch.sigmoid(f) * qc + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
    assert torch.equal(out[1][0], h) and torch.equal(out[2][0], c)
    with pytest.raises(ValueError, match="input quantizers needed"):
        VFRNNForward("LSTM", True, 1, False, True, [q])
    with pytest.raises(ValueError, match="mode must be one of"):
        VFRNNForward("lstm", False, 1, False, True, [q])


def test_vfrnn_forward_matches_modelopts():
    peer = pytest.importorskip("modelopt.torch.quantization.nn.modules.quant_rnn")
    from modelopt_lite.nn.modules.quant_rnn import VFRNNForward
    from modelopt_lite.tensor_quant import fake_tensor_quant

    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6, 2, bidirectional=True, proj_size=3)

    def q(x):
        return fake_tensor_quant(x, x.abs().amax())

    x = torch.randn(4, 2, 4)
    hidden = (torch.zeros(4, 2, 3), torch.zeros(4, 2, 6))
    args = (x, hidden, lstm._flat_weights, True, 2, 0.0, False, True, False)
    with torch.no_grad():
        ours = VFRNNForward("LSTM", True, 2, True, True, [q] * 4, [q] * 4)(*args)
        theirs = peer.VFRNNForward("LSTM", True, 2, True, True, [q] * 4, [q] * 4)(*args)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-6)


# --- ModelOpt's error texts of QuantizerAttributeConfig ------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, (0, 3), (-1, 2)])
def test_non_positive_num_bits_keeps_modelopts_wording(bad):
    import modelopt_lite as mtq

    text = "num_bits must be a positive integer or a tuple of positive integers."
    with pytest.raises(ValueError, match=text):
        mtq.QuantizerAttributeConfig(enable=True, num_bits=bad)
    with pytest.raises(ValueError, match=text):
        mtq.QuantDescriptor(num_bits=bad)
    with pytest.raises(ValueError, match="num_bits must be in 1..16, got 17"):
        mtq.QuantDescriptor(num_bits=17)


def test_quantizer_attribute_config_of_only_enable_true_is_refused_as_modelopt_does():
    import modelopt_lite as mtq

    with pytest.raises(ValueError, match=r"Cannot specify only \{'enable': True\}"):
        mtq.QuantizerAttributeConfig(enable=True)
    assert mtq.QuantizerAttributeConfig(enable=True, num_bits=8) == mtq.QuantDescriptor()
    assert mtq.QuantizerAttributeConfig() == mtq.QuantDescriptor()
    assert mtq.QuantDescriptor(enable=True) == mtq.QuantDescriptor()  # ours: the default descriptor
