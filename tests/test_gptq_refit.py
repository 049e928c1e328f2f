"""GPTQ's refinements (``scale_refit``, ``float_target``) against closed-form references, and a list of algorithms
under ``"algorithm"`` (ModelOpt's sequential form) against the same steps run by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from test_gptq import _batches, _cfg, _loop, _model

import modelopt_lite as mtq
from modelopt_lite.algorithms.gptq_refit import float_target, hessian_error, refine, refit_scales
from modelopt_lite.algorithms.gptq_solver import gptq_quantize, grid_for
from modelopt_lite.conversion import ALGORITHMS, QuantConfigError
from modelopt_lite.conversion.config import normalize_algorithm
from modelopt_lite.descriptor import ScaledQuantDescriptor as Desc
from modelopt_lite.functional.scales import scale_from_amax


def _problem(seed=0, out=5, n=12, tokens=50):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g, dtype=torch.float64) * (
        0.2 + torch.rand(n, generator=g, dtype=torch.float64)
    )
    w = torch.randn(out, n, generator=g) * 0.1
    return w, x, x.T @ x / tokens


def _expand(s, cg, n):
    return s.repeat_interleave(cg, 1)[:, :n]


@pytest.mark.parametrize("cg", [4, 5])  # 5: a partial last block
def test_refit_scales_is_the_closed_form_least_squares(cg):
    w, x, h = _problem()
    grid = grid_for(Desc(num_bits=4, block_sizes={-1: cg}), tuple(w.shape), "w")
    q, amax = gptq_quantize(w, h, grid, block_size=4)
    q2, amax2 = refit_scales(w, q, amax, h, grid)
    s = scale_from_amax(amax, grid.bound).double()
    codes = (q.double() / _expand(s, cg, w.shape[1])).round()
    nb = amax.shape[1]
    for r in range(w.shape[0]):  # min_s ||X (w_r - Z_r s)||^2 by lstsq on the inputs themselves
        z = torch.zeros(w.shape[1], nb, dtype=torch.float64)
        for b in range(nb):
            z[b * cg : (b + 1) * cg, b] = codes[r, b * cg : (b + 1) * cg]
        want = torch.linalg.lstsq(x @ z, x @ w[r].double()).solution
        torch.testing.assert_close(amax2[r].double(), want * grid.bound, rtol=1e-5, atol=0)
    s2 = _expand(scale_from_amax(amax2, grid.bound), cg, w.shape[1])
    assert torch.equal(q2, codes.float() * s2)  # same codes, new scales
    assert torch.equal(grid.fake(q2, s2.contiguous()), q2)  # its own fake quantization
    assert q2.dtype == torch.float32 and amax2.shape == amax.shape
    assert hessian_error(w, q2, h) <= hessian_error(w, q, h)


def test_refit_keeps_a_row_whose_codes_are_all_zero():
    w, _, h = _problem()
    w[2] = 0
    grid = grid_for(Desc(num_bits=4, block_sizes={-1: 4}), tuple(w.shape), "w")
    q, amax = gptq_quantize(w, h, grid, block_size=4)
    q2, amax2 = refit_scales(w, q, amax, h, grid)
    assert torch.equal(amax2[2], amax[2]) and torch.equal(q2[2], torch.zeros(w.shape[1]))


def test_refit_refuses_grids_it_cannot_refit():
    w, _, h = _problem()
    grid = grid_for(Desc(num_bits=8, axis=None), tuple(w.shape), "w")
    q, amax = gptq_quantize(w, h, grid)
    with pytest.raises(ValueError, match="one scale per row"):
        refit_scales(w, q, amax, h, grid)
    assert refine(w, h, grid, q, amax, 3, None) == (q, amax)  # refine leaves such a grid alone


def test_refine_keeps_only_rounds_that_lower_the_error():
    w, _, h = _problem(seed=3, out=8, n=16)
    grid = grid_for(Desc(num_bits=3, block_sizes={-1: 8}), tuple(w.shape), "w")
    q, amax = gptq_quantize(w, h, grid, block_size=8)
    calls = []

    def solve(fixed):
        calls.append(fixed)
        return gptq_quantize(w, h, grid, block_size=8, amax=fixed)

    q3, amax3 = refine(w, h, grid, q, amax, 4, solve)
    assert 1 <= len(calls) <= 4
    assert hessian_error(w, q3, h) <= hessian_error(w, refit_scales(w, q, amax, h, grid)[0], h)
    s3 = _expand(scale_from_amax(amax3, grid.bound), 8, 16).contiguous()
    assert torch.equal(grid.fake(q3, s3), q3)
    # GPTQ with the scales given keeps them
    qf, af = gptq_quantize(w, h, grid, block_size=8, amax=calls[0])
    assert torch.equal(af, calls[0].reshape(af.shape))


def test_float_target_is_the_least_squares_weight():
    w, xq, h = _problem(n=10, tokens=60)
    g = torch.Generator().manual_seed(7)
    xf = xq + 0.05 * torch.randn(xq.shape, generator=g, dtype=torch.float64)
    cross = (xf - xq).T @ xq / xq.shape[0]
    got = float_target(w, h, cross, 0.0)
    want = torch.linalg.lstsq(xq, xf @ w.double().T).solution.T  # min ||X_q W'^T - X_f W^T||
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    assert torch.equal(float_target(w, h, torch.zeros_like(h), 0.01), w.double())  # same inputs: no change


def _down_input(q, batches):
    with torch.no_grad():
        out = []
        for b in batches:
            a = torch.softmax(q.q(b) @ q.k(b).transpose(-1, -2) / 4.0, -1) @ q.v(b)
            out.append(torch.relu(q.up(b + q.o(a))).reshape(-1, 64).double())
    return torch.cat(out)


def test_float_target_on_a_model_fits_the_float_output():
    batches = _batches()
    fm = _model()
    plain = mtq.quantize(copy.deepcopy(fm), _cfg(), _loop(batches))
    q = mtq.quantize(copy.deepcopy(fm), _cfg(float_target=True, scale_refit=2), _loop(batches))
    for name in ("q", "k", "v", "o", "up", "down"):
        m = getattr(q, name)
        assert torch.equal(m.weight_quantizer(m.weight), m.weight)
    # the first group reads the model input (float = quantized): float_target changes nothing there
    q1 = mtq.quantize(copy.deepcopy(fm), _cfg(float_target=True), _loop(batches))
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(q1, name).weight, getattr(plain, name).weight)
    # the last layer: GPTQ on the least-squares weight for the float inputs, by hand
    xq, xf = _down_input(q1, batches), _down_input(fm, batches)
    h, cross = xq.T @ xq / xq.shape[0], (xf - xq).T @ xq / xq.shape[0]
    grid = grid_for(q1.down.weight_quantizer.quant_desc, (32, 64), "down")
    want, amax = gptq_quantize(float_target(fm.down.weight, h, cross, 0.01).float(), h, grid)
    assert torch.equal(q1.down.weight, want) and torch.equal(q1.down.weight_quantizer.amax, amax)
    with torch.no_grad():
        ref = torch.cat([fm(b) for b in batches])
        err_plain = float((torch.cat([plain(b) for b in batches]) - ref).pow(2).mean())
        err_ft = float((torch.cat([q(b) for b in batches]) - ref).pow(2).mean())
    assert err_ft < err_plain


def test_float_target_refuses_a_loop_that_changes_its_data():
    batches = _batches()
    fm = _model()
    state = {"n": 0}

    def loop(m):  # a different number of batches on every call
        state["n"] += 1
        for b in batches[: 1 + state["n"] % 4]:
            m(b)

    q = copy.deepcopy(fm)
    with pytest.raises(ValueError, match="float_target.*same batches"):
        mtq.quantize(q, _cfg(float_target=True), loop)
    assert torch.equal(q.down.weight, fm.down.weight)


@pytest.mark.parametrize(
    "params,match",
    [({"scale_refit": -1}, "scale_refit"), ({"scale_refit": True}, "scale_refit"), ({"float_target": 1}, "float_")],
)
def test_new_parameters_are_validated(params, match):
    with pytest.raises(QuantConfigError, match=match):
        mtq.quantize(_model(), _cfg(**params), _loop(_batches()))


# --- a list under "algorithm" --------------------------------------------------------------------------------------
def _awq_cfg(algorithm):
    cfg = _cfg()
    cfg["algorithm"] = algorithm
    return cfg


def test_a_list_runs_its_steps_in_order_as_by_hand():
    batches = _batches()
    fm = _model()
    steps = [{"method": "awq_lite", "progress": False}, {"method": "gptq", "clip_search": True}]
    chained = mtq.quantize(copy.deepcopy(fm), _awq_cfg(steps), _loop(batches))
    by_hand = mtq.quantize(copy.deepcopy(fm), _awq_cfg(steps[0]), _loop(batches))

    def calibrate_max():
        mtq.calibrate(by_hand, None, forward_loop=_loop(batches))

    ALGORITHMS["gptq"].run(by_hand, _loop(batches), calibrate_max, clip_search=True)
    for (na, a), (nb, b) in zip(chained.state_dict().items(), by_hand.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    awq_only = mtq.quantize(copy.deepcopy(fm), _awq_cfg(steps[0]), _loop(batches))
    assert not torch.equal(chained.down.weight, awq_only.down.weight)


def test_a_list_of_plain_methods_equals_the_last_one():
    batches = _batches()
    fm = _model()
    a = mtq.quantize(copy.deepcopy(fm), _awq_cfg(["max", None, "max"]), _loop(batches))
    b = mtq.quantize(copy.deepcopy(fm), _awq_cfg("max"), _loop(batches))
    for (na, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), na


@pytest.mark.parametrize(
    "algorithm,match",
    [
        ([], "must not be empty"),
        ([["max"]], "nested lists"),
        (["max", "nope"], "unknown calibration method 'nope'"),
        (["awq_lite", {"method": "gptq", "x": 1}], r"'gptq' got unknown parameter\(s\) \['x'\]"),
    ],
)
def test_a_bad_list_is_refused_before_anything_runs(algorithm, match):
    with pytest.raises(QuantConfigError, match=match):
        normalize_algorithm(algorithm)
    calls: list = []
    with pytest.raises(QuantConfigError, match=match):
        mtq.quantize(_model(), _awq_cfg(algorithm), _loop(_batches(), calls))
    assert calls == []


def test_a_failing_step_restores_the_model():
    fm = _model()
    batches = _batches()
    state = {"n": 0}

    def loop(m):
        state["n"] += 1
        for b in batches[: 1 + state["n"] % 4]:
            m(b)

    q = copy.deepcopy(fm)
    steps = [{"method": "awq_lite", "progress": False}, {"method": "gptq", "float_target": True}]
    with pytest.raises(ValueError, match="float_target"):
        mtq.quantize(q, _awq_cfg(steps), loop)
    assert list(q.state_dict()) == list(fm.state_dict())  # the quant modules are undone too
    for (na, x), (_, y) in zip(q.state_dict().items(), fm.state_dict().items()):
        assert torch.equal(x, y), na
    assert normalize_algorithm({"method": "sequence", "steps": ["max"]}) == ("sequence", {"steps": (("max", {}),)})
