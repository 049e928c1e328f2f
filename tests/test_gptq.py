"""GPTQ: the solver against a plain column-by-column reference, and the ``{"method": "gptq"}`` algorithm on models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms.gptq_solver import gptq_quantize, grid_for, hessian_factor
from modelopt_lite.conversion import QuantConfigError
from modelopt_lite.descriptor import ScaledQuantDescriptor as Desc
from modelopt_lite.functional.scales import scale_from_amax


# --- the reference: one column at a time, inverse-Hessian downdates (the OBS form, no Cholesky, no lazy blocks) ----
def reference_gptq(w, h, *, bits, col_group, per_row, perc_damp, desc_act, clip_search=False):
    """Codes and per-(row, column) scales of GPTQ on ``w`` with Hessian ``h`` (float64 throughout; a column's values
    are rounded to float32 only to be quantized). ``col_group``: columns sharing a scale (None: all columns, the
    scale from the original weight); ``per_row``: one scale per row (else one for all rows)."""
    bound, qmin, qmax = 2 ** (bits - 1) - 1, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    w0 = w.double()
    W = w0.clone()
    H = h.double().clone()
    n = H.shape[0]
    dead = H.diagonal() == 0
    H[dead, :] = 0
    H[:, dead] = 0
    H[dead, dead] = 1
    W[:, dead] = 0
    order = torch.argsort(H.diagonal(), descending=True, stable=True).tolist() if desc_act else list(range(n))
    d = H.diagonal().clone()
    H += perc_damp * H.diagonal().mean() * torch.eye(n, dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    codes = torch.zeros_like(W)
    scales = torch.zeros_like(W, dtype=torch.float32)
    group_scale = {}

    def amax_of(vals):
        a = vals.abs().amax(1) if per_row else vals.abs().amax().expand(vals.shape[0])
        return a.float()

    def scale_of(vals, cols):
        amax = amax_of(vals)
        if not clip_search:
            return scale_from_amax(amax, bound)
        best, best_err = None, None
        for k in range(17):  # shrink the range by 2.5 % steps; keep the first of equal errors
            cand = amax * (1.0 - 0.025 * k) if k else amax
            s = scale_from_amax(cand, bound)
            safe = torch.where(s == 0, torch.ones_like(s), s)
            qv = torch.clamp(torch.round(vals.float() / safe[:, None]), qmin, qmax) * s[:, None]
            e = (((vals - qv.double()) ** 2) * d[cols]).sum(1)
            e = e if per_row else e.sum().expand(vals.shape[0])
            if best is None:
                best, best_err = s, e
            else:
                better = e < best_err
                best, best_err = torch.where(better, s, best), torch.where(better, e, best_err)
        return best

    if col_group is None:
        group_scale[0] = scale_of(w0, list(range(n)))
    remaining = list(order)
    for c in order:
        g = 0 if col_group is None else c // col_group
        if g not in group_scale:
            cols = [k for k in range(g * col_group, min((g + 1) * col_group, n))]
            group_scale[g] = scale_of(W[:, cols], cols)
        s = group_scale[g]
        safe = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.clamp(torch.round(W[:, c].float() / safe), qmin, qmax)
        q = torch.where(s == 0, torch.zeros_like(q), q)
        codes[:, c] = q.double()
        scales[:, c] = s
        err = (W[:, c] - (q * s).double()) / Hinv[c, c]
        remaining.remove(c)
        W[:, remaining] -= err[:, None] * Hinv[c, remaining][None, :]
        Hinv = Hinv - Hinv[:, c : c + 1] @ Hinv[c : c + 1, :] / Hinv[c, c]
    return codes, scales


def _problem(seed=0, out=6, n=16, tokens=40, dead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g, dtype=torch.float64) * torch.rand(n, generator=g, dtype=torch.float64) * 3
    x[:, list(dead)] = 0
    w = torch.randn(out, n, generator=g) * 0.1
    return w, x.T @ x / tokens


CASES = [
    # (descriptor, col_group, per_row)
    (Desc(num_bits=4, axis=0), None, True),
    (Desc(num_bits=4, block_sizes={-1: 4}), 4, True),
    (Desc(num_bits=3, block_sizes={1: 5}), 5, True),  # a partial last block
    (Desc(num_bits=8, axis=None), None, False),
]


@pytest.mark.parametrize("clip_search", [False, True])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("block_size", [16, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_solver_equals_column_by_column_reference(case, block_size, desc_act, clip_search):
    desc, col_group, per_row = CASES[case]
    w, h = _problem(seed=case)
    grid = grid_for(desc, tuple(w.shape), "layer")
    q, amax = gptq_quantize(
        w, h, grid, block_size=block_size, perc_damp=0.05, desc_act=desc_act, clip_search=clip_search
    )
    assert q.dtype == torch.float32 and q.shape == w.shape and amax.dtype == torch.float32
    codes, scales = reference_gptq(
        w,
        h,
        bits=desc.num_bits,
        col_group=col_group,
        per_row=per_row,
        perc_damp=0.05,
        desc_act=desc_act,
        clip_search=clip_search,
    )
    assert torch.equal(q, (codes * scales.double()).float())
    assert torch.equal(torch.round(q / scales), codes.float())
    # the stored amax reproduces the result exactly through the quantizer's own numerics
    tq = mtq.TensorQuantizer(desc)
    tq.amax = amax
    assert torch.equal(tq(q), q)


def test_act_order_processes_the_most_active_inputs_first():
    w, h = _problem(seed=7)
    grid = grid_for(Desc(num_bits=4, block_sizes={-1: 4}), tuple(w.shape), "layer")
    _, perm, _, _ = hessian_factor(h, 0.01, True)
    assert perm.tolist() == torch.argsort(h.diagonal(), descending=True, stable=True).tolist()
    assert perm.tolist() != list(range(16))
    q_plain, _ = gptq_quantize(w, h, grid, perc_damp=0.01)
    q_act, _ = gptq_quantize(w, h, grid, perc_damp=0.01, desc_act=True)
    assert not torch.equal(q_plain, q_act)
    codes, scales = reference_gptq(w, h, bits=4, col_group=4, per_row=True, perc_damp=0.01, desc_act=True)
    assert torch.equal(q_act, (codes * scales.double()).float())


def test_damping_is_relative_to_the_mean_diagonal():
    w, h = _problem(seed=3, tokens=5)  # 5 tokens, 16 inputs: a singular Hessian, only damping makes it invertible
    grid = grid_for(Desc(num_bits=4, axis=0), tuple(w.shape), "layer")
    for damp in (0.01, 1.0):
        q, _ = gptq_quantize(w, h, grid, perc_damp=damp)
        codes, scales = reference_gptq(w, h, bits=4, col_group=None, per_row=True, perc_damp=damp, desc_act=False)
        assert torch.equal(q, (codes * scales.double()).float())
        q_scaled, _ = gptq_quantize(w, h * 1000.0, grid, perc_damp=damp)  # a scaled Hessian: the same problem
        assert torch.equal(q, q_scaled)
    assert not torch.equal(gptq_quantize(w, h, grid, perc_damp=0.01)[0], gptq_quantize(w, h, grid, perc_damp=1.0)[0])


def test_dead_columns_become_zero():
    w, h = _problem(seed=5, dead=(0, 5, 6))
    assert float(h.diagonal()[5]) == 0.0
    grid = grid_for(Desc(num_bits=4, block_sizes={-1: 4}), tuple(w.shape), "layer")
    q, _ = gptq_quantize(w, h, grid, perc_damp=0.01, desc_act=True)
    assert torch.equal(q[:, [0, 5, 6]], torch.zeros(6, 3))
    codes, scales = reference_gptq(w, h, bits=4, col_group=4, per_row=True, perc_damp=0.01, desc_act=True)
    assert torch.equal(q, (codes * scales.double()).float())


def test_unsupported_grids_name_the_layer_and_setting():
    with pytest.raises(ValueError, match=r"gptq: enc\.fc: the weight quantizer is dynamic"):
        grid_for(Desc(num_bits=4, axis=0, dynamic=True), (4, 8), "enc.fc")
    with pytest.raises(ValueError, match=r"gptq: enc\.fc: double-quantized block scales \(scale_bits=8\)"):
        grid_for(Desc(num_bits=4, block_sizes={-1: 4, "scale_bits": 8}), (4, 8), "enc.fc")
    with pytest.raises(ValueError, match=r"gptq: enc\.fc: needs a 2-D weight"):
        grid_for(Desc(num_bits=4, axis=0), (4, 8, 3), "enc.fc")
    w, h = _problem()
    with pytest.raises(ValueError, match=r"gptq: layer: the weight contains NaN or Inf"):
        gptq_quantize(w.clone().fill_(float("nan")), h, grid_for(Desc(num_bits=4, axis=0), (6, 16), "x"), label="layer")


# --- the algorithm on models -----------------------------------------------------------------------------------------
class Attn(nn.Module):
    """q/k/v read one tensor (one GPTQ group), then an output projection and a 2-layer MLP."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.up = nn.Linear(d, 64)
        self.down = nn.Linear(64, d)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 4.0, -1) @ self.v(x)
        h = x + self.o(a)
        return h + self.down(torch.relu(self.up(h)))


