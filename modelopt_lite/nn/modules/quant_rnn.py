"""``QuantLSTM``, ``QuantGRU``, ``QuantRNN`` and their cells: every gate matmul takes a quantized activation and a
quantized weight (the math is in :mod:`._rnn_cells`).

Each matmul has its own pair of quantizers (a :class:`GemmQuantizers`: ``input_quantizer`` for the activation,
``weight_quantizer`` for the weight), because ``x`` and ``h`` have different ranges (pytorch-quantization shares
one input quantizer between them). Module paths look like ``lstm.gate_quantizers.l1_reverse.hh.input_quantizer``,
so ``"*input_quantizer"`` / ``"*weight_quantizer"`` config patterns reach all of them. An LSTM with
``proj_size > 0`` has a third pair, ``hr``, for the projection ``h W_hr^T``.

The computation is a functional re-implementation (a Python loop over time steps), not cuDNN/oneDNN: with
quantization disabled it matches ``nn.LSTM``/``nn.GRU``/``nn.RNN`` to float rounding, not bit for bit. The input
projection of a whole sequence is one matmul (its activation quantizer sees the whole sequence at once); the hidden
state is quantized at every step. PackedSequence inputs give PackedSequence outputs; their padding never reaches a
quantizer (or its calibrator) and each sequence's final state is the one at its own length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ...descriptor import QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
from ..tensor_quantizer import TensorQuantizer
from ._base import QuantModuleMixin, module_device
from ._registry import QuantModuleRegistry
from ._rnn_cells import (
    RNN_ACTIVATIONS,
    CellQuantizers,
    DirectionWeights,
    GemmQuantizers,
    gru_step,
    lstm_gates_to_state,
    quantize_rows,
    run_direction,
)
from ._vf_rnn import VFRNNForward

if TYPE_CHECKING:
    _CellTyping = nn.RNNCellBase
    _RNNTyping = nn.RNNBase
else:
    _CellTyping = _RNNTyping = object

__all__ = [
    "CellQuantizers",
    "GemmQuantizers",
    "QuantizerGroup",
    "QuantGRU",
    "QuantGRUCell",
    "QuantLSTM",
    "QuantLSTMCell",
    "QuantRNN",
    "QuantRNNCell",
    "VFRNNForward",
]


class QuantizerGroup:
    """Several quantizers switched as one: pytorch-quantization's view of an RNN cell's quantizers.

    pytorch-quantization gives a cell one input quantizer (for ``x`` and ``h``) and one weight quantizer (for
    ``W_ih`` and ``W_hh``); here each matmul has its own (see the module docstring). The peer's private names
    ``_input_quantizer`` / ``_weight_quantizer`` of a cell (and the per layer and direction lists
    ``_input_quantizers`` / ``_weight_quantizers`` of a QuantLSTM/GRU/RNN) are groups, so its code that switches
    them (``disable()``, ``enable_calib()``, ``load_calib_amax()``, ...) reaches every matmul. Other attributes read
    the first quantizer (the ``ih`` one). The ranges stay separate: this is a switch, not a shared amax.
    """

    _SWITCHES = (
        "enable",
        "disable",
        "enable_quant",
        "disable_quant",
        "enable_calib",
        "disable_calib",
        "load_calib_amax",
        "reset_amax",
        "init_learn_amax",
    )

    def __init__(self, quantizers) -> None:
        self.quantizers: tuple[TensorQuantizer, ...] = tuple(quantizers)

    def __iter__(self):
        return iter(self.quantizers)

    def __len__(self) -> int:
        return len(self.quantizers)

    def __getattr__(self, name: str):
        if name in QuantizerGroup._SWITCHES:

            def switch(*args, **kwargs) -> None:
                for q in self.quantizers:
                    getattr(q, name)(*args, **kwargs)

            return switch
        return getattr(self.quantizers[0], name)

    def __repr__(self) -> str:
        return f"QuantizerGroup({len(self.quantizers)} quantizers: {', '.join(q.name or '?' for q in self.quantizers)})"


def _group(cells: CellQuantizers, kind: str) -> QuantizerGroup:
    gemms = [cells.ih, cells.hh, *([cells.hr] if hasattr(cells, "hr") else [])]
    return QuantizerGroup(getattr(g, kind) for g in gemms)


class _QuantRNNMixin(QuantModuleMixin):
    default_quant_desc_weight = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW

    def _check_desc_args(self, quant_desc_input, quant_desc_weight):
        di = self._desc(quant_desc_input, self.default_quant_desc_input, "quant_desc_input")
        dw = self._desc(quant_desc_weight, self.default_quant_desc_weight, "quant_desc_weight")
        return di, dw


# --- cells ---------------------------------------------------------------------------------------------------------
class _QuantCell(_QuantRNNMixin, _CellTyping):
    """Shared body of the cells: quantizers ``cell_quantizers.ih`` / ``.hh``; ``output_quantizer`` on the new h."""

    _kind: str

    if TYPE_CHECKING:  # RNNCell only
        nonlinearity: str

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        di, dw = self._check_desc_args(quant_desc_input, quant_desc_weight)
        self.cell_quantizers = CellQuantizers(di, dw).to(module_device(self))
        self.output_quantizer = TensorQuantizer(self.default_quant_desc_input, disabled=True).to(module_device(self))

    input_quantizer = property(lambda self: self.cell_quantizers.ih.input_quantizer, doc="Quantizer of x.")
    weight_quantizer = property(lambda self: self.cell_quantizers.ih.weight_quantizer, doc="Quantizer of W_ih.")
    # pytorch-quantization's names: one switch for the x and h (W_ih and W_hh) quantizers (see QuantizerGroup)
    _input_quantizer = property(lambda self: _group(self.cell_quantizers, "input_quantizer"))
    _weight_quantizer = property(lambda self: _group(self.cell_quantizers, "weight_quantizer"))

    def forward(self, input, hx=None):
        self._check_fake_quant()
        name = type(self).__name__
        if input.dim() not in (1, 2):
            raise ValueError(f"{name}: expected a 1-D (unbatched) or 2-D (batched) input, got {input.dim()}-D")
        batched = input.dim() == 2
        x = input if batched else input.unsqueeze(0)
        if hx is None:
            zeros = x.new_zeros(x.size(0), self.hidden_size)
            state: tuple[torch.Tensor, ...] = (zeros, zeros) if self._kind == "LSTM" else (zeros,)
        else:
            state = tuple(hx) if self._kind == "LSTM" else (hx,)
            state = state if batched else tuple(s.unsqueeze(0) for s in state)
        q = self.cell_quantizers
        gx = F.linear(q.ih.input_quantizer(x), q.ih.weight_quantizer(self.weight_ih), self.bias_ih)
        gh = F.linear(q.hh.input_quantizer(state[0]), q.hh.weight_quantizer(self.weight_hh), self.bias_hh)
        if self._kind == "LSTM":
            h, c = lstm_gates_to_state(gx + gh, state[1])
            h = self.output_quantizer(h)
            return (h, c) if batched else (h.squeeze(0), c.squeeze(0))
        h = gru_step(gx, gh, state[0]) if self._kind == "GRU" else RNN_ACTIVATIONS[self.nonlinearity](gx + gh)
        h = self.output_quantizer(h)
        return h if batched else h.squeeze(0)


@QuantModuleRegistry.register({nn.LSTMCell: "nn.LSTMCell"})
class QuantLSTMCell(_QuantCell, nn.LSTMCell):
    """``nn.LSTMCell`` with quantized matmul operands: quantizers ``ih`` and ``hh`` (:class:`GemmQuantizers`).

    ``input_quantizer`` / ``weight_quantizer`` are read-only aliases of ``ih.input_quantizer`` /
    ``ih.weight_quantizer``; ``output_quantizer`` (disabled by default) applies to the returned ``h``.
    Defaults: activations 8-bit per tensor, weights 8-bit per row (axis 0 of ``(4 * hidden, in)``).
    """

    _float_cls = nn.LSTMCell
    _kind = "LSTM"


@QuantModuleRegistry.register({nn.GRUCell: "nn.GRUCell"})
class QuantGRUCell(_QuantCell, nn.GRUCell):
    """``nn.GRUCell`` with quantized matmul operands (as :class:`QuantLSTMCell`)."""

    _float_cls = nn.GRUCell
    _kind = "GRU"


@QuantModuleRegistry.register({nn.RNNCell: "nn.RNNCell"})
class QuantRNNCell(_QuantCell, nn.RNNCell):
    """``nn.RNNCell`` (tanh or relu) with quantized matmul operands (as :class:`QuantLSTMCell`)."""

    _float_cls = nn.RNNCell
    _kind = "RNN"


# --- multi-layer modules -------------------------------------------------------------------------------------------
class _QuantRNNBase(_QuantRNNMixin, _RNNTyping):
    """Shared body of QuantLSTM / QuantGRU / QuantRNN (any layers, bidirectional, batch_first, dropout).

    ``gate_quantizers`` maps ``"l{k}"`` / ``"l{k}_reverse"`` to a :class:`CellQuantizers`. ``input_quantizer`` /
    ``weight_quantizer`` are read-only aliases of layer 0's forward ``ih`` quantizers; ``output_quantizer``
    (disabled by default) applies to the output sequence.
    """

    _kind: str

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight)

    def _suffixes(self) -> tuple[str, ...]:
        return ("", "_reverse") if self.bidirectional else ("",)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None) -> None:
        di, dw = self._check_desc_args(quant_desc_input, quant_desc_weight)
        dev = module_device(self)
        proj = self.proj_size > 0
        self.gate_quantizers = nn.ModuleDict(
            {
                f"l{k}{s}": CellQuantizers(di, dw, proj=proj).to(dev)
                for k in range(self.num_layers)
                for s in self._suffixes()
            }
        )
        self.output_quantizer = TensorQuantizer(self.default_quant_desc_input, disabled=True).to(dev)

    input_quantizer = property(lambda self: self.gate_quantizers["l0"].ih.input_quantizer, doc="Quantizer of x.")
    weight_quantizer = property(
        lambda self: self.gate_quantizers["l0"].ih.weight_quantizer, doc="Quantizer of weight_ih_l0."
    )
    # pytorch-quantization's per layer and direction lists (l0, l0_reverse, l1, ...), each a QuantizerGroup
    _input_quantizers = property(lambda self: [_group(c, "input_quantizer") for c in self.gate_quantizers.values()])
    _weight_quantizers = property(lambda self: [_group(c, "weight_quantizer") for c in self.gate_quantizers.values()])

    # ModelOpt's switches of a QuantLSTM/GRU/RNN (its tests and users' code call them)
    def _gemm_quantizers(self, kind: str) -> list[TensorQuantizer]:
        return [q for name, q in self.gate_quantizers.named_modules() if name.endswith(kind)]

    def _disable_input_quantizers(self) -> None:
        """Disable every activation quantizer (``ih``, ``hh`` and ``hr``, every layer and direction)."""
        for q in self._gemm_quantizers("input_quantizer"):
            q.disable()

    def _enable_input_quantizers(self) -> None:
        """Enable every activation quantizer."""
        for q in self._gemm_quantizers("input_quantizer"):
            q.enable()

    def _disable_weight_quantizers(self) -> None:
        """Disable every weight quantizer."""
        for q in self._gemm_quantizers("weight_quantizer"):
            q.disable()

    def _enable_weight_quantizer(self) -> None:
        """Enable every weight quantizer (ModelOpt's name, singular)."""
        for q in self._gemm_quantizers("weight_quantizer"):
            q.enable()

    def _initial_state(self, x: torch.Tensor, hx, batched: bool) -> tuple[torch.Tensor, ...]:
        n_state = self.num_layers * len(self._suffixes())
        h_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        if hx is None:
            h0 = x.new_zeros(n_state, x.size(1), h_size)
            return (h0, x.new_zeros(n_state, x.size(1), self.hidden_size)) if self._kind == "LSTM" else (h0,)
        state = tuple(hx) if self._kind == "LSTM" else (hx,)
        return state if batched else tuple(s.unsqueeze(1) for s in state)

    def forward(self, input, hx=None):
        self._check_fake_quant()
        name = type(self).__name__
        packed = input if isinstance(input, PackedSequence) else None
        lengths = None
        if packed is not None:
            x, lengths = pad_packed_sequence(packed)  # (T, N, In) in the caller's batch order
            lengths = lengths.to(x.device)
            batched = True
        else:
            if input.dim() not in (2, 3):
                raise ValueError(f"{name}: expected a 2-D (unbatched) or 3-D (batched) input, got {input.dim()}-D")
            batched = input.dim() == 3
            x = input if batched else input.unsqueeze(1)
            if batched and self.batch_first:
                x = x.transpose(0, 1)
        state0 = self._initial_state(x, hx, batched)
        finals: list[tuple[torch.Tensor, ...]] = []
        layer_in = x
        n_dirs = len(self._suffixes())
        for k in range(self.num_layers):
            outs = []
            for d, s in enumerate(self._suffixes()):
                idx = k * n_dirs + d
                key = f"l{k}{s}"
                weights = DirectionWeights(self, f"{k}{s}", cast(CellQuantizers, self.gate_quantizers[key]))
                start = tuple(t[idx] for t in state0)
                nonlin = getattr(self, "nonlinearity", "tanh")
                o, final = run_direction(self._kind, weights, layer_in, start, bool(d), lengths, nonlin)
                outs.append(o)
                finals.append(final)
            layer_in = torch.cat(outs, dim=-1) if n_dirs == 2 else outs[0]
            if self.dropout > 0 and self.training and k < self.num_layers - 1:
                layer_in = F.dropout(layer_in, self.dropout, training=True)
        valid = None
        if lengths is not None:
            valid = torch.arange(x.size(0), device=x.device).unsqueeze(1) < lengths.unsqueeze(0)
        out = quantize_rows(self.output_quantizer, layer_in, valid)
        state_n = tuple(torch.stack([f[i] for f in finals]) for i in range(len(finals[0])))
        hidden: Any = state_n if self._kind == "LSTM" else state_n[0]
        if packed is not None:
            return _repack(out, packed), hidden
        if not batched:
            hidden = tuple(s.squeeze(1) for s in state_n) if self._kind == "LSTM" else state_n[0].squeeze(1)
            return out.squeeze(1), hidden
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, hidden


def _repack(out: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """``out`` (T, N, H), padded in the caller's batch order, as a PackedSequence laid out like ``like``."""
    order = like.sorted_indices
    sorted_out = out if order is None else out.index_select(1, order.to(out.device))
    sizes = like.batch_sizes
    mask = torch.arange(out.size(1)).unsqueeze(0) < sizes.unsqueeze(1)  # (T, N) in sorted batch order
    data = sorted_out[mask.to(out.device)]
    return PackedSequence(data, sizes, like.sorted_indices, like.unsorted_indices)


@QuantModuleRegistry.register({nn.LSTM: "nn.LSTM"})
class QuantLSTM(_QuantRNNBase, nn.LSTM):
    """``nn.LSTM`` (any layers, bidirectional, batch_first, dropout, ``proj_size``, PackedSequence inputs) with
    quantized matmul operands; ``proj_size > 0`` adds the ``hr`` quantizers of the projection."""

    _float_cls = nn.LSTM
    _kind = "LSTM"


@QuantModuleRegistry.register({nn.GRU: "nn.GRU"})
class QuantGRU(_QuantRNNBase, nn.GRU):
    """``nn.GRU`` (any layers, bidirectional, batch_first, dropout, PackedSequence inputs), quantized matmuls."""

    _float_cls = nn.GRU
    _kind = "GRU"


@QuantModuleRegistry.register({nn.RNN: "nn.RNN"})
class QuantRNN(_QuantRNNBase, nn.RNN):
    """``nn.RNN`` (tanh or relu; any layers, bidirectional, batch_first, dropout, PackedSequence), quantized."""

    _float_cls = nn.RNN
    _kind = "RNN"
