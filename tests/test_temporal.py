"""Temporal (per-step) quantization: quant_step, per-step calibration, and the denoiser where it pays off."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.conversion.utils import named_quantizers
from modelopt_lite.examples.denoiser import (
    DenoiserMLP,
    NoiseSchedule,
    sample_data,
    step_batches,
    trained_denoiser,
)

STEPS = 10


@pytest.fixture(scope="module")
def denoiser():
    return trained_denoiser(STEPS, iters=150)


def _cfg(num_steps):
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*input_quantizer"]["num_steps"] = num_steps
    return cfg


def _loop(batches):
    def loop(model):
        with torch.no_grad():
            for x, t in batches:
                with mtq.quant_step(model, t):
                    model(x, t)

    return loop


def _quantized(model, schedule, num_steps, seed=1):
    return mtq.quantize(copy.deepcopy(model), _cfg(num_steps), _loop(step_batches(schedule, 256, seed=seed)))


def _steps(model):
    return {n: q.step for n, q in named_quantizers(model)}


def test_schedule_data_and_model_shapes():
    s = NoiseSchedule.geometric(10)
    assert s.num_steps == 10 and s.sigmas[0].item() == pytest.approx(0.02) and s.sigmas[-1].item() == pytest.approx(40)
    assert bool((s.sigmas[1:] > s.sigmas[:-1]).all())
    x0 = sample_data(5, torch.Generator().manual_seed(0))
    x_t, eps = s.add_noise(x0, 3, torch.Generator().manual_seed(0))
    assert torch.equal(x_t, x0 + s.sigmas[3] * eps)
    m = DenoiserMLP()
    assert m(x_t, 3).shape == (5, 2) and torch.equal(m(x_t, torch.full((5,), 3)), m(x_t, 3))
    with pytest.raises(ValueError, match=r"steps must be in \[0, 10\), got 10..10"):
        m(x_t, 10)
    with pytest.raises(ValueError, match="sigma_min"):
        NoiseSchedule.geometric(0)


def test_quant_step_selects_and_restores(denoiser):
    model, schedule = denoiser
    q = _quantized(model, schedule, STEPS)
    temporal = {n for n, tq in named_quantizers(q) if tq.num_steps == STEPS}
    assert temporal == {
        "inp.input_quantizer",
        "body.0.input_quantizer",
        "body.2.input_quantizer",
        "out.input_quantizer",
    }
    assert set(_steps(q).values()) == {0}
    with mtq.quant_step(q, 7) as m:
        assert m is q
        assert all(s == (7 if n in temporal else 0) for n, s in _steps(q).items())
        with mtq.quant_step(q, torch.tensor(2)):
            assert q.inp.input_quantizer.step == 2
        assert q.inp.input_quantizer.step == 7
    assert set(_steps(q).values()) == {0}
    with pytest.raises(KeyError), mtq.quant_step(q, 4):
        raise KeyError("x")
    assert set(_steps(q).values()) == {0}
    with (
        pytest.raises(
            ValueError,
            match=r"quant_step: step 10 is out of range for quantizer "
            r"'inp.input_quantizer' \(num_steps=10\)",
        ),
        mtq.quant_step(q, 10),
    ):
        pytest.fail("must not run")
    with pytest.raises(TypeError, match="t must be an int, got float"), mtq.quant_step(q, 1.0):
        pytest.fail("must not run")
    assert set(_steps(q).values()) == {0}
    with mtq.quant_step(torch.nn.Linear(2, 2), 99):  # no temporal quantizers: nothing to do
        pass


def test_calibration_collects_one_amax_per_step(denoiser):
    model, schedule = denoiser
    q = _quantized(model, schedule, STEPS)
    batches = step_batches(schedule, 256, seed=1)
    tq = q.inp.input_quantizer
    assert tq._amax.shape == (STEPS,)
    for x, t in batches:
        with mtq.quant_step(q, t):
            assert torch.equal(tq.amax, x.abs().max())  # step t saw exactly step t's batch
    a = tq._amax
    assert a[-1] / a[0] > 50  # the range really changes with the step
    shared = _quantized(model, schedule, 1)
    assert torch.equal(shared.inp.input_quantizer.amax, a.max())


def test_step_without_data_gets_the_max_of_the_others_with_a_warning(denoiser):
    model, schedule = denoiser
    batches = step_batches(schedule, 64, seed=1)[:4]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = mtq.quantize(copy.deepcopy(model), _cfg(STEPS), _loop(batches))
    messages = sorted(str(w.message) for w in caught if w.category is RuntimeWarning)
    assert len(messages) == 4 and messages[0] == (
        "TensorQuantizer 'body.0.input_quantizer': the calibrator returned no amax for step(s) [4, 5, 6, 7, 8, 9]: "
        "it never saw calibration data"
    )
    a = q.inp.input_quantizer._amax
    assert torch.equal(a[4:], a[:4].max().expand(6))


def test_per_step_amax_beats_one_shared_amax(denoiser):
    """Measured: mean output MSE against FP32 over all steps, per-step amax vs one shared amax (INT8)."""
    model, schedule = denoiser
    test = step_batches(schedule, 512, seed=2)

    def mse(q):
        errs = []
        with torch.no_grad():
            for x, t in test:
                with mtq.quant_step(q, t):
                    errs.append(torch.mean((q(x, t) - model(x, t)) ** 2).item())
        return errs

    per_step, shared = mse(_quantized(model, schedule, STEPS)), mse(_quantized(model, schedule, 1))
    mean_step, mean_shared = sum(per_step) / STEPS, sum(shared) / STEPS
    assert mean_step < mean_shared / 10, (mean_step, mean_shared)
    assert per_step[0] < shared[0] / 100  # the clean steps suffer most from a shared range
