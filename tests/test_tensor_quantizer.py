"""TensorQuantizer: exact equality with the functional layer, switches, calibration, state, errors."""

import re
import warnings

import pytest
import torch

from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.functional import blocks
from modelopt_lite.nn import TensorQuantizer
from modelopt_lite.tensor_quant import (
    fake_block_quant,
    fake_tensor_quant,
    scaled_e4m3,
    tensor_quant,
)


def _calibrate(q, *batches, **kw):
    q.disable_quant()
    q.enable_calib()
    for b in batches:
        q(b)
    q.load_calib_amax(**kw)
    q.disable_calib()
    q.enable_quant()
    return q


def _x(*shape, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# --- numerics equal the functional layer ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bits, unsigned, narrow",
    [(8, False, False), (8, False, True), (4, False, False), (3, False, True), (8, True, False)],
)
def test_per_tensor_fixed_amax_equals_functional(bits, unsigned, narrow):
    x = _x(6, 7)
    if unsigned:
        x = x.abs()
    q = TensorQuantizer(QD(num_bits=bits, unsigned=unsigned, narrow_range=narrow, amax=1.5))
    assert q.amax.shape == () and q.amax.dtype == torch.float32
    y = q(x)
    assert torch.equal(y, fake_tensor_quant(x, torch.tensor(1.5), bits, unsigned, narrow))
    assert y.dtype == x.dtype and y is not x


@pytest.mark.parametrize("axis, shape", [(0, (4, 1, 1)), (-1, (1, 1, 5)), ((0, 2), (4, 1, 5)), (1, (1, 3, 1))])
def test_per_channel_calibrated_equals_functional(axis, shape):
    x1, x2 = _x(4, 3, 5, seed=1), _x(4, 3, 5, seed=2, scale=3.0)
    q = _calibrate(TensorQuantizer(QD(axis=axis)), x1, x2)
    assert tuple(q.amax.shape) == shape
    keep = [d for d in range(3) if shape[d] != 1]
    red = [d for d in range(3) if d not in keep]
    expect = torch.maximum(x1.abs().amax(red, keepdim=True), x2.abs().amax(red, keepdim=True))
    assert torch.equal(q.amax, expect)
    assert torch.equal(q(x1), fake_tensor_quant(x1, expect, 8, False, False))


def test_bad_axis_names_quantizer():
    q = TensorQuantizer(QD(axis=3), name="blk.fc.input_quantizer", amax=None)
    with pytest.raises(ValueError, match=r"'blk.fc.input_quantizer': axis=3 is out of range for an input of rank 2"):
        q(torch.ones(2, 2))


def test_fixed_flat_per_channel_amax_is_fitted_without_touching_buffer():
    q = TensorQuantizer(QD(axis=0, amax=[1.0, 2.0, 4.0]))
    x = _x(3, 4)
    assert torch.equal(q(x), fake_tensor_quant(x, torch.tensor([[1.0], [2.0], [4.0]]), 8, False, False))
    assert q.amax.shape == (3,)
    assert q.export_info()["amax"].shape == (3, 1) and q.export_info()["axis"] == (0,)
    with pytest.raises(ValueError, match="does not match axis"):
        q(_x(2, 4))


def test_fp16_input_keeps_dtype_and_matches():
    x = _x(5, 5).half()
    q = TensorQuantizer(QD(amax=2.0))
    y = q(x)
    assert y.dtype == torch.float16 and torch.equal(y, fake_tensor_quant(x, 2.0, 8, False, False))


