"""QuantLSTM / QuantLSTMCell: every gate matmul quantizes its activation and weight (vs a functional reference)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from modelopt_lite import quant_nn
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.tensor_quant import fake_tensor_quant

X_AMAX, H_AMAX = 3.0, 0.9


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fix_amax(m, bits=8):
    """Fixed amax on every quantizer: activations X_AMAX (ih) / H_AMAX (hh), weights per row from the weight."""
    cells = m.gate_quantizers.items() if isinstance(m, quant_nn.QuantLSTM) else [("", m.cell_quantizers)]
    for key, cq in cells:
        sfx = key[1:] if key else ""
        w_ih = getattr(m, f"weight_ih_l{sfx}" if key else "weight_ih")
        w_hh = getattr(m, f"weight_hh_l{sfx}" if key else "weight_hh")
        for gq, amax, w in ((cq.ih, X_AMAX, w_ih), (cq.hh, H_AMAX, w_hh)):
            gq.input_quantizer.set_from_attribute_config({"num_bits": bits, "amax": amax})
            gq.weight_quantizer.set_from_attribute_config({"num_bits": bits})
            gq.weight_quantizer.amax = w.detach().abs().amax(1, keepdim=True)


def _fq(t, amax, bits):
    return fake_tensor_quant(t, amax, bits, False, False)


def _fw(w, bits):
    return _fq(w, w.abs().amax(1, keepdim=True), bits)


def _ref_direction(x, h, c, w_ih, w_hh, b_ih, b_hh, bits, reverse):
    gx = F.linear(_fq(x, X_AMAX, bits), _fw(w_ih, bits), b_ih)
    w_hh_q = _fw(w_hh, bits)
    outs = [None] * x.size(0)
    for t in reversed(range(x.size(0))) if reverse else range(x.size(0)):
        gates = gx[t] + F.linear(_fq(h, H_AMAX, bits), w_hh_q, b_hh)
        i, f, g, o = gates.chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs[t] = h
    return torch.stack(outs), h, c


def _ref_lstm(m, x, bits):
    """Functional quantized LSTM (sequence-first input, zero initial state)."""
    dirs = 2 if m.bidirectional else 1
    n = x.size(1)
    hs, cs, layer_in = [], [], x
    for k in range(m.num_layers):
        outs = []
        for d in range(dirs):
            s = f"{k}" + ("_reverse" if d else "")
            z = x.new_zeros(n, m.hidden_size)
            b_ih = getattr(m, f"bias_ih_l{s}") if m.bias else None
            b_hh = getattr(m, f"bias_hh_l{s}") if m.bias else None
            o, h, c = _ref_direction(
                layer_in, z, z, getattr(m, f"weight_ih_l{s}"), getattr(m, f"weight_hh_l{s}"), b_ih, b_hh, bits, bool(d)
            )
            outs.append(o)
            hs.append(h)
            cs.append(c)
        layer_in = torch.cat(outs, -1)
    return layer_in, torch.stack(hs), torch.stack(cs)


@pytest.mark.parametrize("layers, bidir, bias, bits", [(1, False, True, 8), (2, True, True, 4), (2, False, False, 8)])
def test_quant_lstm_equals_functional_reference(layers, bidir, bias, bits):
    m = quant_nn.QuantLSTM(3, 5, num_layers=layers, bidirectional=bidir, bias=bias)
    _fix_amax(m, bits)
    x = _x(6, 2, 3) * 2
    out, (h, c) = m(x)
    r_out, r_h, r_c = _ref_lstm(m, x, bits)
    assert torch.equal(out, r_out) and torch.equal(h, r_h) and torch.equal(c, r_c)
    assert out.shape == (6, 2, 5 * (2 if bidir else 1)) and h.shape == (layers * (2 if bidir else 1), 2, 5)


def test_quant_lstm_batch_first_and_unbatched_and_hx():
    m = quant_nn.QuantLSTM(3, 4, batch_first=True)
    _fix_amax(m)
    x = _x(2, 5, 3)
    out, _ = m(x)
    ref, _, _ = _ref_lstm(m, x.transpose(0, 1), 8)
    assert torch.equal(out, ref.transpose(0, 1))
    out_u, (h_u, _) = m(x[0])
    assert out_u.shape == (5, 4) and h_u.shape == (1, 4)
    assert torch.allclose(out_u, out[0], atol=1e-6)
    h0, c0 = _x(1, 2, 4, seed=1) * 0.1, _x(1, 2, 4, seed=2)
    out_h, _ = m(x, (h0, c0))
    assert not torch.allclose(out_h, out)


def test_quant_lstm_disabled_matches_torch_lstm():
    torch.manual_seed(0)
    ref = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True)
    m = quant_nn.QuantLSTM.from_float(ref)
    for q in m.modules():
        if isinstance(q, TensorQuantizer):
            q.disable()
    x = _x(2, 7, 3)
    h0, c0 = _x(4, 2, 4, seed=3), _x(4, 2, 4, seed=4)
    (o1, (h1, c1)), (o2, (h2, c2)) = m(x, (h0, c0)), ref(x, (h0, c0))
    for a, b in ((o1, o2), (h1, h2), (c1, c2)):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_quant_lstm_calibration_and_names():
    m = quant_nn.QuantLSTM(3, 4, num_layers=2)
    names = [n for n, q in m.named_modules() if isinstance(q, TensorQuantizer)]
    assert "gate_quantizers.l1.hh.input_quantizer" in names and "gate_quantizers.l0.ih.weight_quantizer" in names
    assert len(names) == 9 and m.input_quantizer is m.gate_quantizers["l0"].ih.input_quantizer
    for q in m.modules():
        if isinstance(q, TensorQuantizer):
            q.disable_quant()
            q.enable_calib()
    x = _x(5, 2, 3)
    m(x)
    for q in m.modules():
        if isinstance(q, TensorQuantizer) and q.is_enabled:
            q.load_calib_amax()
            q.disable_calib()
            q.enable_quant()
    assert m.gate_quantizers["l0"].hh.input_quantizer.amax.item() < 1.0  # |h| < 1
    assert torch.equal(m.input_quantizer.amax, x.abs().amax())
    assert m.gate_quantizers["l1"].ih.weight_quantizer.amax.shape == (16, 1)
    m(x)


def test_quant_lstm_cell_equals_functional_reference():
    cell = quant_nn.QuantLSTMCell(3, 4)
    _fix_amax(cell, 4)
    x, h, c = _x(2, 3) * 2, _x(2, 4, seed=1) * 0.5, _x(2, 4, seed=2)
    h1, c1 = cell(x, (h, c))
    gates = F.linear(_fq(x, X_AMAX, 4), _fw(cell.weight_ih, 4), cell.bias_ih) + F.linear(
        _fq(h, H_AMAX, 4), _fw(cell.weight_hh, 4), cell.bias_hh
    )
    i, f, g, o = gates.chunk(4, -1)
    rc = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    assert torch.equal(c1, rc) and torch.equal(h1, torch.sigmoid(o) * torch.tanh(rc))
    hu, _ = cell(x[0], (h[0], c[0]))
    assert hu.shape == (4,) and torch.allclose(hu, h1[0], atol=1e-6)
    for q in cell.modules():
        if isinstance(q, TensorQuantizer):
            q.disable()
    ref = nn.LSTMCell(3, 4)
    ref.load_state_dict({k: v for k, v in cell.state_dict().items() if "quantizer" not in k})
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(cell(x), ref(x)))


def test_unsupported_inputs_raise():
    m = quant_nn.QuantLSTM(3, 4)
    packed = pack_padded_sequence(_x(5, 2, 3), [5, 3])
    with pytest.raises(TypeError, match="PackedSequence"):
        m(packed)
    with pytest.raises(ValueError, match="proj_size"):
        quant_nn.QuantLSTM(3, 4, proj_size=2)
    with pytest.raises(ValueError, match="1-D"):
        quant_nn.QuantLSTMCell(3, 4)(_x(1, 2, 3))
    with pytest.raises(TypeError, match="bogus"):
        quant_nn.QuantLSTM(3, 4, bogus=QD())
