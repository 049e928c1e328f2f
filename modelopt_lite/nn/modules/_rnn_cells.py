"""The per-step math of the quantized recurrent modules (LSTM, GRU, Elman RNN) and their quantizer containers.

Every matmul takes a quantized activation and a quantized weight; the biases and the element-wise gate math stay
in float. A step receives the input projection of its time step ``gx`` (``x W_ih^T + b_ih``, computed for the whole
sequence at once; in the fused layout, :class:`FusedQuantizers`, per step with ``x_t`` and ``h`` quantized
together) and the recurrent projection ``gh`` (``h W_hh^T + b_hh``) and returns the new state:

- LSTM (gate order i, f, g, o): ``c' = f * c + i * g``, ``h' = o * tanh(c')`` with sigmoid i, f, o and tanh g;
  with ``proj_size > 0``, ``h' = (o * tanh(c')) W_hr^T`` (a third quantized matmul, quantizers ``hr``);
- GRU (gate order r, z, n): ``n = tanh(gx_n + r * gh_n)``, ``h' = (1 - z) * n + z * h``;
- RNN: ``h' = tanh(gx + gh)`` (or relu).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_quantizer import TensorQuantizer


class GemmQuantizers(nn.Module):
    """The quantizers of one matmul: ``input_quantizer`` (activation) and ``weight_quantizer`` (weight)."""

    def __init__(self, desc_input, desc_weight):
        super().__init__()
        self.input_quantizer = TensorQuantizer(desc_input)
        self.weight_quantizer = TensorQuantizer(desc_weight)


class CellQuantizers(nn.Module):
    """``ih`` (input projection) and ``hh`` (recurrent projection) quantizers of one cell; ``hr`` (projection of
    an LSTM with ``proj_size > 0``) when ``proj`` is True."""

    def __init__(self, desc_input, desc_weight, proj: bool = False):
        super().__init__()
        self.ih = GemmQuantizers(desc_input, desc_weight)
        self.hh = GemmQuantizers(desc_input, desc_weight)
        if proj:
            self.hr = GemmQuantizers(desc_input, desc_weight)


class FusedQuantizers(NamedTuple):
    """pytorch-quantization's layout (one fused GEMM per step): ``input_quantizer`` quantizes ``[x | h]`` with one
    range, ``weight_quantizer`` quantizes ``[W_ih | W_hh]`` (concatenated along the input dim: per row, a gate row's
    scale covers both matrices)."""

    input_quantizer: TensorQuantizer
    weight_quantizer: TensorQuantizer


def fused_weights(q: FusedQuantizers, w_ih: torch.Tensor, w_hh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_ih, W_hh)`` quantized together by ``q.weight_quantizer``."""
    w = q.weight_quantizer(torch.cat([w_ih, w_hh], 1))
    a, b = w.split([w_ih.size(1), w_hh.size(1)], 1)
    return a, b


def fused_inputs(q: FusedQuantizers, x: torch.Tensor, h: torch.Tensor, rows: torch.Tensor | None = None):
    """``(x, h)`` quantized together by ``q.input_quantizer`` (only the ``rows`` of a packed step, if given)."""
    xh = quantize_rows(q.input_quantizer, torch.cat([x, h], -1), rows)
    a, b = xh.split([x.size(-1), h.size(-1)], -1)
    return a, b


