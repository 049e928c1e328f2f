"""Drop-in behaviour for pytorch-quantization and ModelOpt users (issue 14): the quantizer, the functional signatures
and the ``modelopt_lite.tensor_quant`` submodule, plus the places where our numerics differ from the peers on purpose
(each documented by a test below)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import tensor_quant as tq
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import QuantLinear, TensorQuantizer

ROOT = Path(__file__).resolve().parents[1]


def _x(*shape, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# --- an uncalibrated quantizer quantizes with the input's own max ------------------------------------------------------
def test_uncalibrated_per_tensor_uses_the_input_max_and_stores_nothing():
    q = TensorQuantizer()
    assert q.amax is None and q.scale is None and q.step_size is None and not q.has_amax
    x = torch.tensor([-3.0, 0.5, 1.0, 2.9])
    y = q(x)
    assert torch.equal(y, tq.fake_tensor_quant(x, 3.0, 8, False, False))
    assert y[0].item() == -3.0 and y[1].item() == pytest.approx(0.5, abs=3.0 / 127)
    x2 = x * 10  # a larger input gets its own (larger) range: nothing was stored
    assert torch.equal(q(x2), tq.fake_tensor_quant(x2, 30.0, 8, False, False))
    assert q.amax is None and "_amax" not in q.state_dict()
    fresh = TensorQuantizer()
    fresh.load_state_dict(q.state_dict())
    assert fresh.amax is None


def test_uncalibrated_per_axis_blocks_fp8_and_real_quant():
    x = _x(4, 6)
    qa = TensorQuantizer(QD(axis=0, num_bits=4))
    assert torch.equal(qa(x), tq.fake_tensor_quant(x, x.abs().amax(1, keepdim=True), 4, False, False))
    qa_neg = TensorQuantizer(QD(axis=-1))
    assert torch.equal(qa_neg(x), tq.fake_tensor_quant(x, x.abs().amax(0, keepdim=True), 8, False, False))
    qb = TensorQuantizer(QD(num_bits=4, block_sizes={-1: 3}))
    assert torch.equal(qb(x), tq.fake_block_quant(x, {-1: 3}, None, 4))
    blocks_amax = x.abs().reshape(4, 2, 3).amax(-1)
    assert torch.equal(qb(x), tq.fake_block_quant(x, {-1: 3}, blocks_amax, 4))
    q8 = TensorQuantizer(QD(num_bits=(4, 3)))
    assert torch.equal(q8(x), tq.scaled_e4m3(x, x.abs().amax()))
    real = TensorQuantizer(QD(fake_quant=False))
    codes = real(x)
    assert torch.equal(codes, tq.tensor_quant(x, x.abs().amax(), 8, False, False)[0])
    assert codes.abs().max().item() == 127.0
    half = TensorQuantizer(QD(scale_amax=0.5))
    assert torch.equal(half(x), tq.fake_tensor_quant(x, x.abs().amax() * 0.5, 8, False, False))
    temporal = TensorQuantizer(num_steps=3)
    assert temporal.amax is None and torch.equal(temporal(x), tq.fake_tensor_quant(x, x.abs().amax(), 8, False, False))


def test_calibration_turns_the_dynamic_fallback_static():
    q = TensorQuantizer(name="blk.input_quantizer")
    x = torch.tensor([1.0, -2.0])
    q.enable_calib()
    y = q(x)  # collecting with quantization on and no amax yet: quantized with x's own max
    assert torch.equal(y, tq.fake_tensor_quant(x, 2.0, 8, False, False))
    q.load_calib_amax()
    q.disable_calib()
    assert q.amax.item() == 2.0 and q.scale.item() == pytest.approx(2.0 / 127)
    big = torch.tensor([10.0, 0.5])
    assert q(big)[0].item() == pytest.approx(2.0)  # now clipped by the stored amax
    q.reset_amax()
    assert q.amax is None and torch.equal(q(big), tq.fake_tensor_quant(big, 10.0, 8, False, False))


def test_uncalibrated_errors_still_name_the_quantizer():
    q = TensorQuantizer(name="enc.fc.input_quantizer")
    with pytest.raises(ValueError, match=r"'enc.fc.input_quantizer': the input contains NaN or Inf"):
        q(torch.tensor([1.0, float("nan")]))
    with pytest.raises(RuntimeError, match=r"'enc.fc.input_quantizer' has no amax"):
        q.export_info()
    with pytest.raises(RuntimeError, match=r"'enc.fc.input_quantizer' has no amax"):
        q.quantize_weight_codes(torch.ones(2, 2))
    dyn = TensorQuantizer(QD(dynamic=True), name="d")
    with pytest.raises(RuntimeError, match="'d' is dynamic"):  # ModelOpt also refuses amax on a dynamic quantizer
        _ = dyn.amax
    assert "amax=uncalibrated" in repr(q)


def test_export_and_fake2real_refuse_uncalibrated_quantizers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(QuantLinear(4, 3))
    x = torch.randn(2, 4)
    y = model(x)  # runs: both quantizers use the tensors' own max
    w = model[0].weight.detach()
    wq = tq.fake_tensor_quant(w, w.abs().amax(1, keepdim=True), 8, False, False)
    xq = tq.fake_tensor_quant(x, x.abs().amax(), 8, False, False)
    assert torch.equal(y, nn.functional.linear(xq, wq, model[0].bias))
    with pytest.raises(ValueError, match=r"not calibrated .*0\.input_quantizer, 0\.weight_quantizer"):
        mtq.export_onnx(model, (x,), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises((RuntimeError, ValueError), match=r"has no amax|not calibrated"):
        mtq.fake2real(model)


# --- function signatures of both peers -------------------------------------------------------------------------------
def test_fake_tensor_quant_both_layouts_positional_and_keyword():
    x, amax = _x(3, 5), torch.tensor(2.5)
    ref = tq.fake_tensor_quant(x, amax, num_bits=4, unsigned=False, narrow_range=True)
    calls = [
        tq.fake_tensor_quant(x, amax, 4),  # pytorch-quantization
        tq.fake_tensor_quant(x, amax, 4, False, True),
        tq.fake_tensor_quant(x, amax, 4, torch.float32, False, True),  # its user guide's output_dtype
        tq.fake_tensor_quant(x, amax, None, 4),  # ModelOpt: bias third
        tq.fake_tensor_quant(x, amax, None, 4, False, True),
        tq.fake_tensor_quant(x, amax, bias=None, num_bits=4, unsigned=False, narrow_range=True),
        tq.FakeTensorQuantFunction.apply(x, amax, None, 4, False, True),
        tq.FakeTensorQuantFunction.apply(x, amax, 4, False, True),
    ]
    for i, y in enumerate(calls):
        assert torch.equal(y, ref), i
    assert torch.equal(
        tq.fake_tensor_quant(x, amax, 8, False, False), tq.fake_tensor_quant(x, amax, None, 8, False, False)
    )
    assert not torch.equal(
        tq.fake_tensor_quant(x, amax, 8, False, True), tq.fake_tensor_quant(x, amax, 8, False, False)
    )
    assert tq.fake_tensor_quant(x.half(), amax, 8, output_dtype=torch.float32).dtype == torch.float32


def test_tensor_quant_both_layouts_and_output_dtype():
    x, amax = _x(4, 4), torch.tensor(3.0)
    q_ref, s_ref = tq.tensor_quant(x, amax, num_bits=8, unsigned=False, narrow_range=False)
    for q, s in (
        tq.tensor_quant(x, amax, 8, False, False),
        tq.tensor_quant(x, amax, None, 8, False, False),
        tq.TensorQuantFunction.apply(x, amax, None, 8, False, False),
    ):
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and q.dtype == torch.float32
    q8, _ = tq.tensor_quant(x, amax, 8, torch.int8, False, False)  # the user guide's tensor_quant(x, amax, 8, dtype)
    assert q8.dtype == torch.int8 and torch.equal(q8.float(), q_ref)
    assert tq.tensor_quant(x, amax, output_dtype=torch.int32)[0].dtype == torch.int32
    with pytest.raises(TypeError, match="give one"):
        tq.tensor_quant(x, amax, dtype=torch.int8, output_dtype=torch.int32)


def test_bias_shifts_the_grid():
    x = torch.tensor([0.9, 1.1, 1.5, 3.0])
    b = torch.tensor(1.0)
    y = tq.fake_tensor_quant(x, 1.0, b, 8)  # ModelOpt: quantize x - bias, add bias back
    assert torch.equal(y, tq.fake_tensor_quant(x - 1.0, 1.0, 8) + 1.0)
    assert y[-1].item() == 2.0  # clipped at bias + amax
    assert torch.equal(tq.fake_tensor_quant(x, 1.0, 0.5, 8), tq.fake_tensor_quant(x - 0.5, 1.0, 8) + 0.5)
    q, s = tq.tensor_quant(x, 1.0, b, 8)
    # difference from ModelOpt (which returns codes + bias): our codes are those of x - bias; q * scale + bias
    # dequantizes
    assert torch.equal(q, tq.tensor_quant(x - 1.0, 1.0, 8)[0]) and q[-1].item() == 127.0
    assert torch.allclose(q * s + b, y)
    assert tq.fake_tensor_quant(x.half(), 1.0, b, 8).dtype == torch.float16
    with pytest.raises(ValueError, match="bias must be finite"):
        tq.fake_tensor_quant(x, 1.0, torch.tensor(float("inf")), 8)


def test_signature_misuse_is_a_clear_type_error():
    x = torch.ones(3)
    with pytest.raises(TypeError, match="multiple values for argument 'num_bits'"):
        tq.fake_tensor_quant(x, 1.0, 8, num_bits=4)
    with pytest.raises(TypeError, match="multiple values for argument 'bias'"):
        tq.fake_tensor_quant(x, 1.0, torch.tensor(0.5), bias=torch.tensor(0.5))
    with pytest.raises(TypeError, match="at most"):
        tq.fake_tensor_quant(x, 1.0, 8, False, True, True)
    with pytest.raises(TypeError, match="floating dtype"):
        tq.fake_tensor_quant(x, 1.0, 8, torch.int8)
    with pytest.raises(TypeError, match="torch.dtype"):
        tq.tensor_quant(x, 1.0, output_dtype="int8")


def test_float64_inputs_are_computed_in_float32():
    x32 = _x(4, 6)
    x = x32.double()
    amax = torch.tensor(2.0)
    y = tq.fake_tensor_quant(x, amax)
    assert y.dtype == torch.float64 and torch.equal(y, tq.fake_tensor_quant(x32, amax).double())
    q, s = tq.tensor_quant(x, amax, 8)
    assert (
        q.dtype == torch.float64
        and s.dtype == torch.float32
        and torch.equal(q.float(), tq.tensor_quant(x32, amax, 8)[0])
    )
    assert tq.tensor_quant(x, amax, 8, dtype=torch.int8)[0].dtype == torch.int8
    e = tq.scaled_e4m3(x, 2.0)
    assert e.dtype == torch.float64 and torch.equal(e, tq.scaled_e4m3(x32, 2.0).double())
    b = tq.fake_block_quant(x, {-1: 3}, None, 4)
    assert b.dtype == torch.float64 and torch.equal(b, tq.fake_block_quant(x32, {-1: 3}, None, 4).double())
    a = tq.fake_affine_tensor_quant(x, -1.0, 3.0)
    assert a.dtype == torch.float64 and torch.equal(a, tq.fake_affine_tensor_quant(x32, -1.0, 3.0).double())
    xg = x.clone().requires_grad_(True)
    tq.fake_tensor_quant(xg, 1.0).sum().backward()
    assert xg.grad.dtype == torch.float64 and torch.equal(xg.grad, (x.abs() <= 1.0).double())
    q = TensorQuantizer(QD(axis=0))
    assert q(x).dtype == torch.float64 and torch.equal(q(x), q(x32).double())


# --- pre_quant_scale: a number or a (1, C) tensor ----------------------------------------------------------------------
def test_pre_quant_scale_accepts_a_number_and_a_1_by_c_tensor():
    x = _x(2, 3)
    q = TensorQuantizer(amax=4.0)
    q.pre_quant_scale = 0.5
    assert q.pre_quant_scale.shape == (1,) and q.pre_quant_scale.item() == 0.5
    assert torch.equal(q(x), tq.fake_tensor_quant(x * 0.5, 4.0, 8, False, False))
    assert q(torch.tensor(2.0)).shape == ()  # a scalar stays a scalar
    q.pre_quant_scale = torch.tensor([[0.5, 2.0, 1.0]])  # ModelOpt's (1, C)
    assert q.pre_quant_scale.shape == (3,)
    assert torch.equal(q(x), tq.fake_tensor_quant(x * torch.tensor([0.5, 2.0, 1.0]), 4.0, 8, False, False))
    fresh = TensorQuantizer(amax=4.0)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh.pre_quant_scale, torch.tensor([0.5, 2.0, 1.0]))
    with pytest.raises(ValueError, match=r"got shape \(3, 1\)"):
        q.pre_quant_scale = torch.ones(3, 1)
    with pytest.raises(ValueError, match="finite and > 0, got -1.0"):
        q.pre_quant_scale = -1.0
    with pytest.raises(TypeError, match="got bool"):
        q.pre_quant_scale = True


# --- modelopt_lite.tensor_quant is always the submodule ----------------------------------------------------------------
_ORDERS = {
    "package first": (
        "import modelopt_lite, types\nm = modelopt_lite.tensor_quant\nimport modelopt_lite.tensor_quant as sub\n"
    ),
    "submodule first": (
        "import modelopt_lite.tensor_quant as sub\nimport modelopt_lite, types\nm = modelopt_lite.tensor_quant\n"
    ),
    "from-import": ("from modelopt_lite import tensor_quant as m\nimport modelopt_lite.tensor_quant as sub, types\n"),
}


@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_tensor_quant_is_the_submodule_in_any_import_order(order):
    code = _ORDERS[order] + (
        "import modelopt_lite\n"
        "assert isinstance(m, types.ModuleType), m\n"
        "assert m is sub is modelopt_lite.tensor_quant\n"
        "assert callable(m.tensor_quant) and callable(modelopt_lite.fake_tensor_quant)\n"
        "assert isinstance(modelopt_lite.tensor_quant, types.ModuleType)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_tensor_quant_attribute_in_process():
    assert isinstance(mtq.tensor_quant, types.ModuleType) and mtq.tensor_quant is tq
    q, s = mtq.tensor_quant.tensor_quant(torch.tensor([1.0]), 1.0, 8)
    assert q.item() == 127.0 and s.item() == pytest.approx(1 / 127)


# --- where our numerics differ from the peers on purpose ---------------------------------------------------------------
def test_difference_true_division_not_reciprocal_multiply():
    # pytorch-quantization/ModelOpt compute rint(x * (bound / amax)); we compute rint(x / (amax / bound)) in float32,
    # which is what ONNX Runtime's QuantizeLinear does. This value lands on different codes.
    x = torch.tensor([0.9409448504447937])
    amax = torch.tensor(1.0)
    q, s = tq.tensor_quant(x, amax, 8)
    assert q.item() == 120.0
    assert torch.round(x * (127.0 / amax)).item() == 119.0  # the peers' multiply
    assert torch.equal(tq.fake_tensor_quant(x, amax, 8), q * s)


def test_difference_scale_is_amax_over_bound():
    # the peers' tensor_quant returns scale = bound / amax (a multiplier); ours is amax / bound (what Q/DQ store)
    q, s = tq.tensor_quant(torch.tensor([0.5, -2.0]), torch.tensor(2.0), 8)
    assert s.dtype == torch.float32 and s.item() == torch.tensor(2.0 / 127, dtype=torch.float32).item()
    assert torch.equal(q, torch.tensor([32.0, -127.0]))
    assert TensorQuantizer(amax=2.0).scale.item() == s.item()


def test_difference_learnable_amax_gets_the_lsq_gradient():
    # the peers give amax no gradient (pytorch-quantization returns None; ModelOpt clips with a detached amax); ours is
    # LSQ: (q - v) / bound inside the grid, qmin / bound below, qmax / bound above (v = x / scale)
    def grad(xs, narrow=True):
        amax = torch.tensor(127.0, requires_grad=True)  # scale = 1 exactly
        tq.fake_tensor_quant(torch.tensor(xs), amax, 8, False, narrow).sum().backward()
        return amax.grad.item()

    assert grad([10.25]) == pytest.approx((10.0 - 10.25) / 127, rel=1e-6)  # inside: (q - v) / bound
    assert grad([200.0]) == 1.0  # above: qmax / bound
    assert grad([-200.0]) == -1.0  # below, narrow grid: qmin / bound = -127 / 127
    assert grad([-200.0], narrow=False) == pytest.approx(-128 / 127, rel=1e-6)
    assert grad([0.0, 3.0]) == 0.0  # on the grid: q == v


def test_summary_and_save_restore_of_an_uncalibrated_model(tmp_path):
    torch.manual_seed(0)
    cfg = {**mtq.INT8_DEFAULT_CFG, "algorithm": None}  # no algorithm, no forward_loop: nothing calibrated
    model = mtq.quantize(nn.Sequential(nn.Linear(4, 3)), cfg)  # ("max" without a loop calibrates the weights)
    rows = {r["name"]: r for r in mtq.summary(model)}
    assert rows["0.input_quantizer"]["calibrated"] is False and rows["0.input_quantizer"]["amax_max"] is None
    assert rows["0.weight_quantizer"]["enabled"] is True and rows["0.weight_quantizer"]["calibrated"] is False
    mtq.save(model, tmp_path / "state")
    fresh = mtq.restore(nn.Sequential(nn.Linear(4, 3)), tmp_path / "state")
    fresh.load_state_dict(model.state_dict())
    for name in ("input_quantizer", "weight_quantizer"):
        assert getattr(fresh[0], name).amax is None and getattr(fresh[0], name).is_enabled
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), model(x))


def test_quantizer_from_a_disabled_descriptor_config():
    q = TensorQuantizer(amax=1.0)
    q.set_from_attribute_config(QD(num_bits=4, enable=False))  # a descriptor is a complete config, enable included
    assert not q.is_enabled and q.num_bits == 4
    q.set_from_attribute_config(QD(num_bits=4))
    assert q.is_enabled
