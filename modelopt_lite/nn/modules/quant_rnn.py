"""``QuantLSTM`` and ``QuantLSTMCell``: every gate matmul takes a quantized activation and a quantized weight.

An LSTM step computes ``gates = x W_ih^T + b_ih + h W_hh^T + b_hh`` (gate order i, f, g, o), then
``c' = f * c + i * g`` and ``h' = o * tanh(c')`` with sigmoid i, f, o and tanh g. Each of the two matmuls has its
own pair of quantizers (a :class:`GemmQuantizers`: ``input_quantizer`` for the activation, ``weight_quantizer``
for the weight), because ``x`` and ``h`` have different ranges (pytorch-quantization shares one input quantizer
between them). The biases and the element-wise gate math stay in float. Module paths look like
``lstm.gate_quantizers.l1_reverse.hh.input_quantizer``, so ``"*input_quantizer"`` / ``"*weight_quantizer"``
config patterns reach all of them.

The computation is a functional re-implementation (a Python loop over time steps), not cuDNN/oneDNN: with
quantization disabled it matches ``nn.LSTM`` to float rounding, not bit for bit. The input projection of a whole
sequence is one matmul (its activation quantizer sees the whole sequence at once); the hidden state is quantized
at every step. ``proj_size > 0`` and PackedSequence inputs are not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ...descriptor import QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
from ..tensor_quantizer import TensorQuantizer
from ._base import QuantModuleMixin, module_device


class GemmQuantizers(nn.Module):
    """The quantizers of one matmul: ``input_quantizer`` (activation) and ``weight_quantizer`` (weight)."""

    def __init__(self, desc_input, desc_weight):
        super().__init__()
        self.input_quantizer = TensorQuantizer(desc_input)
        self.weight_quantizer = TensorQuantizer(desc_weight)


class CellQuantizers(nn.Module):
    """``ih`` (input projection) and ``hh`` (recurrent projection) quantizers of one LSTM cell."""

    def __init__(self, desc_input, desc_weight):
        super().__init__()
        self.ih = GemmQuantizers(desc_input, desc_weight)
        self.hh = GemmQuantizers(desc_input, desc_weight)


def lstm_gates_to_state(gates: torch.Tensor, c: torch.Tensor):
    """(h', c') from the pre-activation gates (i, f, g, o along the last dim) and the previous cell state."""
    i, f, g, o = gates.chunk(4, dim=-1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


class _QuantRNNMixin(QuantModuleMixin):
    default_quant_desc_weight = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def _check_desc_args(self, quant_desc_input, quant_desc_weight):
        di = self._desc(quant_desc_input, self.default_quant_desc_input, "quant_desc_input")
        dw = self._desc(quant_desc_weight, self.default_quant_desc_weight, "quant_desc_weight")
        return di, dw


class QuantLSTMCell(_QuantRNNMixin, nn.LSTMCell):
    """``nn.LSTMCell`` with quantized matmul operands: quantizers ``ih`` and ``hh`` (:class:`GemmQuantizers`).

    ``input_quantizer`` / ``weight_quantizer`` are read-only aliases of ``ih.input_quantizer`` /
    ``ih.weight_quantizer``; ``output_quantizer`` (disabled by default) applies to the returned ``h``.
    Defaults: activations 8-bit per tensor, weights 8-bit per row (axis 0 of ``(4 * hidden, in)``).
    """

    _float_cls = nn.LSTMCell

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        di, dw = self._check_desc_args(quant_desc_input, quant_desc_weight)
        self.cell_quantizers = CellQuantizers(di, dw).to(module_device(self))
        self.output_quantizer = TensorQuantizer(self.default_quant_desc_input, disabled=True).to(module_device(self))

    input_quantizer = property(lambda self: self.cell_quantizers.ih.input_quantizer, doc="Quantizer of x.")
    weight_quantizer = property(lambda self: self.cell_quantizers.ih.weight_quantizer, doc="Quantizer of W_ih.")

    def forward(self, input, hx=None):
        if input.dim() not in (1, 2):
            raise ValueError(f"QuantLSTMCell: expected a 1-D (unbatched) or 2-D (batched) input, got {input.dim()}-D")
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        if hx is None:
            zeros = x.new_zeros(x.size(0), self.hidden_size)
            h, c = zeros, zeros
        else:
            h, c = hx if batched else (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
        q = self.cell_quantizers
        gates = F.linear(q.ih.input_quantizer(x), q.ih.weight_quantizer(self.weight_ih), self.bias_ih)
        gates = gates + F.linear(q.hh.input_quantizer(h), q.hh.weight_quantizer(self.weight_hh), self.bias_hh)
        h, c = lstm_gates_to_state(gates, c)
        h = self.output_quantizer(h)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))


class QuantLSTM(_QuantRNNMixin, nn.LSTM):
    """``nn.LSTM`` (any layers, bidirectional, batch_first, dropout) with quantized matmul operands.

    ``gate_quantizers`` maps ``"l{k}"`` / ``"l{k}_reverse"`` to a :class:`CellQuantizers` (``ih`` and ``hh``).
    ``input_quantizer`` / ``weight_quantizer`` are read-only aliases of layer 0's forward ``ih`` quantizers;
    ``output_quantizer`` (disabled by default) applies to the output sequence.
    """

    _float_cls = nn.LSTM

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def _suffixes(self):
        return ("", "_reverse") if self.bidirectional else ("",)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        if self.proj_size > 0:
            raise ValueError("QuantLSTM does not support proj_size > 0")
        di, dw = self._check_desc_args(quant_desc_input, quant_desc_weight)
        dev = module_device(self)
        self.gate_quantizers = nn.ModuleDict(
            {f"l{k}{s}": CellQuantizers(di, dw).to(dev) for k in range(self.num_layers) for s in self._suffixes()}
        )
        self.output_quantizer = TensorQuantizer(self.default_quant_desc_input, disabled=True).to(dev)

    input_quantizer = property(lambda self: self.gate_quantizers["l0"].ih.input_quantizer, doc="Quantizer of x.")
    weight_quantizer = property(
        lambda self: self.gate_quantizers["l0"].ih.weight_quantizer, doc="Quantizer of weight_ih_l0."
    )

    def _direction(self, x, h, c, key: str, reverse: bool):
        """Run one layer in one direction over x (T, N, In); returns (outputs (T, N, H), h_T, c_T)."""
        q = self.gate_quantizers[key]
        suffix = key[key.index("l") + 1 :]
        w_ih, w_hh = getattr(self, f"weight_ih_l{suffix}"), getattr(self, f"weight_hh_l{suffix}")
        b_ih = getattr(self, f"bias_ih_l{suffix}") if self.bias else None
        b_hh = getattr(self, f"bias_hh_l{suffix}") if self.bias else None
        gx = F.linear(q.ih.input_quantizer(x), q.ih.weight_quantizer(w_ih), b_ih)
        w_hh_q = q.hh.weight_quantizer(w_hh)
        outs = [None] * x.size(0)
        steps = range(x.size(0) - 1, -1, -1) if reverse else range(x.size(0))
        for t in steps:
            gates = gx[t] + F.linear(q.hh.input_quantizer(h), w_hh_q, b_hh)
            h, c = lstm_gates_to_state(gates, c)
            outs[t] = h
        return torch.stack(outs), h, c

    def forward(self, input, hx=None):
        if isinstance(input, PackedSequence):
            raise TypeError("QuantLSTM does not support PackedSequence inputs; pass a padded tensor")
        if input.dim() not in (2, 3):
            raise ValueError(f"QuantLSTM: expected a 2-D (unbatched) or 3-D (batched) input, got {input.dim()}-D")
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1)
        if batched and self.batch_first:
            x = x.transpose(0, 1)
        n_dirs = len(self._suffixes())
        if hx is None:
            zeros = x.new_zeros(self.num_layers * n_dirs, x.size(1), self.hidden_size)
            h0, c0 = zeros, zeros
        else:
            h0, c0 = hx if batched else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        hn, cn = [], []
        layer_in = x
        for k in range(self.num_layers):
            outs = []
            for d, s in enumerate(self._suffixes()):
                idx = k * n_dirs + d
                o, h, c = self._direction(layer_in, h0[idx], c0[idx], f"l{k}{s}", reverse=bool(d))
                outs.append(o)
                hn.append(h)
                cn.append(c)
            layer_in = torch.cat(outs, dim=-1) if n_dirs == 2 else outs[0]
            if self.dropout > 0 and self.training and k < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, training=True)
        out = self.output_quantizer(layer_in)
        h_n, c_n = torch.stack(hn), torch.stack(cn)
        if not batched:
            return out.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, (h_n, c_n)
