"""AWQ (awq_lite / awq_clip / awq_full): the searches against straightforward references on small layers, folding,
restoration on failure, config validation, presets."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms.awq_search import alpha_grid, clip_ratios
from modelopt_lite.conversion import QuantConfigError
from modelopt_lite.nn import SequentialQuantizer
from modelopt_lite.tensor_quant import fake_block_quant

BS = 16


def _cfg(method, **params):
    w = {"num_bits": 4, "block_sizes": {-1: BS}, "axis": None, "enable": True}
    return {
        "quant_cfg": {"default": {"enable": False}, "*weight_quantizer": w},
        "algorithm": {"method": method, **({} if method == "max" else {"progress": False}), **params},
    }


def _data(cin=48, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    col = torch.rand(cin, generator=g) * 3 + 0.05
    col[3] *= 20  # an outlier channel: what AWQ protects
    return [torch.randn(5, 7, cin, generator=g) * col for _ in range(n)]


def _loop(batches):
    def loop(m):
        for x in batches:
            m(x)

    return loop


def _linear(cin=48, cout=24, seed=1):
    torch.manual_seed(seed)
    return nn.Linear(cin, cout)


# --- references ------------------------------------------------------------------------------------------------------
def _ref_scale(x, w, alpha):
    """The AWQ scale of one alpha, from the formula (mean |x| per channel; |W| over its block max, mean over rows)."""
    act = x.abs().mean(0)
    wb = w.abs().reshape(w.shape[0], -1, BS)
    wmag = (wb / wb.amax(-1, keepdim=True)).reshape(w.shape).mean(0)
    s = (act.pow(alpha) / wmag.pow(1 - alpha)).clamp(1e-4, 1e4)
    return s / (s.max() * s.min()).sqrt()


def _ref_error(x, w, b, s):
    """Measured summed squared output error of the layer run with scale ``s`` (None: plain round-to-nearest)."""
    y = x @ w.T + b
    if s is None:
        yq = x @ fake_block_quant(w, {-1: BS}, None, 4).T + b
    else:
        yq = (x / s) @ fake_block_quant(w * s, {-1: BS}, None, 4).T + b
    return float(((yq.double() - y.double()) ** 2).sum())


def test_lite_picks_the_grid_point_with_least_measured_error():
    batches = _data()
    lin = _linear()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in batches])
    q = mtq.quantize(lin, _cfg("awq_lite", alpha_step=0.25, debug=True), _loop(batches))
    rec = q.awq_lite
    assert list(rec.loss) == [None, 0.0, 0.25, 0.5, 0.75, 1.0]
    errors = {a: _ref_error(x, w, b, None if a is None else _ref_scale(x, w, a)) for a in rec.loss}
    for a, e in errors.items():  # the Gram-matrix scores are the measured errors (mean per output)
        assert rec.loss[a] == pytest.approx(e / (x.shape[0] * w.shape[0]), rel=1e-3)
    best = min(errors, key=errors.get)
    assert rec.best_alpha == best and best is not None  # an outlier channel: some alpha beats RTN here
    s = _ref_scale(x, w, best)
    torch.testing.assert_close(rec.scale, s, rtol=1e-5, atol=0)
    torch.testing.assert_close(q.weight.detach(), w * s, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.input_quantizer.pre_quant_scale, 1 / s, rtol=1e-6, atol=0)
    with torch.no_grad():  # the quantized layer now has exactly the best measured error
        got = float(((q(x).double() - (x @ w.T + b).double()) ** 2).sum())
    assert got == pytest.approx(errors[best], rel=1e-4)


def test_lite_keeps_the_weight_when_no_alpha_helps():
    batches = [torch.ones(4, 48)]  # equal channels: a scale only moves the rounding around
    lin = nn.Linear(48, 8)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(48 * 8, dtype=torch.float32).reshape(8, 48) % 7 - 3)
    w = lin.weight.detach().clone()
    q = mtq.quantize(lin, _cfg("awq_lite", debug=True), _loop(batches))
    assert q.awq_lite.best_alpha is None and q.awq_lite.loss[None] <= min(q.awq_lite.loss.values())
    assert torch.equal(q.weight.detach(), w) and q.input_quantizer.pre_quant_scale is None


def _ref_clip(x, w):
    """Per block, the ratio with least error of the block's partial outputs (1.0 first, strict improvement)."""
    cout, cin = w.shape
    nb = cin // BS
    amax0 = w.abs().reshape(cout, nb, BS).amax(-1)
    best = torch.ones(cout, nb)
    best_err = torch.full((cout, nb), float("inf"), dtype=torch.float64)
    for r in clip_ratios(0.5, 0.05):
        d = (fake_block_quant(w, {-1: BS}, amax0 * r, 4) - w).reshape(cout, nb, BS)
        xb = x.reshape(-1, nb, BS)
        err = torch.einsum("tbi,obi->tob", xb.double(), d.double()).pow(2).sum(0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, r), best)
    return best, amax0


