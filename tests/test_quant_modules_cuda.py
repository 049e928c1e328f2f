"""Quantizers and modules on a CUDA device (skipped without one): device moves, state loading, exactness."""

import pytest
import torch
import torch.nn.functional as F

from modelopt_lite import quant_nn
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.tensor_quant import fake_block_quant, fake_tensor_quant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _calibrate(m, *inputs):
    qs = [q for q in m.modules() if isinstance(q, TensorQuantizer)]
    for q in qs:
        q.disable_quant()
        q.enable_calib()
    with torch.no_grad():
        m(*inputs)
    for q in qs:
        if q.is_enabled:
            q.load_calib_amax()
        q.disable_calib()
        q.enable_quant()
    return m


def test_quantizer_moves_and_loads_on_cuda():
    q = TensorQuantizer(QD(axis=0, amax=[[1.0], [2.0]]))
    q.cuda()
    assert q.amax.is_cuda and q.amax.dtype == torch.float32
    fresh = TensorQuantizer(QD(axis=0)).cuda()  # no amax yet: only its device is known
    fresh.load_state_dict({"_amax": torch.tensor([[3.0], [4.0]])})  # a CPU checkpoint
    assert fresh.amax.is_cuda and fresh.amax.flatten().tolist() == [3.0, 4.0]
    cpu = TensorQuantizer(QD(axis=0))
    cpu.load_state_dict(q.state_dict())  # a CUDA checkpoint into a CPU quantizer (no hard-wired .cuda())
    assert cpu.amax.device.type == "cpu"
    x = torch.randn(2, 5, device="cuda")
    assert torch.equal(q(x), fake_tensor_quant(x, q.amax, 8, False, False))


def test_module_on_cuda_equals_composition_and_cpu():
    m = quant_nn.QuantConv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    _calibrate(m, x)
    y_cpu = m(x)
    m.cuda()
    xc = x.cuda()
    w = m.weight
    expect = F.conv2d(
        fake_tensor_quant(xc, m.input_quantizer.amax, 8, False, False),
        fake_tensor_quant(w, m.weight_quantizer.amax, 8, False, False),
        m.bias,
        1,
        1,
    )
    y = m(xc)
    assert torch.equal(y, expect)
    assert torch.allclose(y.cpu(), y_cpu, atol=1e-5)
    q = quant_nn.QuantLinear(6, 3, device="cuda")
    assert q.input_quantizer._device.type == "cuda"
    q.load_state_dict(
        quant_nn.QuantLinear(6, 3).state_dict()
        | {"input_quantizer._amax": torch.tensor(2.0), "weight_quantizer._amax": torch.ones(3, 1)}
    )
    assert q.input_quantizer.amax.is_cuda and q.weight_quantizer.amax.is_cuda


def test_dynamic_blocks_learn_amax_and_lstm_on_cuda():
    x = torch.randn(4, 32, device="cuda")
    bs = {-1: 16, "type": "dynamic"}
    q = TensorQuantizer(QD(num_bits=4, block_sizes=bs))
    assert torch.equal(q(x), fake_block_quant(x, bs, None, 4, False, False))
    lq = TensorQuantizer(QD(amax=1.0, learn_amax=True)).cuda()
    lq(x).sum().backward()
    assert lq._amax.grad is not None and lq._amax.grad.is_cuda
    lstm = quant_nn.QuantLSTM(3, 4, num_layers=2, bidirectional=True).cuda()
    xs = torch.randn(5, 2, 3, device="cuda")
    _calibrate(lstm, xs)
    out, (h, c) = lstm(xs)
    assert out.is_cuda and out.shape == (5, 2, 8) and torch.isfinite(out).all()
    assert h.shape == c.shape == (4, 2, 4) and h.is_cuda
