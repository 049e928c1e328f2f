"""ModelOpt's ``mse`` weight calibration: ``model_calib.mse_calibrate`` and ``{"method": "mse", "step_size": ...}``.

Each chosen weight amax is checked against a brute-force search written here: every ModelOpt candidate
``amax_max * m`` tried on one row (or block, or the whole tensor) alone with the reference fake quantization, the
first minimum of the squared error taken.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite import model_calib
from modelopt_lite.conversion.config import QuantConfigError, normalize_algorithm
from modelopt_lite.tensor_quant import fake_block_quant, fake_tensor_quant


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def _data() -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(1))


def _mults() -> torch.Tensor:
    return torch.linspace(0.25, 4.0, steps=math.ceil((4.0 - 0.25) / 0.1) + 1)


def _brute_rows(w: torch.Tensor, amax_max: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row: the first candidate amax with the least squared error of fake_tensor_quant (narrow range)."""
    out = torch.empty_like(amax_max)
    for r in range(w.shape[0]):
        best, best_a = None, None
        for m in _mults():
            a = amax_max[r] * m
            e = ((fake_tensor_quant(w[r : r + 1], a, bits, False, True) - w[r : r + 1]) ** 2).sum()
            if best is None or e < best:
                best, best_a = e, a
        out[r] = best_a
    return out


def test_mse_calibrate_equals_brute_force_per_channel_int8():
    x = _data()
    ref = _model()
    mtq.quantize(ref, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model = _model()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    out = model_calib.mse_calibrate(model, lambda m: m(x))
    assert out is model
    for i in (0, 2):
        wq = model[i].weight_quantizer
        amax_max = ref[i].weight_quantizer.amax
        assert wq.amax.shape == amax_max.shape == (model[i].out_features, 1)
        assert wq.amax.dtype == torch.float32
        want = _brute_rows(model[i].weight.detach(), amax_max, 8)
        assert torch.equal(wq.amax, want)
        assert not torch.equal(wq.amax, amax_max)  # the search moved some rows
        # activations keep the max calibration
        assert torch.equal(model[i].input_quantizer.amax, ref[i].input_quantizer.amax)


def test_mse_config_form_is_the_same_as_the_entry_point():
    x = _data()
    a = _model()
    cfg = {**copy.deepcopy(mtq.INT8_DEFAULT_CFG), "algorithm": {"method": "mse", "step_size": 0.1}}
    mtq.quantize(a, cfg, lambda m: m(x))
    b = _model()
    mtq.quantize(b, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model_calib.mse_calibrate(b, lambda m: m(x))
    for i in (0, 2):
        assert torch.equal(a[i].weight_quantizer.amax, b[i].weight_quantizer.amax)
        assert torch.equal(a[i].input_quantizer.amax, b[i].input_quantizer.amax)


def test_plain_mse_keeps_its_histogram_meaning():
    assert normalize_algorithm({"method": "mse"}) == ("mse", {})
    assert normalize_algorithm({"method": "mse", "start_bin": 4}) == ("mse", {"start_bin": 4})
    assert normalize_algorithm({"method": "mse", "stop_multiplier": 2.0}) == ("weight_mse", {"stop_multiplier": 2.0})


def test_mse_calibrate_static_blocks_brute_force_and_error_not_worse_than_candidates():
    torch.manual_seed(3)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 4))
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 16, "type": "static"}}}}
    ref = copy.deepcopy(lin)
    mtq.quantize(ref, cfg, None)
    mtq.quantize(lin, cfg, None)
    model_calib.mse_calibrate(lin, step_size=0.25, start_multiplier=0.5, stop_multiplier=1.5)
    amax_max = ref[0].weight_quantizer.amax
    got = lin[0].weight_quantizer.amax
    assert got.shape == amax_max.shape == (4, 4)
    w = lin[0].weight.detach()
    mults = torch.linspace(0.5, 1.5, steps=5)
    for r in range(4):
        for b in range(4):
            blk = w[r : r + 1, 16 * b : 16 * (b + 1)]
            errs = [
                ((fake_block_quant(blk, {-1: 16}, (amax_max[r, b] * m).reshape(1, 1), 4) - blk) ** 2).sum()
                for m in mults
            ]
            k = min(range(len(errs)), key=lambda i: (errs[i], i))
            assert got[r, b] == amax_max[r, b] * mults[k]
    # multiplier 1 is among these candidates: the error can only go down against max
    e_max = ((ref[0].weight_quantizer(w) - w) ** 2).sum()
    e_mse = ((lin[0].weight_quantizer(w) - w) ** 2).sum()
    assert e_mse < e_max