# --- properties ------------------------------------------------------------------------------------------------------
def test_properties():
    q = TensorQuantizer(QD(amax=2.54))
    assert q.maxbound == 127 and q.num_bits == 8 and q.axis is None and not q.unsigned and not q.narrow_range
    assert torch.equal(q.step_size, torch.tensor(2.54) / 127)
    assert torch.equal(q.scale, torch.tensor(2.54, dtype=torch.float32) / torch.tensor(127.0))
    assert TensorQuantizer(QD(num_bits=8, unsigned=True)).maxbound == 255
    assert TensorQuantizer(QD(num_bits=4)).maxbound == 7
    assert TensorQuantizer(QD(num_bits=(4, 3))).maxbound == 448.0
    pc = TensorQuantizer(QD(axis=0, amax=[[0.0], [1.27]]))
    assert torch.equal(pc.scale, torch.tensor([[1.0], [0.01]]))  # a dead channel reports a positive scale
    assert pc.has_amax and pc.is_calibrated and not TensorQuantizer().has_amax


def test_switches():
    x = _x(3, 3)
    q = TensorQuantizer(QD(amax=1.0))
    q.disable()
    assert q(x) is x and not q.is_enabled
    q.enable()
    q.disable_quant()
    assert q(x) is x and not q.is_quant_enabled
    q.enable_quant()
    assert q.is_quant_enabled and not q.is_calib_enabled
    assert TensorQuantizer(disabled=True).extra_repr() == "disabled"


def test_calib_mode_collects_and_returns_input_or_quantized():
    x = _x(4, 4)
    q = TensorQuantizer()
    q.enable_calib()
    q.disable_quant()
    assert q(x) is x
    q.load_calib_amax()
    assert torch.equal(q.amax, x.abs().amax())
    q.enable_quant()  # calib + quant: collects and quantizes with the existing amax
    x2 = x * 3
    assert torch.equal(q(x2), fake_tensor_quant(x2, x.abs().amax(), 8, False, False))
    q.load_calib_amax()
    assert torch.equal(q.amax, x2.abs().amax())


# --- errors when not calibrated ----------------------------------------------------------------------------------------
def test_uncalibrated_errors_name_the_quantizer():
    q = TensorQuantizer(name="encoder.fc1.input_quantizer")
    assert q.amax is None and q.scale is None and q.step_size is None
    x = torch.tensor([-3.0, 0.5, 1.0])
    assert torch.equal(q(x), fake_tensor_quant(x, 3.0, 8, False, False))  # the input's own max, nothing stored
    assert not q.has_amax
    with pytest.raises(RuntimeError, match=r"'encoder.fc1.input_quantizer' has no amax.*never saw calibration data"):
        q.export_info()
    with pytest.raises(RuntimeError, match=r"'encoder.fc1.input_quantizer'.*never saw calibration data"):
        q.load_calib_amax()
    with pytest.warns(RuntimeWarning, match="never saw calibration data"):
        q.load_calib_amax(strict=False)
    assert not q.has_amax
    with pytest.raises(RuntimeError, match="init_learn_amax"):
        q.init_learn_amax()


def test_amax_setter_validates():
    q = TensorQuantizer(name="q")
    for bad, exc in (
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("2", TypeError),
    ):
        with pytest.raises(exc, match="'q'"):
            q.amax = bad
    q.amax = 3
    assert q.amax.dtype == torch.float32 and q.amax.item() == 3.0
    with pytest.raises(ValueError, match=r"shape \(2,\).*shape \(\)"):
        q.amax = torch.tensor([1.0, 2.0])


# --- dynamic -----------------------------------------------------------------------------------------------------------
def test_dynamic_per_tensor_and_per_axis():
    x = _x(3, 4, 5)
    q = TensorQuantizer(QD(dynamic=True))
    assert torch.equal(q(x), fake_tensor_quant(x, x.abs().amax(), 8, False, False))
    qa = TensorQuantizer(QD(dynamic=True, axis=(0, -1), num_bits=4))
    assert torch.equal(qa(x), fake_tensor_quant(x, x.abs().amax(1, keepdim=True), 4, False, False))
    assert q.calibrator is None and not q.has_amax
    q.enable_calib()
    q(x)  # nothing to collect, no error
    q.load_calib_amax()  # no-op
    with pytest.raises(RuntimeError, match="dynamic"):
        _ = q.amax
    with pytest.raises(ValueError, match="NaN or Inf"):
        q(torch.tensor([1.0, float("nan")]))
    assert "amax=dynamic" in q.extra_repr()


