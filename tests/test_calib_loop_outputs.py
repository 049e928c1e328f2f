"""A user's calibration loop sees what the model returns (issue 23, section 5): in every pass of every registered
algorithm and calibration method, each call of the model returns its real output (here a Hugging-Face-like output
object, a tuple or a tensor), and every call of the loop runs to its end (no pass is cut short behind the loop's
back). The model has a chain of blocks in an ``nn.ModuleList``, so GPTQ's and AWQ's block replays are exercised."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms.auto_quantize import auto_quantize
from modelopt_lite.conversion.algorithm_registry import ALGORITHMS
from modelopt_lite.conversion.config import CALIB_METHODS, normalize_algorithm

D, CIN, ROWS, TOKENS = 16, 8, 2, 6


@dataclass
class Out:
    """What a Hugging Face encoder returns, in miniature."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor


class Block(nn.Module):
    def __init__(self, f: int):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, f), nn.Linear(f, D)

    def forward(self, x, mask):
        h = self.ln(x)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2) / 4.0 + mask, -1) @ self.v(h)
        x = x + self.o(a)
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """A Linear, a chain of three blocks, a head; ``kind`` picks what forward returns."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.inp = nn.Linear(CIN, D)
        self.layers = nn.ModuleList(Block(f) for f in (32, 48, 32))
        self.head = nn.Linear(D, 4)

    def forward(self, x, mask):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, mask)
        logits = self.head(h)
        if self.kind == "object":
            return Out(h, logits)
        return (logits, h) if self.kind == "tuple" else logits


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, TOKENS, CIN, generator=g) for _ in range(n)]


def _read(kind: str, out) -> torch.Tensor:
    """What a user's loop takes from the output (an AttributeError/TypeError on None, as a user's would raise)."""
    if kind == "object":
        return out.last_hidden_state
    return out[0] if kind == "tuple" else out


class Loop:
    """A forward loop that uses the model's output (a loss, a pooled embedding) and counts its passes."""

    def __init__(self, kind: str):
        self.kind, self.batches = kind, _batches()
        self.mask = torch.zeros(TOKENS, TOKENS)
        self.mask[:, -1] = -1e4
        self.started = self.finished = 0
        self.values: list[torch.Tensor] = []

    def __call__(self, model):
        self.started += 1
        total = torch.zeros(())
        for x in self.batches:
            y = _read(self.kind, model(x, self.mask))
            assert isinstance(y, torch.Tensor), type(y)
            assert y.shape == (ROWS, TOKENS, D if self.kind == "object" else 4) and y.dtype == torch.float32
            total = total + y.float().pow(2).mean()  # a loss / a logged metric
        self.values.append(total)
        self.finished += 1


