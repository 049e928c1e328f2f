"""QuantLSTM / QuantLSTMCell: every gate matmul quantizes its activation and weight (vs a functional reference)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

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
    m = quant_nn.QuantLSTM(3, 5, num_layers=layers, bidirectional=bidir, bias=bias, fused_gemm=False)
    _fix_amax(m, bits)
    x = _x(6, 2, 3) * 2
    out, (h, c) = m(x)
    r_out, r_h, r_c = _ref_lstm(m, x, bits)
    assert torch.equal(out, r_out) and torch.equal(h, r_h) and torch.equal(c, r_c)
    assert out.shape == (6, 2, 5 * (2 if bidir else 1)) and h.shape == (layers * (2 if bidir else 1), 2, 5)


def test_quant_lstm_batch_first_and_unbatched_and_hx():
    m = quant_nn.QuantLSTM(3, 4, batch_first=True, fused_gemm=False)
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
    m = quant_nn.QuantLSTM(3, 4, num_layers=2, fused_gemm=False)
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
    cell = quant_nn.QuantLSTMCell(3, 4, fused_gemm=False)
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
    with pytest.raises(ValueError, match="QuantLSTM: expected a 2-D"):
        quant_nn.QuantLSTM(3, 4)(_x(5))
    with pytest.raises(ValueError, match="QuantGRU: expected a 2-D"):
        quant_nn.QuantGRU(3, 4)(_x(1, 1, 2, 3))
    with pytest.raises(ValueError, match="1-D"):
        quant_nn.QuantLSTMCell(3, 4)(_x(1, 2, 3))
    with pytest.raises(TypeError, match="bogus"):
        quant_nn.QuantLSTM(3, 4, bogus=QD())


# --- GRU / RNN / proj_size / PackedSequence ------------------------------------------------------------------------
def _disable_all(m):
    for q in m.modules():
        if isinstance(q, TensorQuantizer):
            q.disable()


@pytest.mark.parametrize(
    "float_cls, kwargs",
    [
        (nn.GRU, {"num_layers": 2, "bidirectional": True}),
        (nn.RNN, {"num_layers": 2, "nonlinearity": "relu"}),
        (nn.RNN, {"bidirectional": True, "bias": False}),
        (nn.LSTM, {"num_layers": 2, "proj_size": 2, "bidirectional": True}),
    ],
)
def test_disabled_quant_rnn_matches_torch(float_cls, kwargs):
    torch.manual_seed(0)
    ref = float_cls(3, 4, batch_first=True, **kwargs)
    m = quant_nn.QuantModuleRegistry.convert(ref)
    assert type(m).__name__ == "Quant" + float_cls.__name__
    _disable_all(m)
    x = _x(2, 6, 3)
    out, hid = m(x)
    r_out, r_hid = ref(x)
    assert out.shape == r_out.shape and torch.allclose(out, r_out, atol=1e-5, rtol=0)
    for a, b in zip(hid if isinstance(hid, tuple) else (hid,), r_hid if isinstance(r_hid, tuple) else (r_hid,)):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0)


def test_quant_gru_equals_functional_reference():
    m = quant_nn.QuantGRU(3, 4, fused_gemm=False)
    for gq, amax in ((m.gate_quantizers["l0"].ih, X_AMAX), (m.gate_quantizers["l0"].hh, H_AMAX)):
        gq.input_quantizer.set_from_attribute_config({"num_bits": 4, "amax": amax})
        gq.weight_quantizer.set_from_attribute_config({"num_bits": 4})
    m.gate_quantizers["l0"].ih.weight_quantizer.amax = m.weight_ih_l0.detach().abs().amax(1, keepdim=True)
    m.gate_quantizers["l0"].hh.weight_quantizer.amax = m.weight_hh_l0.detach().abs().amax(1, keepdim=True)
    x = _x(5, 2, 3) * 2
    out, h_n = m(x)
    gx = F.linear(_fq(x, X_AMAX, 4), _fw(m.weight_ih_l0, 4), m.bias_ih_l0)
    h = x.new_zeros(2, 4)
    outs = []
    for t in range(5):
        gh = F.linear(_fq(h, H_AMAX, 4), _fw(m.weight_hh_l0, 4), m.bias_hh_l0)
        xr, xz, xn = gx[t].chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        h = (1 - z) * n + z * h
        outs.append(h)
    assert torch.equal(out, torch.stack(outs)) and torch.equal(h_n, h.unsqueeze(0))


def test_quant_lstm_proj_size_quantizes_the_projection():
    m = quant_nn.QuantLSTM(3, 5, proj_size=2, fused_gemm=False)
    names = {n for n, q in m.named_modules() if isinstance(q, TensorQuantizer)}
    assert {"gate_quantizers.l0.hr.input_quantizer", "gate_quantizers.l0.hr.weight_quantizer"} <= names
    x = _x(4, 2, 3)
    for q in m.modules():
        if isinstance(q, TensorQuantizer):
            q.disable_quant()
            q.enable_calib()
    m(x)
    for q in m.modules():
        if isinstance(q, TensorQuantizer) and q.is_enabled:
            q.load_calib_amax()
            q.disable_calib()
            q.enable_quant()
    out, (h, c) = m(x)
    assert out.shape == (4, 2, 2) and h.shape == (1, 2, 2) and c.shape == (1, 2, 5)
    hr = m.gate_quantizers["l0"].hr
    assert hr.weight_quantizer.amax.shape == (2, 1)
    assert torch.equal(hr.weight_quantizer.amax, m.weight_hr_l0.detach().abs().amax(1, keepdim=True))
    hr.input_quantizer.disable()
    hr.weight_quantizer.disable()
    out_f, _ = m(x)
    assert not torch.equal(out_f, out)  # the projection quantizers did change the result


@pytest.mark.parametrize("float_cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_packed_sequence_matches_torch_and_each_sequence_alone(float_cls):
    torch.manual_seed(0)
    ref = float_cls(3, 4, num_layers=2, bidirectional=True)
    m = quant_nn.QuantModuleRegistry.convert(ref)
    lengths = [3, 6, 1]
    x = _x(6, 3, 3)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    _disable_all(m)  # float: the same function as torch's packed RNN (to float rounding)
    out_p, hid_p = m(packed)
    r_out, r_hid = ref(packed)
    assert torch.equal(out_p.batch_sizes, r_out.batch_sizes) and torch.equal(out_p.sorted_indices, r_out.sorted_indices)
    assert torch.allclose(out_p.data, r_out.data, atol=1e-5, rtol=0)
    for a, b in zip(hid_p if isinstance(hid_p, tuple) else (hid_p,), r_hid if isinstance(r_hid, tuple) else (r_hid,)):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    # quantized: each sequence as if it ran alone (float matmuls of another batch size may round differently, and
    # a rounding difference can move a value by one quantization step: compare within two steps of 2/127)
    for q in m.modules():
        if isinstance(q, TensorQuantizer):
            q.enable()
            q.set_from_attribute_config({"amax": 2.0, "axis": None})
    m.output_quantizer.disable()
    out_p, hid_p = m(packed)
    out_pad, out_len = pad_packed_sequence(out_p)
    assert out_len.tolist() == lengths and out_pad.shape == (6, 3, 8)
    h_p = hid_p[0] if isinstance(hid_p, tuple) else hid_p
    for b, n in enumerate(lengths):
        out_b, hid_b = m(x[:n, b : b + 1])
        h_b = hid_b[0] if isinstance(hid_b, tuple) else hid_b
        assert torch.allclose(out_pad[:n, b : b + 1], out_b, atol=4 / 127, rtol=0), b
        assert torch.equal(out_pad[n:, b], torch.zeros_like(out_pad[n:, b]))
        assert torch.allclose(h_p[:, b : b + 1], h_b, atol=4 / 127, rtol=0), b


def test_packed_sequence_padding_never_reaches_calibrators():
    m = quant_nn.QuantGRU(2, 3)
    x = torch.zeros(4, 2, 2)
    x[:, 0] = 1.0
    x[:2, 1] = 0.5
    x[2:, 1] = 100.0  # in the padding of sequence 1 (length 2)
    for q in m.modules():
        if isinstance(q, TensorQuantizer):
            q.disable_quant()
            q.enable_calib()
    m(pack_padded_sequence(x, [4, 2]))
    q = m.input_quantizer
    q.load_calib_amax()
    assert q.amax.item() == 1.0


@pytest.mark.parametrize("cls, float_cls", [(quant_nn.QuantGRUCell, nn.GRUCell), (quant_nn.QuantRNNCell, nn.RNNCell)])
def test_gru_and_rnn_cells(cls, float_cls):
    torch.manual_seed(0)
    ref = float_cls(3, 4)
    cell = cls.from_float(ref)
    x, h = _x(2, 3), _x(2, 4, seed=1)
    _disable_all(cell)
    assert torch.allclose(cell(x, h), ref(x, h), atol=1e-6, rtol=0)
    assert cell(x[0]).shape == (4,)
    for q in cell.modules():
        if isinstance(q, TensorQuantizer):
            q.enable()
            q.set_from_attribute_config({"amax": 1.0, "axis": None, "num_bits": 4})
    gx = F.linear(_fq(x, 1.0, 4), _fq(cell.weight_ih, 1.0, 4), cell.bias_ih)
    gh = F.linear(_fq(h, 1.0, 4), _fq(cell.weight_hh, 1.0, 4), cell.bias_hh)
    if float_cls is nn.RNNCell:
        expect = torch.tanh(gx + gh)
    else:
        xr, xz, xn = gx.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        expect = (1 - z) * torch.tanh(xn + r * hn) + z * h
    cell.output_quantizer.disable()
    assert torch.equal(cell(x, h), expect)
