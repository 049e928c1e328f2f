"""``QuantLSTM``, ``QuantGRU``, ``QuantRNN`` and their cells: every gate matmul takes a quantized activation and a
quantized weight (the math is in :mod:`._rnn_cells`). Two quantizer layouts (``fused_gemm``):

- fused (``fused_gemm=True``, the default of the constructor: pytorch-quantization's layout and its constructor
  ``QuantLSTM(..., quant_desc_input=..., quant_desc_weight=...)``, also what ``quant_modules.initialize()`` builds):
  one step is one GEMM ``[x | h] [W_ih | W_hh]^T``, so a cell has ONE input quantizer for ``[x | h]`` and ONE weight
  quantizer for ``[W_ih | W_hh]`` (per row: one scale per gate row over both matrices), named as the peer's:
  ``_input_quantizer`` / ``_weight_quantizer`` on a cell, ``_input_quantizers.{i}`` / ``_weight_quantizers.{i}``
  (one per layer and direction, l0, l0_reverse, l1, ...) on QuantLSTM/GRU/RNN, so its state dicts load;
- per matmul (``fused_gemm=False``, the default of ``from_float``, i.e. of ``modelopt_lite.quantize``): each matmul
  has its own pair (a :class:`GemmQuantizers`: ``input_quantizer`` for the activation, ``weight_quantizer`` for the
  weight), because ``x`` and ``h`` have different ranges. Module paths look like
  ``lstm.gate_quantizers.l1_reverse.hh.input_quantizer``, so ``"*input_quantizer"`` / ``"*weight_quantizer"`` config
  patterns reach all of them. An LSTM with ``proj_size > 0`` has a third pair, ``hr``, for the projection
  ``h W_hr^T`` (the fused layout does not take ``proj_size``, as pytorch-quantization).

The computation is a functional re-implementation (a Python loop over time steps), not cuDNN/oneDNN: with
quantization disabled it matches ``nn.LSTM``/``nn.GRU``/``nn.RNN`` to float rounding, not bit for bit. Per matmul,
the input projection of a whole sequence is one matmul (its activation quantizer sees the whole sequence at once);
fused, ``[x_t | h]`` is quantized at every step; the hidden state is quantized at every step. PackedSequence inputs give PackedSequence outputs; their padding never reaches a
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
from ._base import QuantModuleMixin, module_device, recast_copy
from ._registry import QuantModuleRegistry
from ._rnn_cells import (
    RNN_ACTIVATIONS,
    CellQuantizers,
    DirectionWeights,
    FusedQuantizers,
    GemmQuantizers,
    fused_inputs,
    fused_weights,
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
    "FusedQuantizers",
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
    ``W_ih`` and ``W_hh``); in the per-matmul layout each matmul has its own (see the module docstring). The peer's
    private names
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


def _fused_flag(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fused_gemm must be a bool, got {value!r}")
    return value


class _QuantRNNMixin(QuantModuleMixin):
    default_quant_desc_weight = QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW
    #: True: pytorch-quantization's fused layout (one quantizer for [x | h], one for [W_ih | W_hh]); see module doc
    fused_gemm: bool = False

    def _check_desc_args(self, quant_desc_input, quant_desc_weight):
        di = self._desc(quant_desc_input, self.default_quant_desc_input, "quant_desc_input")
        dw = self._desc(quant_desc_weight, self.default_quant_desc_weight, "quant_desc_weight")
        return di, dw

    def _init_fused(self, di, dw, count: int | None) -> None:
        """The fused layout's quantizers under the peer's names (a single pair, or ``count`` pairs in lists)."""
        dev = module_device(self)
        if count is None:
            self._modules["_input_quantizer"] = TensorQuantizer(di).to(dev)
            self._modules["_weight_quantizer"] = TensorQuantizer(dw).to(dev)
        else:
            self._modules["_input_quantizers"] = nn.ModuleList(TensorQuantizer(di).to(dev) for _ in range(count))
            self._modules["_weight_quantizers"] = nn.ModuleList(TensorQuantizer(dw).to(dev) for _ in range(count))

    @classmethod
    def from_float(cls, module: nn.Module, quant_desc_input=None, quant_desc_weight=None, fused_gemm: bool = False):
        """A quantized copy of a float RNN module (see ``QuantModuleMixin.from_float``); per-matmul quantizers
        unless ``fused_gemm=True`` (pytorch-quantization's layout)."""
        new = recast_copy(cls, module)
        new._init_quantizers(quant_desc_input, quant_desc_weight, fused_gemm=fused_gemm)
        return new


# --- cells ---------------------------------------------------------------------------------------------------------
class _QuantCell(_QuantRNNMixin, _CellTyping):
    """Shared body of the cells: quantizers ``cell_quantizers.ih`` / ``.hh``; ``output_quantizer`` on the new h."""

    _kind: str

    if TYPE_CHECKING:  # RNNCell only
        nonlinearity: str

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, fused_gemm: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight, fused_gemm=fused_gemm)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None, fused_gemm: bool = False) -> None:
        di, dw = self._check_desc_args(quant_desc_input, quant_desc_weight)
        self.fused_gemm = _fused_flag(fused_gemm)
        if self.fused_gemm:
            self._init_fused(di, dw, None)
        else:
            self.cell_quantizers = CellQuantizers(di, dw).to(module_device(self))
        self.output_quantizer = TensorQuantizer(self.default_quant_desc_input, disabled=True).to(module_device(self))

    def _fused(self) -> FusedQuantizers:
        iq, wq = self._modules["_input_quantizer"], self._modules["_weight_quantizer"]
        return FusedQuantizers(cast(TensorQuantizer, iq), cast(TensorQuantizer, wq))

    def _input_quantizer_of(self) -> TensorQuantizer:
        """Quantizer of x (fused: of [x | h])."""
        return self._fused().input_quantizer if self.fused_gemm else self.cell_quantizers.ih.input_quantizer

    input_quantizer = property(_input_quantizer_of)

    def _weight_quantizer_of(self) -> TensorQuantizer:
        """Quantizer of W_ih (fused: of [W_ih | W_hh])."""
        return self._fused().weight_quantizer if self.fused_gemm else self.cell_quantizers.ih.weight_quantizer

    weight_quantizer = property(_weight_quantizer_of)

    # pytorch-quantization's names: fused, the quantizers themselves; per matmul, one switch for the x and h (W_ih
    # and W_hh) quantizers (see QuantizerGroup)
    @property
    def _input_quantizer(self):
        return self._fused().input_quantizer if self.fused_gemm else _group(self.cell_quantizers, "input_quantizer")

    @property
    def _weight_quantizer(self):
        return self._fused().weight_quantizer if self.fused_gemm else _group(self.cell_quantizers, "weight_quantizer")

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
        if self.fused_gemm:  # one GEMM [x | h] [W_ih | W_hh]^T: one range for each operand
            fq = self._fused()
            w_ih, w_hh = fused_weights(fq, self.weight_ih, self.weight_hh)
            xq, hq = fused_inputs(fq, x, state[0])
            gx, gh = F.linear(xq, w_ih, self.bias_ih), F.linear(hq, w_hh, self.bias_hh)
        else:
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

    Fused (the constructor's default): ``_input_quantizer`` of ``[x | h]`` and ``_weight_quantizer`` of
    ``[W_ih | W_hh]``; per matmul: ``input_quantizer`` / ``weight_quantizer`` are read-only aliases of
    ``ih.input_quantizer`` / ``ih.weight_quantizer``. ``output_quantizer`` (disabled by default) applies to the
    returned ``h``. Defaults: activations 8-bit per tensor, weights 8-bit per row (axis 0 of ``(4 * hidden, in)``).
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

    def __init__(self, *args, quant_desc_input=None, quant_desc_weight=None, fused_gemm: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_quantizers(quant_desc_input, quant_desc_weight, fused_gemm=fused_gemm)

    def _suffixes(self) -> tuple[str, ...]:
        return ("", "_reverse") if self.bidirectional else ("",)

    def _init_quantizers(self, quant_desc_input=None, quant_desc_weight=None, fused_gemm: bool = False) -> None:
        di, dw = self._check_desc_args(quant_desc_input, quant_desc_weight)
        dev = module_device(self)
        proj = self.proj_size > 0
        self.fused_gemm = _fused_flag(fused_gemm)
        if self.fused_gemm:
            if proj:
                raise ValueError(
                    f"{type(self).__name__}: proj_size={self.proj_size} needs the per-matmul quantizers "
                    "(fused_gemm=False); the fused layout (pytorch-quantization's) has no projection quantizer"
                )
            self._init_fused(di, dw, self.num_layers * len(self._suffixes()))
            self.output_quantizer = TensorQuantizer(self.default_quant_desc_input, disabled=True).to(dev)
            return
        self.gate_quantizers = nn.ModuleDict(
            {
                f"l{k}{s}": CellQuantizers(di, dw, proj=proj).to(dev)
                for k in range(self.num_layers)
                for s in self._suffixes()
            }
        )
        self.output_quantizer = TensorQuantizer(self.default_quant_desc_input, disabled=True).to(dev)

    def _cell_quantizers(self, idx: int, key: str) -> CellQuantizers | FusedQuantizers:
        if self.fused_gemm:
            iqs = cast(nn.ModuleList, self._modules["_input_quantizers"])
            wqs = cast(nn.ModuleList, self._modules["_weight_quantizers"])
            return FusedQuantizers(cast(TensorQuantizer, iqs[idx]), cast(TensorQuantizer, wqs[idx]))
        return cast(CellQuantizers, self.gate_quantizers[key])

    def _input_quantizer_of(self) -> TensorQuantizer:
        """Quantizer of x of layer 0 (fused: of its [x | h])."""
        q = self._cell_quantizers(0, "l0")
        return q.input_quantizer if isinstance(q, FusedQuantizers) else q.ih.input_quantizer

    input_quantizer = property(_input_quantizer_of)

    def _weight_quantizer_of(self) -> TensorQuantizer:
        """Quantizer of weight_ih_l0 (fused: of [weight_ih_l0 | weight_hh_l0])."""
        q = self._cell_quantizers(0, "l0")
        return q.weight_quantizer if isinstance(q, FusedQuantizers) else q.ih.weight_quantizer

    weight_quantizer = property(_weight_quantizer_of)

    # pytorch-quantization's per layer and direction lists (l0, l0_reverse, l1, ...): fused, the quantizers
    # themselves (nn.ModuleList); per matmul, each a QuantizerGroup
    @property
    def _input_quantizers(self):
        if self.fused_gemm:
            return self._modules["_input_quantizers"]
        return [_group(cast(CellQuantizers, c), "input_quantizer") for c in self.gate_quantizers.values()]

    @property
    def _weight_quantizers(self):
        if self.fused_gemm:
            return self._modules["_weight_quantizers"]
        return [_group(cast(CellQuantizers, c), "weight_quantizer") for c in self.gate_quantizers.values()]

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
                weights = DirectionWeights(self, f"{k}{s}", self._cell_quantizers(idx, key))
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