# --- blocks ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs, shape", [({-1: 4}, (3, 8)), ({-1: 3}, (2, 7)), ({0: 2, 1: 4}, (4, 8))])
def test_static_blocks_running_max(bs, shape):
    x1, x2 = _x(*shape, seed=3), _x(*shape, seed=4, scale=3.0)
    d = QD(num_bits=4, block_sizes=bs)
    q = _calibrate(TensorQuantizer(d), x1, x2)
    expect = torch.maximum(blocks.block_amax(x1, bs), blocks.block_amax(x2, bs))
    assert torch.equal(q.amax, expect)
    assert tuple(q.amax.shape) == blocks.blocks_shape(shape, blocks.normalize(bs, shape))
    assert torch.equal(q(x1), fake_block_quant(x1, bs, expect, 4, False, False))
    with pytest.raises(ValueError, match="shape changed"):
        q.enable_calib()
        q(_x(shape[0] * 2, shape[1]))


def test_dynamic_blocks_and_double_quant():
    x = _x(4, 16)
    bs = {-1: 8, "type": "dynamic", "scale_bits": 8}
    q = TensorQuantizer(QD(num_bits=4, block_sizes=bs))
    assert q.dynamic
    assert torch.equal(q(x), fake_block_quant(x, bs, None, 4, False, False))
    info = q.export_info()
    assert info["kind"] == "block" and info["amax"] is None and info["block_sizes"][1] == 8


def test_static_block_export_scale_is_double_quantized():
    x = _x(4, 16)
    bs = {-1: 8, "scale_bits": 8}
    q = _calibrate(TensorQuantizer(QD(num_bits=4, block_sizes=bs)), x)
    info = q.export_info()
    from modelopt_lite.tensor_quant import block_scales

    expect, _ = block_scales(x, bs, blocks.block_amax(x, bs), 4)
    assert torch.equal(info["scale"], expect) and info["block_sizes"] == {1: 8, "scale_bits": 8}
    assert torch.equal(q(x), fake_block_quant(x, bs, q.amax, 4, False, False))


def test_histogram_with_blocks_uses_block_max():
    q = _calibrate(TensorQuantizer(QD(num_bits=4, block_sizes={-1: 4}, calib_method="histogram")), _x(2, 8))
    assert q.amax.shape == (2, 2)


# --- E4M3 and real quant -------------------------------------------------------------------------------------------------
def test_e4m3():
    x = _x(8, 8, scale=100.0)
    q = TensorQuantizer(QD(num_bits=(4, 3), amax=2.5))
    assert torch.equal(q(x), scaled_e4m3(x, torch.tensor(2.5)))
    assert q.extra_repr() == "fp8 e4m3 per-tensor amax=2.5 calib=max quant"
    assert q.export_info()["kind"] == "e4m3" and q.export_info()["qmax"] == 448.0


def test_real_quant_returns_codes_and_passes_narrow_range():
    x = torch.tensor([-3.0, -1.0, 0.004, 0.5, 1.0, 2.0])
    wide = TensorQuantizer(QD(fake_quant=False, amax=1.0))
    narrow = TensorQuantizer(QD(fake_quant=False, amax=1.0, narrow_range=True))
    qw, qn = wide(x), narrow(x)
    assert qw.dtype == torch.float32
    assert qw.tolist() == [-128.0, -127.0, 1.0, 64.0, 127.0, 127.0]  # 0.5 * 127 = 63.5 -> 64 (half to even)
    assert qn.tolist() == [-127.0, -127.0, 1.0, 64.0, 127.0, 127.0]  # the pq bug dropped narrow_range here
    assert torch.equal(qn * narrow.scale, fake_tensor_quant(x, 1.0, 8, False, True))
    e = TensorQuantizer(QD(num_bits=(4, 3), fake_quant=False, amax=448.0))
    assert e(torch.tensor([1.06, 500.0])).tolist() == [1.0, 448.0]


