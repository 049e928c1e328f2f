"""pytorch-quantization's RNN quantizer layout (``fused_gemm=True``, the constructors' default): one quantizer for
``[x | h]`` and one for ``[W_ih | W_hh]`` per cell, under the peer's names, so its scripts and state dicts work."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelopt_lite import quant_nn
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.tensor_quant import fake_tensor_quant


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fused_step(x, h, c, w_ih, w_hh, b_ih, b_hh, bits):
    """One LSTM step as pytorch-quantization computes it: [x | h] and [W_ih | W_hh] each quantized with one range
    (dynamic per-tensor amax for both here)."""
    xh = torch.cat([x, h], 1)
    xq, hq = fake_tensor_quant(xh, xh.abs().amax(), bits).split([x.size(1), h.size(1)], 1)
    w = torch.cat([w_ih, w_hh], 1)
    wi, wh = fake_tensor_quant(w, w.abs().amax(), bits).split([w_ih.size(1), w_hh.size(1)], 1)
    i, f, g, o = (F.linear(xq, wi, b_ih) + F.linear(hq, wh, b_hh)).chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def test_cell_quantizes_x_and_h_with_one_range_and_the_weights_with_one_range():
    torch.manual_seed(0)
    d = QD(num_bits=4)
    cell = quant_nn.QuantLSTMCell(6, 3, quant_desc_input=d, quant_desc_weight=d)
    assert cell.fused_gemm is True and not hasattr(cell, "cell_quantizers")
    names = [n for n, m in cell.named_modules() if isinstance(m, TensorQuantizer)]
    assert names == ["_input_quantizer", "_weight_quantizer", "output_quantizer"]
    assert cell._input_quantizer is cell.input_quantizer and cell._weight_quantizer is cell.weight_quantizer
    x, h, c = _x(5, 6) * 3, _x(5, 3, seed=1) * 0.2, _x(5, 3, seed=2)
    got_h, got_c = cell(x, (h, c))
    want_h, want_c = _fused_step(x, h, c, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh, 4)
    assert torch.equal(got_h, want_h) and torch.equal(got_c, want_c)
    # the per-matmul layout gives h its own range: a different result on the same weights
    split = quant_nn.QuantLSTMCell(6, 3, quant_desc_input=d, quant_desc_weight=d, fused_gemm=False)
    split.load_state_dict(cell.state_dict(), strict=False)
    assert not torch.equal(split(x, (h, c))[0], got_h)


@pytest.mark.parametrize("layers, bidir", [(1, False), (2, True)])
def test_quant_lstm_fused_equals_the_peer_math_step_by_step(layers, bidir):
    torch.manual_seed(0)
    d = QD(num_bits=5)
    m = quant_nn.QuantLSTM(4, 3, num_layers=layers, bidirectional=bidir, quant_desc_input=d, quant_desc_weight=d)
    dirs = 2 if bidir else 1
    assert len(m._input_quantizers) == len(m._weight_quantizers) == layers * dirs
    assert isinstance(m._input_quantizers, nn.ModuleList) and isinstance(m._input_quantizers[0], TensorQuantizer)
    x = _x(5, 2, 4) * 2
    out, (h_n, c_n) = m(x)
    layer_in, hs, cs = x, [], []
    for k in range(layers):
        outs = []
        for dd in range(dirs):
            s = f"{k}" + ("_reverse" if dd else "")
            h = c = x.new_zeros(2, 3)
            ys = [None] * 5
            for t in reversed(range(5)) if dd else range(5):
                h, c = _fused_step(
                    layer_in[t],
                    h,
                    c,
                    *(getattr(m, f"{p}_l{s}") for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")),
                    5,
                )
                ys[t] = h
            outs.append(torch.stack(ys))
            hs.append(h)
            cs.append(c)
        layer_in = torch.cat(outs, -1)
    assert torch.equal(out, layer_in) and torch.equal(h_n, torch.stack(hs)) and torch.equal(c_n, torch.stack(cs))


def test_peer_state_dict_keys_load_and_calibrate_one_amax_over_x_and_h():
    m = quant_nn.QuantLSTM(3, 2)
    amax_w = torch.rand(8, 1) + 0.5  # per row of [W_ih | W_hh]: (4 * hidden, 1)
    sd = {**m.state_dict(), "_input_quantizers.0._amax": torch.tensor(2.5), "_weight_quantizers.0._amax": amax_w}
    m.load_state_dict(sd)
    assert m._input_quantizers[0].amax.item() == 2.5 and torch.equal(m._weight_quantizers[0].amax, amax_w)
    assert set(k for k in m.state_dict() if "quantizer" in k) == {
        "_input_quantizers.0._amax",
        "_weight_quantizers.0._amax",
    }

    cell = quant_nn.QuantLSTMCell(3, 2)
    cell._input_quantizer.disable_quant()
    cell._input_quantizer.enable_calib()
    x, h = torch.full((1, 3), 0.5), torch.tensor([[-4.0, 1.0]])
    cell(x, (h, torch.zeros(1, 2)))
    cell._input_quantizer.load_calib_amax()
    assert cell._input_quantizer.amax.item() == 4.0  # the range covers h as well as x


def test_layout_choice_from_float_proj_size_and_flag_type():
    ref = nn.LSTM(3, 4)
    assert quant_nn.QuantLSTM.from_float(ref).fused_gemm is False  # modelopt_lite.quantize: per-matmul quantizers
    fused = quant_nn.QuantLSTM.from_float(ref, fused_gemm=True)
    assert fused.fused_gemm is True and len(fused._weight_quantizers) == 1
    assert quant_nn.QuantGRUCell.from_float(nn.GRUCell(2, 3)).fused_gemm is False
    with pytest.raises(
        ValueError, match=r"QuantLSTM: proj_size=2 needs the per-matmul quantizers \(fused_gemm=False\)"
    ):
        quant_nn.QuantLSTM(3, 4, proj_size=2)
    assert quant_nn.QuantLSTM(3, 4, proj_size=2, fused_gemm=False).gate_quantizers["l0"].hr is not None
    with pytest.raises(TypeError, match="fused_gemm must be a bool, got 1"):
        quant_nn.QuantLSTMCell(3, 4, fused_gemm=1)


def test_fused_gru_and_rnn_cells_share_the_ranges_too():
    torch.manual_seed(0)
    cell = quant_nn.QuantGRUCell(3, 4, quant_desc_input=QD(num_bits=4), quant_desc_weight=QD(num_bits=4))
    x, h = _x(2, 3) * 2, _x(2, 4, seed=1) * 0.1
    xh = torch.cat([x, h], 1)
    xq, hq = fake_tensor_quant(xh, xh.abs().amax(), 4).split([3, 4], 1)
    w = torch.cat([cell.weight_ih, cell.weight_hh], 1)
    wi, wh = fake_tensor_quant(w, w.abs().amax(), 4).split([3, 4], 1)
    gx, gh = F.linear(xq, wi, cell.bias_ih), F.linear(hq, wh, cell.bias_hh)
    xr, xz, xn = gx.chunk(3, -1)
    hr, hz, hn = gh.chunk(3, -1)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    assert torch.equal(cell(x, h), (1 - z) * torch.tanh(xn + r * hn) + z * h)