_W4 = {"num_bits": 4, "block_sizes": {-1: 8}, "axis": None}
_W4_CFG = {"default": {"enable": False}, "*weight_quantizer": _W4}
_INT8 = {"num_bits": 8, "axis": None}
_W8A8_CFG = {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": _INT8}

_NV = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
_NVFP4_CFG = {"default": {"enable": False}, "layers.*weight_quantizer": _NV, "layers.*input_quantizer": _NV}

#: one config per registered algorithm and calibration method (test_every_algorithm_is_covered keeps it complete)
CASES = {
    "gptq": (_W4_CFG, {"method": "gptq"}),
    "gptq_float_target": (_W4_CFG, {"method": "gptq", "float_target": True, "desc_act": True}),
    "awq_lite": (_W4_CFG, {"method": "awq_lite", "progress": False}),
    "awq_clip": (_W4_CFG, {"method": "awq_clip", "progress": False}),
    "awq_full": ({**_W4_CFG, "*input_quantizer": _INT8}, {"method": "awq_full", "progress": False}),
    "smoothquant": (_W8A8_CFG, {"method": "smoothquant", "alpha": 0.5}),
    "svdquant": (_W4_CFG, {"method": "svdquant", "lowrank": 2, "progress": False}),
    "sequence": (_W4_CFG, ["awq_lite", {"method": "gptq"}, "max"]),
    "weight_mse": (_W8A8_CFG, {"method": "mse", "step_size": 0.5}),
    "local_hessian": (_W8A8_CFG, {"method": "local_hessian", "fp8_scale_sweep": False, "block_size": 8}),
    "nvfp4_act_headroom": (_NVFP4_CFG, {"method": "nvfp4_act_headroom"}),
    "lsq": (_W8A8_CFG, {"method": "lsq", "scale_algorithm": {"method": "local_hessian", "fp8_scale_sweep": False}}),
    "layerwise": (_W4_CFG, {"method": "gptq", "layerwise": {"enable": True}}),
    "max_layerwise_qdq": (
        _W8A8_CFG,
        {"method": "max", "layerwise": {"enable": True, "get_qdq_activations_from_prev_layer": True}},
    ),
    **{m: (_W8A8_CFG, m) for m in CALIB_METHODS},
}


def test_every_algorithm_is_covered():
    names = {normalize_algorithm(c[1])[0] for c in CASES.values()}
    assert set(ALGORITHMS) | set(CALIB_METHODS) <= names


_KINDS = [("object", c) for c in sorted(CASES)] + [(k, c) for k in ("tuple", "tensor") for c in ("gptq", "awq_full")]


@pytest.mark.parametrize(("kind", "case"), _KINDS)
def test_the_loop_sees_real_outputs_in_every_pass(case, kind):
    cfg, algorithm = CASES[case]
    model = Net(kind).eval()
    loop = Loop(kind)
    before = copy.deepcopy(model.state_dict())
    q = mtq.quantize(model, {"quant_cfg": cfg, "algorithm": algorithm}, loop)
    assert loop.started >= 1 and loop.finished == loop.started  # every pass ran the loop to its end
    assert len(loop.values) == loop.started and all(bool(torch.isfinite(v)) for v in loop.values)
    assert "forward" not in vars(q)  # no wrapper left on the model
    if case.startswith(
        ("gptq", "awq_lite", "awq_full", "sequence", "smoothquant", "svdquant", "layerwise")
    ):  # the algorithm changed weights
        assert not torch.equal(q.layers[1].up.weight, before["layers.1.up.weight"])


def test_gptq_on_a_chain_costs_one_pass_and_equals_a_model_without_replays():
    """The chain of blocks costs one pass of the loop (each later block's inputs come from the previous block), and
    the weights are those of a model whose blocks are an nn.Sequential (one full pass of the loop per group)."""

    class Seq(Net):
        def __init__(self):
            super().__init__("tensor")
            self.layers = nn.Sequential(*self.layers)  # type: ignore[assignment]

        def forward(self, x, mask):
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h, mask)
            return self.head(h)

    cfg = {"quant_cfg": _W4_CFG, "algorithm": {"method": "gptq"}}
    chain, plain = Loop("tensor"), Loop("tensor")
    a = mtq.quantize(Net("tensor").eval(), cfg, chain)
    b = mtq.quantize(Seq().eval(), cfg, plain)
    assert chain.finished == 1 + 3  # max calibration, "inp", the chain (block 0; blocks 1 and 2 follow), "head"
    assert plain.finished == 1 + 1 + 3 * 4 + 1  # one pass per group: inp, (qkv, o, up, down) x 3, head
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_auto_quantize_forward_step_sees_real_outputs():
    model = Net("object").eval()
    loop = Loop("object")
    batches = [(x, loop.mask) for x in loop.batches]
    seen: list = []

    def forward_step(m, batch):
        y = m(*batch).last_hidden_state
        assert isinstance(y, torch.Tensor) and y.shape == (ROWS, TOKENS, D)
        seen.append(y.shape)
        return y

    auto_quantize(
        model,
        {"effective_bits": 12.0},
        ["INT8_DEFAULT_CFG", "INT8_HISTOGRAM_CFG"],
        batches,
        forward_step,
        lambda out, _b: out.pow(2).mean(),
        num_calib_steps=3,
        num_score_steps=2,
    )
    assert len(seen) >= 3 * 2  # both formats calibrated on every batch, then scored