def test_clip_picks_the_ratio_with_least_block_error():
    batches = _data(seed=3)
    lin = _linear(seed=4)
    w = lin.weight.detach().clone()
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in batches])
    q = mtq.quantize(lin, _cfg("awq_clip", debug=True), _loop(batches))
    ratio, amax0 = _ref_clip(x, w)
    assert torch.equal(q.awq_clip.ratio, ratio)
    assert (ratio < 1).any()  # the search does clip somewhere
    torch.testing.assert_close(q.weight_quantizer.amax, amax0 * ratio, rtol=0, atol=0)
    assert torch.equal(q.weight.detach(), w)  # clip alone never touches the weight


def test_full_clips_the_scaled_weight():
    batches = _data(seed=5)
    lin = _linear(seed=6)
    w = lin.weight.detach().clone()
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in batches])
    q = mtq.quantize(lin, _cfg("awq_full", debug=True), _loop(batches))
    s = q.awq_lite.scale
    ratio, amax0 = _ref_clip(x / s, w * s)
    assert torch.equal(q.awq_clip.ratio, ratio)
    torch.testing.assert_close(q.weight_quantizer.amax, amax0 * ratio, rtol=1e-6, atol=0)


class _Block(nn.Module):
    """ln feeds only q and k (foldable); ln2 feeds fc and a residual add (not foldable)."""

    def __init__(self):
        super().__init__()
        self.ln, self.ln2 = nn.LayerNorm(48), nn.LayerNorm(32)
        self.q, self.k, self.o, self.fc = nn.Linear(48, 32), nn.Linear(48, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        with torch.no_grad():
            for m in (self.ln, self.ln2):
                m.weight.uniform_(0.2, 3.0)
                m.bias.uniform_(-1, 1)

    def forward(self, x):
        h = self.ln(x)
        a = self.o(torch.tanh(self.q(h)) * self.k(h))
        h2 = self.ln2(a)
        return self.fc(h2) + h2


def test_scales_fold_into_a_norm_that_feeds_only_the_scaled_layers():
    torch.manual_seed(0)
    model = _Block()
    batches = _data(cin=48, seed=7)
    with torch.no_grad():
        ref = torch.cat([model(x) for x in batches])
    q = mtq.quantize(copy.deepcopy(model), _cfg("awq_lite", debug=True), _loop(batches))
    assert q.q.awq_lite.folded_into == "ln" and q.k.awq_lite.folded_into == "ln"
    assert q.q.input_quantizer.pre_quant_scale is None and q.k.input_quantizer.pre_quant_scale is None
    assert q.q.awq_lite.best_alpha == q.k.awq_lite.best_alpha  # one shared scale
    assert q.fc.awq_lite.folded_into in ("pre_quant_scale", "")  # ln2 also feeds the residual
    assert q.o.awq_lite.folded_into in ("pre_quant_scale", "")  # tanh(q) * k: not a foldable producer
    for _, tq in mtq.conversion.named_quantizers(q):
        tq.disable()
    with torch.no_grad():  # the scaling itself is exact in float (pre_quant_scale still applies when disabled)
        got = torch.cat([q(x) for x in batches])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weights_and_quantizers_restored_when_the_loop_raises():
    torch.manual_seed(0)
    model = _Block()
    batches = _data(cin=48, seed=8)
    mtq.quantize(model, _cfg("max"), _loop(batches))  # already quantized: amax values to restore
    before = _state(model)
    calls = {"n": 0, "scaled": 0}

    def loop(m):
        calls["n"] += 1
        if not torch.equal(m.q.weight, before["q.weight"]):  # the calibration after the search: weights scaled
            calls["scaled"] += 1
            raise RuntimeError("boom")
        for x in batches:
            m(x)

    cfg = _cfg("awq_full")
    cfg["quant_cfg"]["*input_quantizer"] = {"num_bits": 8, "axis": None, "enable": True}  # needs the loop again
    with pytest.raises(RuntimeError, match="boom"):
        mtq.quantize(model, cfg, loop)
    assert calls["scaled"] == 1 and calls["n"] == 5  # the probe, one pass per unit ([q, k], [o], [fc]), boom
    after = _state(model)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
    assert all(m.input_quantizer.pre_quant_scale is None for m in (model.q, model.k, model.o, model.fc))
    assert not model.q.input_quantizer.is_enabled


@pytest.mark.parametrize(
    ("method", "params", "match"),
    [
        ("awq_lite", {"alpha_step": 0}, r"alpha_step must be in \(0, 1\], got 0.0"),
        ("awq_lite", {"alpha_step": 1.5}, r"alpha_step must be in \(0, 1\], got 1.5"),
        ("awq_lite", {"alpha_step": "x"}, r"alpha_step must be a number, got str 'x'"),
        ("awq_lite", {"shrink_step": 0.1}, r"algorithm 'awq_lite' got unknown parameter\(s\) \['shrink_step'\]"),
        ("awq_clip", {"min_clip_ratio": 1.0}, r"min_clip_ratio must be in \(0, 1\), got 1.0"),
        ("awq_clip", {"max_co_batch_size": 0}, r"max_co_batch_size must be an integer >= 1, got 0"),
        ("awq_clip", {"max_tokens_per_batch": 2.5}, r"max_tokens_per_batch must be an integer >= 1 or None"),
        ("awq_full", {"debug": 1}, r"debug must be True or False, got 1"),
    ],
)
def test_bad_parameters_are_named_before_anything_runs(method, params, match):
    lin = nn.Linear(32, 8)
    w = lin.weight.detach().clone()
    ran = []
    with pytest.raises(QuantConfigError, match=match):
        mtq.quantize(lin, _cfg(method, **params), lambda m: ran.append(1))
    assert ran == [] and torch.equal(lin.weight.detach(), w)


def test_blocks_along_another_axis_are_refused():
    cfg = _cfg("awq_lite")
    cfg["quant_cfg"]["*weight_quantizer"]["block_sizes"] = {0: 4}
    with pytest.raises(ValueError, match=r"awq: .*blocks must run along the input axis \(-1 or 1\) only"):
        mtq.quantize(nn.Linear(32, 8), cfg, _loop([torch.randn(3, 32)]))


def test_grids():
    assert alpha_grid(0.1) == [round(0.1 * k, 10) for k in range(11)]
    assert alpha_grid(0.3) == [0.0, 0.3, 0.6, 0.9]
    assert clip_ratios(0.5, 0.1) == [1.0, 0.5, 0.6, 0.7, 0.8, 0.9]


def test_presets_and_w4a8_sequential_weight():
    assert mtq.conversion.PRESETS["INT4_AWQ_CFG"] is mtq.INT4_AWQ_CFG
    assert mtq.INT4_AWQ_CFG["algorithm"] == {"method": "awq_lite", "alpha_step": 0.1}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 16))
    batches = [t.reshape(-1, 256) for t in _data(cin=256, n=3, seed=9)]
    q = mtq.quantize(model, mtq.W4A8_AWQ_BETA_CFG, _loop(batches))
    wq = q[0].weight_quantizer
    assert isinstance(wq, SequentialQuantizer) and wq[0].amax.shape == (64, 2) and wq[1].amax.shape == ()
    assert q[0].input_quantizer.is_enabled and q[0].input_quantizer.amax is not None
    assert q[0].input_quantizer.pre_quant_scale is not None  # ReLU and the input: nothing to fold into
    with torch.no_grad():
        assert torch.isfinite(q(batches[0])).all()


def test_matches_modelopt_content():
    peer = pytest.importorskip("modelopt.torch.quantization")
    assert peer.INT4_AWQ_CFG["algorithm"] == mtq.INT4_AWQ_CFG["algorithm"]
    entry = next(e for e in peer.INT4_AWQ_CFG["quant_cfg"] if e["quantizer_name"] == "*weight_quantizer")
    assert entry["cfg"]["num_bits"] == 4 and entry["cfg"]["block_sizes"] == {-1: 128, "type": "static"}
