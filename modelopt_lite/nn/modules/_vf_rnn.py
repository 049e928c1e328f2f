"""``VFRNNForward``: ModelOpt's functional multi-layer RNN runner (``quant_rnn.VFRNNForward``), for code written
against it.

It takes the arguments of torch's ``_VF.lstm`` / ``_VF.gru`` / ``_VF.rnn_tanh`` / ``_VF.rnn_relu`` and runs the
layers in Python with one activation quantizer per layer and direction (any callable ``x -> x``), applied at every
time step to the step's input and to the state the step reads (``h``, and ``c`` for an LSTM), as ModelOpt's runner
does; with ``proj_input_quantizers`` an LSTM's projection input is quantized too. Weights are used as given (quantize
them before the call). The gate math is that of :mod:`._rnn_cells`.

This is not how :class:`~modelopt_lite.nn.QuantLSTM` and its siblings quantize: they give the input projection and
the recurrent projection their own quantizers, quantize the input projection of the whole sequence at once and leave
the cell state ``c`` in float (see :mod:`.quant_rnn`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ._rnn_cells import RNN_ACTIVATIONS, gru_step, lstm_gates_to_state

_MODES = ("LSTM", "GRU", "RNN_TANH", "RNN_RELU")

Quantizer = Callable[[torch.Tensor], torch.Tensor]


class VFRNNForward:
    """torch's ``_VF`` RNN call with per layer and direction activation quantizers (see the module docstring).

    Args:
        mode: ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"`` or ``"RNN_RELU"`` (an RNN module's ``mode``).
        bidirectional, num_layers: as the module's.
        has_proj: an LSTM with ``proj_size > 0`` (a ``weight_hr`` per layer and direction).
        has_bias: the weights include ``bias_ih`` / ``bias_hh``.
        input_quantizers: ``num_layers * num_directions`` callables, in torch's layer-direction order.
        proj_input_quantizers: the same count of callables for the projection input, or None.
        batch_first: the constant-length input is ``(N, T, In)``.

    Call it as ``_VF.lstm`` is called: ``(input, hx, flat_weights, has_biases, num_layers, dropout, train,
    bidirectional, batch_first)`` for a padded batch, ``(data, batch_sizes, hx, flat_weights, has_biases, num_layers,
    dropout, train, bidirectional)`` for a packed one. Returns ``(output, h_n, c_n)`` for an LSTM, ``(output, h_n)``
    otherwise.
    """

    def __init__(
        self,
        mode: str,
        bidirectional: bool,
        num_layers: int,
        has_proj: bool,
        has_bias: bool,
        input_quantizers: Sequence[Quantizer],
        proj_input_quantizers: Sequence[Quantizer] | None = None,
        batch_first: bool | None = False,
    ):
        if mode not in _MODES:
            raise ValueError(f"VFRNNForward: mode must be one of {_MODES}, got {mode!r}")
        if has_proj and mode != "LSTM":
            raise ValueError(f"VFRNNForward: has_proj applies to LSTM only, got mode {mode!r}")
        self.mode = mode
        self.num_directions = 2 if bidirectional else 1
        self.num_layers = int(num_layers)
        self.has_proj = bool(has_proj)
        self.num_weights_per_layer = (4 if has_bias else 2) + (1 if has_proj else 0)
        total = self.num_layers * self.num_directions
        self.input_quantizers = list(input_quantizers)
        if len(self.input_quantizers) < total:
            raise ValueError(f"VFRNNForward: {total} input quantizers needed, got {len(self.input_quantizers)}")
        self.proj_input_quantizers = None if proj_input_quantizers is None else list(proj_input_quantizers)
        self.batch_first = bool(batch_first)

    def _step(self, x, state, w, iq, piq):
        w_ih, w_hh = w[0], w[1]
        b_ih, b_hh = (w[2], w[3]) if len(w) - int(self.has_proj) == 4 else (None, None)
        qstate = tuple(iq(s) for s in state)
        gx = F.linear(iq(x), w_ih, b_ih)
        gh = F.linear(qstate[0], w_hh, b_hh)
        if self.mode == "LSTM":
            h, c = lstm_gates_to_state(gx + gh, qstate[1])
            if self.has_proj:
                h = F.linear(piq(h) if piq is not None else h, w[-1])
            return (h, c)
        if self.mode == "GRU":
            return (gru_step(gx, gh, qstate[0]),)
        return (RNN_ACTIVATIONS["tanh" if self.mode == "RNN_TANH" else "relu"](gx + gh),)

    def _direction(self, x, sizes, state, w, iq, piq, reverse: bool):
        """x (T, N, In); sizes: active batch rows per step (N for every step when padded)."""
        outs: list[torch.Tensor] = [x.new_empty(0)] * x.size(0)
        for t in range(x.size(0) - 1, -1, -1) if reverse else range(x.size(0)):
            b = sizes[t]
            new = self._step(x[t, :b], tuple(s[:b] for s in state), w, iq, piq)
            state = tuple(torch.cat([n, s[b:]]) for n, s in zip(new, state))
            outs[t] = new[0]
        return outs, state

    def _run(self, steps: list[torch.Tensor], sizes: list[int], hidden, flat_weights, dropout, training):
        hx = tuple(hidden) if self.mode == "LSTM" else (hidden,)
        finals = []
        layer_in = steps
        for layer in range(self.num_layers):
            per_dir = []
            for d in range(self.num_directions):
                idx = layer * self.num_directions + d
                w = flat_weights[idx * self.num_weights_per_layer : (idx + 1) * self.num_weights_per_layer]
                piq = self.proj_input_quantizers[idx] if self.proj_input_quantizers else None
                width = max(s.size(-1) for s in layer_in)
                x = layer_in[0].new_zeros(len(layer_in), sizes[0], width)
                for t, s in enumerate(layer_in):
                    x[t, : s.size(0)] = s
                outs, final = self._direction(x, sizes, tuple(h[idx] for h in hx), w, self.input_quantizers[idx],
                                              piq, reverse=bool(d))  # fmt: skip
                per_dir.append(outs)
                finals.append(final)
            layer_in = [torch.cat(o, dim=-1) for o in zip(*per_dir)]
            if dropout and layer < self.num_layers - 1:
                layer_in = [F.dropout(o, p=dropout, training=training) for o in layer_in]
        h_n = tuple(torch.stack([f[i] for f in finals]) for i in range(len(finals[0])))
        return layer_in, h_n

    def __call__(self, *args):
        if len(args) != 9:
            raise TypeError(f"VFRNNForward expects the 9 arguments of a _VF RNN call, got {len(args)}")
        if isinstance(args[3], bool):  # padded: (input, hx, weights, has_biases, layers, dropout, train, bidir, bf)
            input, hidden, flat_weights, _, _, dropout, training, _, batch_first = args
            x = input.transpose(0, 1) if batch_first else input
            outs, h_n = self._run(list(x.unbind(0)), [x.size(1)] * x.size(0), hidden, flat_weights, dropout, training)
            out = torch.stack(outs)
            out = out.transpose(0, 1) if batch_first else out
        else:  # packed: (data, batch_sizes, hx, weights, has_biases, layers, dropout, train, bidir)
            data, batch_sizes, hidden, flat_weights, _, _, dropout, training, _ = args
            sizes = [int(b) for b in batch_sizes]
            steps = list(torch.split(data, sizes))
            outs, h_n = self._run(steps, sizes, hidden, flat_weights, dropout, training)
            out = torch.cat(outs)
        return (out, *h_n)