def test_mse_calibrate_without_loop_is_weight_only_and_fp8_sweep_warns():
    model = _model()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, None)
    model_calib.mse_calibrate(model)
    assert model[0].input_quantizer.amax is None  # activations stay dynamic
    want = _brute_rows(model[0].weight.detach(), model[0].weight.detach().abs().amax(1, keepdim=True), 8)
    assert torch.equal(model[0].weight_quantizer.amax, want)
    other = _model()
    mtq.quantize(other, mtq.INT8_DEFAULT_CFG, None)
    with pytest.warns(UserWarning, match="fp8_scale_sweep=True refines only static NVFP4"):
        model_calib.mse_calibrate(other, fp8_scale_sweep=True)
    assert torch.equal(other[0].weight_quantizer.amax, other[0].weight.detach().abs().amax(1, keepdim=True))


def test_mse_bad_parameters_and_nan_weight():
    model = _model()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, None)
    before = model[0].weight_quantizer.amax.clone()
    with pytest.raises(QuantConfigError, match="step_size must be > 0, got 0"):
        model_calib.mse_calibrate(model, step_size=0)
    with pytest.raises(QuantConfigError, match="shared_states .* is not supported"):
        model_calib.mse_calibrate(model, shared_states={"a": {}})
    with pytest.raises(TypeError, match="distributed_sync must be a bool"):
        model_calib.mse_calibrate(model, distributed_sync=1)
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'2\.weight_quantizer'.*NaN"):
        model_calib.mse_calibrate(model)
    assert torch.equal(model[0].weight_quantizer.amax, before)  # put back exactly


# --- local_hessian ---------------------------------------------------------------------------------------------------
def _block_loss(w, wq, h, bs):
    dw = (w - wq).reshape(w.shape[0], -1, bs)
    return torch.stack([sum(dw[:, b] @ h[b] @ dw[:, b].T for _ in [0]).diagonal() for b in range(dw.shape[1])], 1)


def test_local_hessian_equals_brute_force_on_one_linear():
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(32, 6))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(6, 32) ** 3)  # heavy tails: clipping pays
    # correlated, uneven inputs so that the Hessian weighting matters
    x = torch.randn(128, 32) * torch.linspace(0.1, 3.0, 32) + 0.5 * torch.randn(128, 1)
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 4, "axis": 0}, "*input_quantizer": {"enable": False}}}
    mtq.quantize(model, cfg, lambda m: m(x))
    q = model[0].weight_quantizer
    amax_max = q.amax.clone()
    model_calib.local_hessian_calibrate(
        model,
        lambda m: m(x),
        fp8_scale_sweep=False,
        block_size=8,
        step_size=0.05,
        start_multiplier=0.5,
        stop_multiplier=1.5,
        debug=True,
    )
    w = model[0].weight.detach()
    xb = x.T.reshape(4, 8, -1)
    h = (xb @ xb.transpose(-1, -2)) / 128
    assert torch.allclose(model._local_hessian_accumulators["0"].hessian(), h, rtol=1e-5, atol=1e-6)
    mults = torch.linspace(0.5, 1.5, steps=21)
    assert mults[10] == 1.0
    got = model[0].weight_quantizer.amax
    changed = 0
    for r in range(6):
        losses = []
        for m in mults:
            a = amax_max[r] * m
            wq = fake_tensor_quant(w[r : r + 1], a, 4, False, q.narrow_range)
            dw = (w[r : r + 1] - wq).reshape(4, 8)
            losses.append(sum(float(dw[b] @ h[b] @ dw[b]) for b in range(4)))
        k = min(range(21), key=lambda i: (losses[i], i))
        want = amax_max[r] * mults[k]
        assert torch.isclose(got[r], want, rtol=0, atol=0) or losses[k] == pytest.approx(
            losses[int(torch.nonzero(torch.isclose(amax_max[r] * mults, got[r])).flatten()[0])], rel=1e-5
        )
        changed += int(k != 10)
        assert losses[k] <= losses[10]  # never worse than max (multiplier 1 is a candidate)
    assert changed > 0