def test_quantize_weight_codes():
    w = _x(4, 6)
    q = _calibrate(TensorQuantizer(QD(axis=0)), w)
    codes, scale = q.quantize_weight_codes(w)
    assert codes.dtype == torch.int8 and scale.shape == (4, 1)
    assert torch.equal(codes.float() * scale, q(w))
    u = TensorQuantizer(QD(unsigned=True, amax=1.0))
    assert u.quantize_weight_codes(w.abs())[0].dtype == torch.uint8
    b = _calibrate(TensorQuantizer(QD(num_bits=4, block_sizes={-1: 3})), w)
    bc, bsc = b.quantize_weight_codes(w)
    assert bc.dtype == torch.int8 and bsc.shape == (4, 2) and int(bc.abs().max()) <= 8
    with pytest.raises(RuntimeError, match="no amax"):
        TensorQuantizer(QD(axis=0)).quantize_weight_codes(w)


# --- scale_amax, no mutation ---------------------------------------------------------------------------------------------
def test_scale_amax_does_not_mutate_amax():
    x = _x(5, 5)
    q = TensorQuantizer(QD(amax=2.0, scale_amax=0.5))
    y1, y2 = q(x), q(x)
    assert torch.equal(y1, y2) and q.amax.item() == 2.0
    assert torch.equal(y1, fake_tensor_quant(x, 1.0, 8, False, False))
    assert q.export_info()["amax"].item() == 1.0 and q.amax.item() == 2.0


@pytest.mark.parametrize(
    "desc",
    [
        QD(amax=1.0),
        QD(axis=0),
        QD(dynamic=True),
        QD(num_bits=(4, 3), amax=1.0),
        QD(num_bits=4, block_sizes={-1: 2}),
        QD(fake_quant=False, amax=1.0),
    ],
)
def test_forward_never_mutates_input(desc):
    x = _x(4, 6)
    x_nc = x.t()  # non-contiguous input
    before, before_nc = x.clone(), x_nc.clone()
    q = TensorQuantizer(desc)
    q.enable_calib()
    q.disable_quant()
    q(x)
    q(x_nc.t().contiguous())
    if not desc.dynamic:
        q.load_calib_amax()
    q.enable_quant()
    q(x)
    q.disable_calib()
    q(x)
    TensorQuantizer(QD(amax=1.0))(x_nc)
    assert torch.equal(x, before) and torch.equal(x_nc, before_nc)


def test_export_info_returns_copies():
    q = TensorQuantizer(QD(axis=-1, amax=[[0.0, 1.0, 2.0]]))
    q(torch.zeros(2, 3))
    info = q.export_info()
    assert set(info) >= {
        "kind",
        "num_bits",
        "unsigned",
        "narrow_range",
        "axis",
        "block_sizes",
        "amax",
        "scale",
        "qmin",
        "qmax",
    }
    assert info["axis"] == (1,) and (info["qmin"], info["qmax"]) == (-128, 127) and info["kind"] == "int"
    assert torch.equal(info["scale"], torch.tensor([[1.0, 1 / 127, 2 / 127]]))
    info["amax"][info["amax"] == 0] = 127.0  # the ModelOpt export_amax bug wrote into the live buffer
    assert q.amax[0, 0].item() == 0.0


# --- learnable amax ------------------------------------------------------------------------------------------------------
def test_learn_amax_gets_lsq_gradient():
    q = TensorQuantizer(QD(amax=1.0, learn_amax=True))
    assert isinstance(q._amax, torch.nn.Parameter)
    # the amax, and pytorch-quantization's clip bounds (used only with if_clip / enable_clip(), see _clip_state.py)
    assert [n for n, _ in q.named_parameters()] == ["_amax", "clip.clip_value_min", "clip.clip_value_max"]
    x = torch.tensor([0.3, -2.0, 0.5])
    q(x).sum().backward()
    v = x / (1.0 / 127)
    q_codes = torch.clamp(torch.round(v), -128, 127)
    expect = ((q_codes - v)[[0, 2]].sum() + (-128)) / 127
    assert torch.allclose(q._amax.grad, expect, rtol=0, atol=1e-6)
    assert q.clip.clip_value_max.grad is None  # the clip stage is off