def _batches(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 10, 32, generator=g) for _ in range(n)]


def _cfg(**params):
    w = {"num_bits": 4, "block_sizes": {-1: 16}, "axis": None, "enable": True}
    return {
        "quant_cfg": {"default": {"enable": False}, "*weight_quantizer": w, "*input_quantizer": {"enable": False}},
        "algorithm": {"method": "gptq", **params},
    }


def _model(seed=0):
    torch.manual_seed(seed)
    return Attn().eval()


def _loop(batches, calls=None):
    def loop(m):
        if calls is not None:
            calls.append(1)
        for b in batches:
            m(b)

    return loop


def test_model_weights_are_their_own_fake_quant_and_sequential():
    batches = _batches()
    float_model = _model()
    calls: list = []
    q = mtq.quantize(copy.deepcopy(float_model), _cfg(perc_damp=0.02), _loop(batches, calls))
    assert len(calls) == 1 + 4  # max calibration, then one (whole-model) pass per group: qkv, o, up, down
    rtn = mtq.quantize(copy.deepcopy(float_model), {**_cfg(), "algorithm": "max"}, _loop(batches))
    for name in ("q", "k", "v", "o", "up", "down"):
        m = getattr(q, name)
        assert m.weight_quantizer.amax.shape == (m.weight.shape[0], m.weight.shape[1] // 16)
        assert torch.equal(m.weight_quantizer(m.weight), m.weight)
        assert not torch.equal(m.weight, getattr(rtn, name).weight_quantizer(getattr(rtn, name).weight))
    # the last layer's Hessian comes from the already quantized layers before it
    with torch.no_grad():
        x = torch.cat([b.reshape(-1, 32) for b in batches])
        hs = []
        for b in batches:
            a = torch.softmax(q.q(b) @ q.k(b).transpose(-1, -2) / 4.0, -1) @ q.v(b)
            hs.append(torch.relu(q.up(b + q.o(a))).reshape(-1, 64).double())
    xd = torch.cat(hs)
    h = xd.T @ xd / xd.shape[0]
    grid = grid_for(q.down.weight_quantizer.quant_desc, (32, 64), "down")
    want, amax = gptq_quantize(float_model.down.weight, h, grid, perc_damp=0.02)
    assert torch.equal(q.down.weight, want) and torch.equal(q.down.weight_quantizer.amax, amax)
    assert x.shape[0] == 120


def test_qkv_share_one_hessian_and_every_pass_runs_the_whole_model():
    batches = _batches()
    model = _model()
    seen = {"down": 0}
    model.down.register_forward_pre_hook(lambda *_: seen.__setitem__("down", seen["down"] + 1))
    outs: list = []
    calls: list = []

    def loop(m):
        calls.append(1)
        for b in batches:
            outs.append(m(b))

    mtq.quantize(model, _cfg(), loop)
    assert len(calls) == 1 + 4  # the calibration pass, then one pass per group: qkv (one), o, up, down
    assert seen["down"] == 4 * len(calls)  # no pass ends early: every forward reaches the last layer
    assert [type(o) for o in outs] == [torch.Tensor] * 4 * len(calls)
    assert all(o.shape == (3, 10, 32) and o.dtype == torch.float32 for o in outs)
    assert "forward" not in vars(model)  # the per-forward wrapper is gone


def test_act_order_on_a_model_changes_the_result():
    batches = _batches()
    a = mtq.quantize(_model(), _cfg(), _loop(batches))
    b = mtq.quantize(_model(), _cfg(desc_act=True), _loop(batches))
    assert not torch.equal(a.up.weight, b.up.weight)
    assert torch.equal(b.up.weight_quantizer(b.up.weight), b.up.weight)


def test_failure_restores_weights_and_quantizers():
    batches = _batches()
    model = _model()
    before = copy.deepcopy(model.state_dict())
    calls: list = []

    def loop(m):
        calls.append(1)
        if len(calls) == 3:  # after the qkv group was written
            raise RuntimeError("loader died")
        for b in batches:
            m(b)

    with pytest.raises(RuntimeError, match="loader died"):
        mtq.quantize(model, _cfg(), loop)
    assert type(model.q) is nn.Linear and "forward" not in vars(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    # an already quantized model: its weights and quantizer amaxes come back too
    q = mtq.quantize(_model(), {**_cfg(), "algorithm": "max"}, _loop(batches))
    state = copy.deepcopy(q.state_dict())
    calls.clear()
    with pytest.raises(RuntimeError, match="loader died"):
        mtq.quantize(q, _cfg(), loop)
    after = q.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


@pytest.mark.parametrize(
    ("params", "err", "match"),
    [
        ({"perc_damp": 0}, QuantConfigError, r"perc_damp must be a number in \(0, 1\], got 0"),
        ({"perc_damp": 1.5}, QuantConfigError, r"perc_damp must be a number in \(0, 1\], got 1\.5"),
        ({"perc_damp": "x"}, QuantConfigError, r"perc_damp must be a number in \(0, 1\], got 'x'"),
        ({"block_size": 0}, QuantConfigError, r"block_size must be a positive int, got 0"),
        ({"block_size": 2.5}, QuantConfigError, r"block_size must be a positive int, got 2\.5"),
        ({"desc_act": "yes"}, QuantConfigError, r"desc_act must be a bool, got 'yes'"),
        ({"clip_search": 1}, QuantConfigError, r"clip_search must be a bool, got 1"),
        ({"act_order": True}, QuantConfigError, r"unknown parameter\(s\) \['act_order'\]"),
    ],
)
def test_config_validation_names_the_bad_value(params, err, match):
    model = _model()
    with pytest.raises(err, match=match):
        mtq.quantize(model, _cfg(**params), _loop(_batches(1)))
    assert type(model.q) is nn.Linear


def test_dynamic_weight_quantizer_is_refused_before_any_pass():
    cfg = _cfg()
    cfg["quant_cfg"]["*weight_quantizer"] = {"num_bits": 4, "axis": 0, "dynamic": True, "enable": True}
    calls: list = []
    with pytest.raises(ValueError, match=r"gptq: q: the weight quantizer is dynamic"):
        mtq.quantize(_model(), cfg, _loop(_batches(1), calls))
    assert calls == []


class Stack(nn.Module):
    """Two Attn blocks, in an nn.ModuleList (GPTQ replays a block from its recorded inputs) or an nn.Sequential (no
    replay: every group runs the whole model)."""

    def __init__(self, replay: bool):
        super().__init__()
        torch.manual_seed(0)
        blocks = [Attn(), Attn()]
        self.blocks = nn.ModuleList(blocks) if replay else nn.Sequential(*blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_block_replay_gives_the_whole_model_result_with_fewer_passes():
    batches = _batches()
    calls_replay: list = []
    calls_plain: list = []
    a = mtq.quantize(Stack(True).eval(), _cfg(desc_act=True), _loop(batches, calls_replay))
    b = mtq.quantize(Stack(False).eval(), _cfg(desc_act=True), _loop(batches, calls_plain))
    # Sequential: one loop pass per group; ModuleList: one for the chain (block 1's inputs are block 0's outputs)
    assert len(calls_plain) == 1 + 8 and len(calls_replay) == 1 + 1
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(a.blocks[1].down.weight, Stack(True).blocks[1].down.weight)


def test_clip_search_shrinks_ranges_where_that_lowers_the_weighted_error():
    w, h = _problem(seed=2, out=8, n=32, tokens=200)
    w[:, 3] *= 8.0  # an outlier column with a tiny Hessian weight: clipping it costs little
    h[3, :] *= 1e-4
    h[:, 3] *= 1e-4
    grid = grid_for(Desc(num_bits=4, block_sizes={-1: 8}), tuple(w.shape), "layer")
    _, plain = gptq_quantize(w, h, grid)
    q, searched = gptq_quantize(w, h, grid, clip_search=True)
    # the first block's scales come from the same (original) values in both runs; later ones from compensated values
    assert bool((searched[:, 0] <= plain[:, 0]).all()) and bool((searched[:, 0] < plain[:, 0]).any())
    tq = mtq.TensorQuantizer(Desc(num_bits=4, block_sizes={-1: 8}))
    tq.amax = searched
    assert torch.equal(tq(q), q)