def lstm_gates_to_state(gates: torch.Tensor, c: torch.Tensor):
    """(h', c') from the pre-activation gates (i, f, g, o along the last dim) and the previous cell state."""
    i, f, g, o = gates.chunk(4, dim=-1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def gru_step(gx: torch.Tensor, gh: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h' of a GRU step from the input projection ``gx`` and the recurrent projection ``gh`` (r, z, n each)."""
    xr, xz, xn = gx.chunk(3, dim=-1)
    hr, hz, hn = gh.chunk(3, dim=-1)
    r = torch.sigmoid(xr + hr)
    z = torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return (1 - z) * n + z * h


RNN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"tanh": torch.tanh, "relu": torch.relu}


def quantize_rows(q: TensorQuantizer, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``q(x)``, or with a boolean ``rows`` mask (over the leading dims of x): only those rows go through ``q``
    (padding of a PackedSequence never reaches a quantizer or its calibrator); the others are left as they are."""
    if rows is None:
        return q(x)
    return x.masked_scatter(rows.unsqueeze(-1), q(x[rows]))


class DirectionWeights:
    """The weights of one layer in one direction (``weight_ih_l0_reverse`` etc.) and its quantizers."""

    def __init__(self, module: nn.Module, suffix: str, quantizers: CellQuantizers | FusedQuantizers):
        self.w_ih = getattr(module, f"weight_ih_l{suffix}")
        self.w_hh = getattr(module, f"weight_hh_l{suffix}")
        self.b_ih = getattr(module, f"bias_ih_l{suffix}") if module.bias else None
        self.b_hh = getattr(module, f"bias_hh_l{suffix}") if module.bias else None
        self.w_hr = getattr(module, f"weight_hr_l{suffix}", None)
        self.q = quantizers


def run_direction(
    kind: str,
    p: DirectionWeights,
    x: torch.Tensor,
    state: tuple[torch.Tensor, ...],
    reverse: bool,
    lengths: torch.Tensor | None,
    nonlinearity: str = "tanh",
):
    """One layer, one direction over ``x`` (T, N, In). Returns (outputs (T, N, H_out), final state tuple).

    ``lengths`` (N,) marks padded steps (a PackedSequence): a sequence's state does not change past its length
    (so the reverse direction starts at its last real step) and its outputs there are zero.
    """
    q = p.q
    steps = x.size(0)
    valid = None if lengths is None else torch.arange(steps, device=x.device).unsqueeze(1) < lengths.unsqueeze(0)
    project: Callable[[int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
    w_hr = None
    if isinstance(q, FusedQuantizers):  # [x_t | h] per step, one range (pytorch-quantization's fused GEMM)
        fw_ih, fw_hh = fused_weights(q, p.w_ih, p.w_hh)

        def fused_step(t: int, h: torch.Tensor, rows: torch.Tensor | None):
            xq, hq = fused_inputs(q, x[t], h, rows)
            return F.linear(xq, fw_ih, p.b_ih), F.linear(hq, fw_hh, p.b_hh)

        project = fused_step

    else:
        gx = F.linear(quantize_rows(q.ih.input_quantizer, x, valid), q.ih.weight_quantizer(p.w_ih), p.b_ih)
        w_hh = q.hh.weight_quantizer(p.w_hh)
        w_hr = q.hr.weight_quantizer(p.w_hr) if p.w_hr is not None else None
        hh_in = q.hh.input_quantizer

        def split_step(t: int, h: torch.Tensor, rows: torch.Tensor | None):
            return gx[t], F.linear(quantize_rows(hh_in, h, rows), w_hh, p.b_hh)

        project = split_step

    outs: list[torch.Tensor] = [x.new_empty(0)] * steps
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        rows = None if valid is None else valid[t]
        h = state[0]
        gx_t, gh = project(t, h, rows)
        if kind == "LSTM":
            h_new, c_new = lstm_gates_to_state(gx_t + gh, state[1])
            if w_hr is not None and isinstance(q, CellQuantizers):
                h_new = F.linear(quantize_rows(q.hr.input_quantizer, h_new, rows), w_hr)
            new: tuple[torch.Tensor, ...] = (h_new, c_new)
        elif kind == "GRU":
            new = (gru_step(gx_t, gh, h),)
        else:
            new = (RNN_ACTIVATIONS[nonlinearity](gx_t + gh),)
        if rows is not None:
            keep = rows.unsqueeze(-1)
            new = tuple(torch.where(keep, n, s) for n, s in zip(new, state))
            outs[t] = torch.where(keep, new[0], torch.zeros_like(new[0]))
        else:
            outs[t] = new[0]
        state = new
    return torch.stack(outs), state