def test_init_learn_amax_per_channel():
    w = _x(3, 4)
    q = _calibrate(TensorQuantizer(QD(axis=0)), w)
    p = q.init_learn_amax()
    assert isinstance(p, torch.nn.Parameter) and p.shape == (3, 1) and q.learn_amax
    w.requires_grad_(True)
    q(w).pow(2).sum().backward()
    assert p.grad is not None and p.grad.shape == (3, 1) and bool((p.grad != 0).any())
    assert w.grad is not None
    q.set_from_attribute_config({"learn_amax": False})
    assert not isinstance(q._amax, torch.nn.Parameter) and q.has_amax


# --- state dict -----------------------------------------------------------------------------------------------------------
def test_state_dict_round_trip_into_fresh_quantizer():
    q = _calibrate(TensorQuantizer(QD(axis=(0, 2))), _x(3, 2, 4))
    sd = q.state_dict()
    assert list(sd) == ["_amax"] and sd["_amax"].shape == (3, 1, 4)
    fresh = TensorQuantizer(QD(axis=(0, 2)))
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.amax, q.amax) and fresh.amax.device.type == "cpu"
    fresh.load_state_dict(sd)  # again, now into an existing buffer
    x = _x(3, 2, 4)
    assert torch.equal(fresh(x), q(x))
    assert TensorQuantizer().state_dict() == {}


def test_state_dict_mis_shaped_names_path_and_shapes():
    parent = torch.nn.Module()
    parent.q = TensorQuantizer(QD(axis=0, amax=[[1.0], [2.0]]))
    with pytest.raises(ValueError, match=re.escape("at 'q'") + r".*shape \(3, 1\).*shape \(2, 1\)"):
        parent.load_state_dict({"q._amax": torch.ones(3, 1)})
    with pytest.raises(ValueError, match="finite"):
        parent.load_state_dict({"q._amax": torch.tensor([[1.0], [-1.0]])})


def test_learnable_state_loads_as_parameter():
    src = TensorQuantizer(QD(amax=1.5))
    dst = TensorQuantizer(QD(learn_amax=True))
    dst.load_state_dict(src.state_dict())
    assert isinstance(dst._amax, torch.nn.Parameter) and dst.amax.item() == 1.5


def test_dtype_moves_keep_amax_float32_exact():
    q = TensorQuantizer(QD(amax=1.0001))
    exact = q.amax.clone()
    q.half()
    assert q.amax.dtype == torch.float32 and torch.equal(q.amax, exact)
    q.to(torch.device("cpu"))
    assert q._device.type == "cpu"


# --- config -------------------------------------------------------------------------------------------------------------
def test_set_from_attribute_config():
    q = TensorQuantizer(QD(amax=1.0), name="m.q")
    with pytest.raises(TypeError, match=r"'m.q'.*'bogus'"):
        q.set_from_attribute_config({"bogus": 1, "num_bits": 4})
    assert q.num_bits == 8  # nothing applied on error
    q.set_from_attribute_config({"narrow_range": True})
    assert q.narrow_range and q.amax.item() == 1.0  # not a format change
    q.set_from_attribute_config({"num_bits": 4})
    assert q.num_bits == 4 and q.has_amax and q.amax.item() == 1.0  # the fixed descriptor amax is kept
    q2 = _calibrate(TensorQuantizer(QD(axis=0)), _x(3, 3))
    q2.set_from_attribute_config({"block_sizes": {-1: 2}})
    assert q2.axis is None and q2.block_sizes == {-1: 2} and not q2.has_amax  # format change resets
    q2.set_from_attribute_config({"enable": False})
    assert not q2.is_enabled
    q2.set_from_attribute_config({"num_bits": (4, 3), "enable": True, "block_sizes": None})
    assert q2.is_enabled and q2.num_bits == (4, 3)
    with pytest.raises(TypeError, match="enable must be a bool"):
        q2.set_from_attribute_config({"enable": "yes"})
    with pytest.raises(ValueError, match="dynamic"):
        q2.set_from_attribute_config({"learn_amax": True, "dynamic": True})
    q3 = TensorQuantizer()
    q3.set_from_attribute_config(QD(num_bits=4, axis=1))
    assert q3.quant_desc == QD(num_bits=4, axis=1)
    q3.set_from_attribute_config({"amax": 2.0})
    assert q3.amax.item() == 2.0