def test_local_hessian_config_form_default_sweep_and_no_loop():
    x = _data()
    a = _model()
    alg = {"method": "local_hessian", "fp8_scale_sweep": False, "block_size": 8}
    mtq.quantize(a, {**copy.deepcopy(mtq.INT8_DEFAULT_CFG), "algorithm": alg}, lambda m: m(x))
    b = _model()
    mtq.quantize(b, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model_calib.local_hessian_calibrate(b, lambda m: m(x), fp8_scale_sweep=False, block_size=8)
    plain = _model()
    mtq.quantize(plain, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model_calib.mse_calibrate(plain, lambda m: m(x))
    for i in (0, 2):
        assert torch.equal(a[i].weight_quantizer.amax, b[i].weight_quantizer.amax)
    assert not torch.equal(a[0].weight_quantizer.amax, plain[0].weight_quantizer.amax)  # the weighting matters
    c = _model()
    mtq.quantize(c, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    max_amax = c[0].weight_quantizer.amax.clone()
    with pytest.warns(UserWarning, match="fp8_scale_sweep=True refines only static NVFP4"):
        model_calib.local_hessian_calibrate(c, lambda m: m(x))
    assert torch.equal(c[0].weight_quantizer.amax, max_amax)
    with pytest.warns(UserWarning, match="forward_loop must be provided"):
        model_calib.local_hessian_calibrate(c)
    with pytest.raises(QuantConfigError, match="block_size must be an int >= 1, got 0"):
        model_calib.local_hessian_calibrate(c, lambda m: m(x), block_size=0)


def test_local_hessian_nan_input_names_the_layer():
    x = _data()
    model = _model()
    mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    before = model[0].weight_quantizer.amax.clone()
    bad = x.clone()
    bad[3, 4] = float("inf")
    calls = []

    def loop(m):  # clean data for the max calibration, an Inf in the Hessian pass
        calls.append(1)
        m(x if len(calls) == 1 else bad)

    with pytest.raises(ValueError, match="local_hessian: the input of 0 contains NaN or Inf"):
        model_calib.local_hessian_calibrate(model, loop, fp8_scale_sweep=False, block_size=8)
    assert torch.equal(model[0].weight_quantizer.amax, before)


# --- svd --------------------------------------------------------------------------------------------------------------
def test_svd_is_the_best_low_rank_approximation():
    w = torch.randn(12, 9, generator=torch.Generator().manual_seed(4), dtype=torch.float64).float()
    us, vt = model_calib.svd(w, 3)
    assert us.shape == (12, 3) and vt.shape == (3, 9) and us.dtype == vt.dtype == torch.float32
    u, s, v = torch.linalg.svd(w.double(), full_matrices=False)
    best = (u[:, :3] * s[:3]) @ v[:3]
    assert torch.allclose((us.double() @ vt.double()), best, atol=1e-5)
    with pytest.warns(UserWarning, match="rank 11 exceeds min"):
        us, vt = model_calib.svd(w.half(), 11)
    assert us.shape == (12, 11) and vt.shape == (11, 9) and us.dtype == torch.float16
    assert torch.equal(us[:, 9:], torch.zeros(12, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="svd: weight must be 2-D"):
        model_calib.svd(torch.ones(3), 1)


# --- lsq --------------------------------------------------------------------------------------------------------------
def test_lsq_is_the_scale_calibration_and_says_nothing_was_converted():
    x = _data()
    ref = _model()
    mtq.quantize(ref, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model_calib.mse_calibrate(ref, lambda m: m(x))
    a = _model()
    mtq.quantize(a, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with pytest.warns(UserWarning, match="no quantizer was converted to LSQ mode"):
        model_calib.lsq(a, lambda m: m(x))
    b = _model()
    with pytest.warns(UserWarning, match="no quantizer was converted to LSQ mode"):
        mtq.quantize(b, {**copy.deepcopy(mtq.INT8_DEFAULT_CFG), "algorithm": {"method": "lsq"}}, lambda m: m(x))
    for i in (0, 2):
        assert torch.equal(a[i].weight_quantizer.amax, ref[i].weight_quantizer.amax)  # default: mse
        assert torch.equal(b[i].weight_quantizer.amax, ref[i].weight_quantizer.amax)
        assert not isinstance(a[i].weight_quantizer._amax, torch.nn.Parameter)
    c = _model()
    mtq.quantize(c, mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    before = c[0].weight_quantizer.amax.clone()
    with pytest.warns(UserWarning, match="LSQ mode"):
        model_calib.lsq(c, lambda m: m(x), scale_algorithm={"method": "max"})
    assert torch.equal(c[0].weight_quantizer.amax, before)
    with pytest.raises(QuantConfigError, match="learnable_amax must be 'pre', 'post'"):
        model_calib.lsq(c, lambda m: m(x), learnable_amax="both")
    with pytest.raises(QuantConfigError, match="scale_algorithm must be None or"):
        model_calib.lsq(c, lambda m: m(x), scale_algorithm={"method": "awq_lite"})