def test_histogram_calibration():
    x = torch.arange(1000, dtype=torch.float32) / 100
    q = _calibrate(TensorQuantizer(QD(calib_method="histogram")), x, method="percentile", percentile=100.0)
    assert type(q.calibrator).__name__ == "HistogramCalibrator"
    assert abs(q.amax.item() - 9.99) < 0.02


def test_extra_repr_compact():
    q = TensorQuantizer(QD(axis=0, amax=[[0.12], [3.4]]))
    assert q.extra_repr() == "8b per-channel(axis=0) amax=[0.12, 3.4](2) calib=max quant"
    t = TensorQuantizer(QD(num_bits=4, unsigned=True, scale_amax=0.5), num_steps=2)
    t.enable_calib()
    assert (
        t.extra_repr() == "4b unsigned per-tensor amax=uncalibrated steps=2(t=0) scale_amax=0.5 calib=max "
        "quant+collecting"
    )


# --- temporal steps -------------------------------------------------------------------------------------------------------
def test_temporal_steps_calibrate_and_quantize_per_step():
    q = TensorQuantizer(QD(axis=0), num_steps=3, name="unet.q")
    q.enable_calib()
    q.disable_quant()
    xs = [_x(2, 4, seed=s, scale=s + 1.0) for s in range(3)]
    for t in range(3):
        q.set_step(t)
        q(xs[t])
    q.load_calib_amax()
    q.disable_calib()
    q.enable_quant()
    assert q._amax.shape == (3, 2, 1)
    for t in range(3):
        q.step = t
        expect = xs[t].abs().amax(1, keepdim=True)
        assert torch.equal(q.amax, expect)
        assert torch.equal(q(xs[0]), fake_tensor_quant(xs[0], expect, 8, False, False))
    with pytest.raises(ValueError, match=r"'unet.q': step 3 is out of range for num_steps=3"):
        q.set_step(3)
    with pytest.raises(ValueError, match="out of range"):
        q.step = -1
    fresh = TensorQuantizer(QD(axis=0), num_steps=3)
    fresh.load_state_dict(q.state_dict())
    fresh.step = 2
    assert torch.equal(fresh.amax, q.amax)


def test_temporal_missing_step():
    q = TensorQuantizer(num_steps=2)
    q.enable_calib()
    q.disable_quant()
    q(torch.tensor([1.0, -3.0]))
    with pytest.raises(RuntimeError, match=r"step\(s\) \[1\]"):
        q.load_calib_amax()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.load_calib_amax(strict=False)
    assert q._amax.tolist() == [3.0, 3.0]
    q.step = 1
    q.amax = 5.0  # the setter writes the current step only
    assert q._amax.tolist() == [3.0, 5.0]
    q.set_from_attribute_config({"num_steps": 4})
    assert q.num_steps == 4 and not q.has_amax and q.step == 1
    q.set_from_attribute_config({"num_steps": 1})
    assert q.step == 0


def test_tensor_quant_real_helper_still_consistent():
    # the module's real-quant path and tensor_quant agree (same narrow_range default handling)
    x = _x(4, 4)
    q = TensorQuantizer(QD(fake_quant=False, amax=2.0))
    assert torch.equal(q(x), tensor_quant(x, 2.0, 8, False, False)[0])
