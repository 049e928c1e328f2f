"""The affine ``bias`` of a TensorQuantizer (ModelOpt 0.47's attribute): ``y = fq(x - b) + b`` in float32, the
bias reduced over the listed axes (mean or (max + min) / 2), calibrated statically with the amax on ``x - b``, or
computed per call; validation, state_dict, and the standalone peer quantizer for comparison."""

import copy

import pytest
import torch

import modelopt_lite as mtq
from modelopt_lite.calib.bias import BiasCalibrator, compute_bias
from modelopt_lite.conversion.config import QuantConfigError
from modelopt_lite.functional import microscaling, reference
from modelopt_lite.nn import TensorQuantizer

KV_BIAS = {-2: None, -4: None, "type": "static"}


def _fp8(bias=KV_BIAS, name="kq", **extra):
    q = TensorQuantizer(name=name)
    q.set_from_attribute_config({"num_bits": (4, 3), "axis": None, "bias": bias, **extra})
    return q


def _kv(seed, n=5, shift=True):
    """[batch, heads, seq, head_dim] keys with a per-channel offset (what the bias is for)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, n, 4, generator=g) * 0.5
    return x + torch.tensor([3.0, -1.0, 0.25, 8.0]) if shift else x


def _calibrate(q, batches):
    q.enable_calib()
    q.disable_quant()
    for x in batches:
        assert torch.equal(q(x), x)  # quantization off while collecting
    q.load_calib_amax()
    q.disable_calib()
    q.enable_quant()


def _by_hand_mean(x):
    """bias[h, d] = mean over batch and sequence of x[:, h, :, d], in float64 (the definition)."""
    b = torch.zeros(1, x.shape[1], 1, x.shape[3], dtype=torch.float64)
    for h in range(x.shape[1]):
        for d in range(x.shape[3]):
            b[0, h, 0, d] = x[:, h, :, d].double().sum() / (x.shape[0] * x.shape[2])
    return b


# --- calibration and numerics from first principles --------------------------------------------------------------------
def test_static_mean_bias_and_amax_from_first_principles():
    q = _fp8()
    x1, x2 = _kv(1, 5), _kv(2, 7)
    _calibrate(q, [x1, x2])
    m1 = x1.mean(dim=(0, 2), keepdim=True)
    m2 = x2.mean(dim=(0, 2), keepdim=True)
    b = (m1 * 1 + m2) / 2  # ModelOpt's running average of the per-batch means (each batch weighs the same)
    assert q.bias_value.dtype == torch.float32 and q.bias_value.shape == (1, 3, 1, 4)
    assert torch.equal(q.bias_value, b)
    assert torch.allclose(m1.double(), _by_hand_mean(x1), rtol=0, atol=1e-6)  # kept: heads and channels
    # the amax calibrator saw x - (bias so far) for each batch, as ModelOpt's collect() does
    assert torch.equal(q.amax, torch.maximum((x1 - m1).abs().amax(), (x2 - b).abs().amax()))
    x = _kv(3, 9)
    y = q(x)
    assert y.dtype == torch.float32 and torch.equal(y, reference.fake_e4m3(x - b, q.amax / 448.0) + b)
    assert not torch.equal(y, x)
    # the bias pays off: far smaller error than FP8 per tensor without it (channel offsets up to 8)
    plain = reference.fake_e4m3(x, x.abs().amax() / 448.0)
    assert (y - x).abs().max() < (plain - x).abs().max() / 4


def test_static_max_min_bias():
    q = _fp8({-2: None, -4: None, "type": "static", "method": "max_min"})
    x1, x2 = _kv(4), _kv(5, 3)
    _calibrate(q, [x1, x2])
    hi = torch.maximum(x1.amax(dim=(0, 2), keepdim=True), x2.amax(dim=(0, 2), keepdim=True))
    lo = torch.minimum(x1.amin(dim=(0, 2), keepdim=True), x2.amin(dim=(0, 2), keepdim=True))
    b = (hi + lo) / 2
    assert torch.equal(q.bias_value, b)
    b1 = (x1.amax(dim=(0, 2), keepdim=True) + x1.amin(dim=(0, 2), keepdim=True)) / 2
    assert torch.equal(q.amax, torch.maximum((x1 - b1).abs().amax(), (x2 - b).abs().amax()))
    x = _kv(6)
    assert torch.equal(q(x), reference.fake_e4m3(x - b, q.amax / 448.0) + b)


def test_modelopt_names_of_the_bias_calibrator():
    """ModelOpt's ``quantizer._bias_calibrator._calib_bias`` (its users and tests read it): the collected bias."""
    q = _fp8({-2: None, -4: None, "type": "static", "method": "max_min"})
    assert q._bias_calibrator is not None and q._bias_calibrator._calib_bias is None  # nothing collected yet
    _calibrate(q, [_kv(4), _kv(5, 3)])
    assert isinstance(q._bias_calibrator, BiasCalibrator)
    assert q._bias_calibrator._calib_bias.shape == (1, 3, 1, 4)
    assert torch.equal(q._bias_calibrator._calib_bias, q.bias_value)
    assert _fp8({-2: None, -4: None, "type": "dynamic"})._bias_calibrator is None
    assert TensorQuantizer(name="plain")._bias_calibrator is None


@pytest.mark.parametrize("method", ["mean", "max_min"])
def test_dynamic_bias_is_computed_per_call_and_never_stored(method):
    q = _fp8({-2: None, -4: None, "type": "dynamic", "method": method})
    q.amax = 3.0
    for seed in (7, 8):
        x = _kv(seed)
        if method == "mean":
            b = x.mean(dim=(0, 2), keepdim=True)
        else:
            b = (x.amax(dim=(0, 2), keepdim=True) + x.amin(dim=(0, 2), keepdim=True)) / 2
        assert torch.equal(q(x), reference.fake_e4m3(x - b, torch.tensor(3.0) / 448.0) + b)
    assert q.bias_value is None and "_bias_value" not in q.state_dict()
    _calibrate(q, [_kv(9)])  # calibration loads the amax only
    assert q.bias_value is None


def test_uncalibrated_static_bias_uses_each_inputs_own():
    q = _fp8()
    x = _kv(10)
    b = x.mean(dim=(0, 2), keepdim=True)
    a = (x - b).abs().amax()  # an uncalibrated amax is the input's own too: of x - b
    assert torch.equal(q(x), reference.fake_e4m3(x - b, a / 448.0) + b)
    assert q.bias_value is None


def test_int8_per_channel_and_fp16_input():
    q = TensorQuantizer(name="iq")
    q.set_from_attribute_config({"num_bits": 8, "axis": (-1,), "bias": {0: None}})
    x = _kv(11).reshape(-1, 4)
    _calibrate(q, [x])
    b = x.mean(dim=0, keepdim=True)
    assert q.bias_value.shape == (1, 4) and torch.equal(q.bias_value, b)
    assert q.amax.shape == (1, 4) and torch.equal(q.amax, (x - b).abs().amax(dim=0, keepdim=True))
    assert torch.equal(q(x), reference.fake_quant_int(x - b, q.amax / 127.0, -127, 127) + b)
    xh = x.half()
    y = q(xh)
    assert y.dtype == torch.float16
    assert torch.equal(y, (reference.fake_quant_int(xh.float() - b, q.amax / 127.0, -127, 127) + b).half())
    q.half()
    assert q.bias_value.dtype == torch.float32  # stays float32, as the amax does


def test_nvfp4_bias_applied():
    q = TensorQuantizer(name="nq")
    q.set_from_attribute_config(
        {
            "num_bits": (2, 1),
            "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
            "axis": None,
            "bias": KV_BIAS,
        }
    )
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 2, 5, 16, generator=g) + torch.linspace(-4, 4, 16)
    _calibrate(q, [x])
    b = x.mean(dim=(0, 2), keepdim=True)
    assert torch.equal(q.bias_value, b) and torch.equal(q.amax, (x - b).abs().amax())
    want = microscaling.fake_nvfp4(x - b, microscaling.nvfp4_global_scale(q.amax), 16) + b
    assert torch.equal(q(x), want)


def test_gradient_passes_through_the_bias():
    q = _fp8()
    x = _kv(13).requires_grad_(True)
    q(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # inside the range: straight through


def test_real_quant_returns_codes_of_x_minus_b():
    q = _fp8(fake_quant=False)
    x = _kv(14)
    q.amax = 4.0
    q.bias_value = x.mean(dim=(0, 2), keepdim=True)
    codes = q(x)
    assert torch.equal(codes * q.scale + q.bias_value, reference.fake_e4m3(x - q.bias_value, q.scale) + q.bias_value)
    with pytest.raises(ValueError, match="'kq': a quantizer with an affine bias has no weight codes"):
        q.quantize_weight_codes(x)


# --- configuration and validation ------------------------------------------------------------------------------------------
def test_config_forms():
    q = _fp8({-2: None, -4: None})
    assert q.bias == {-2: None, -4: None, "type": "static", "method": "mean"}
    assert q.bias_axis == (-2, -4) and q.bias_type == "static" and q.bias_method == "mean"
    q.set_from_attribute_config({"bias": {"enable": False}})
    assert q.bias is None and q.bias_type is None
    q.set_from_attribute_config({"bias": {1: None, "type": "dynamic", "method": "max_min", "enable": True}})
    assert q.bias == {1: None, "type": "dynamic", "method": "max_min"}
    assert "bias(axes=(1,), max_min, dynamic)" in repr(q)
    q.set_from_attribute_config({"bias": None})
    assert q.bias is None and "bias" not in repr(q)


def test_changing_the_bias_config_or_format_drops_the_calibrated_bias():
    q = _fp8()
    _calibrate(q, [_kv(15)])
    assert q.bias_value is not None
    q.set_from_attribute_config({"bias": dict(KV_BIAS)})  # the same config: kept
    assert q.bias_value is not None
    q.set_from_attribute_config({"bias": {-2: None, "type": "static"}})
    assert q.bias_value is None
    _calibrate(q, [_kv(15)])
    q.set_from_attribute_config({"num_bits": 8})  # a format change resets the calibration, bias included
    assert q.bias_value is None and q.amax is None
    _calibrate(q, [_kv(15)])
    q.reset_amax()
    assert q.bias_value is None


@pytest.mark.parametrize(
    "bias, err, match",
    [
        ("mean", TypeError, r"'kq': bias must be None or a dict"),
        ({"type": "static"}, ValueError, r"'kq': bias .* names no axis"),
        ({-2: None, "type": "sometimes"}, ValueError, r"'kq': bias type must be one of .*'sometimes'"),
        ({-2: None, "method": "median"}, ValueError, r"'kq': bias method must be one of .*'median'"),
        ({"axis": (-1,)}, ValueError, r"'kq': unknown bias key 'axis'.*int keys"),
        ({1.5: None}, ValueError, r"'kq': bias axis 1.5 is not an int"),
        ({True: None}, ValueError, r"'kq': bias axis True is not an int"),
        ({-2: 3}, ValueError, r"'kq': bias axis -2 maps to 3"),
        ({-2: None, "enable": "yes"}, ValueError, r"'kq': bias\['enable'\] must be a bool"),
    ],
)
def test_bad_bias_configs(bias, err, match):
    q = TensorQuantizer(name="kq")
    with pytest.raises(err, match=match):
        q.set_from_attribute_config({"num_bits": (4, 3), "bias": bias})
    assert q.bias is None and q.num_bits == 8  # nothing changed


def test_bad_bias_in_a_quant_cfg_names_the_entry():
    with pytest.raises(QuantConfigError, match=r"quant_cfg\['\*\[kv\]_bmm_quantizer'\]: bias method"):
        mtq.quantize(torch.nn.Linear(2, 2), {"quant_cfg": {"*[kv]_bmm_quantizer": {"bias": {-2: None, "method": 1}}}})


def test_bias_and_temporal_steps_do_not_mix():
    with pytest.raises(ValueError, match=r"'kq': an affine bias cannot be combined with num_steps=3"):
        _fp8(num_steps=3)
    q = _fp8()
    with pytest.raises(ValueError, match="num_steps=2"):
        q.set_from_attribute_config({"num_steps": 2})
    assert q.num_steps == 1 and q.bias is not None


def test_bad_axes_and_inputs_name_the_quantizer():
    q = _fp8({-5: None})
    with pytest.raises(ValueError, match=r"'kq': bias axis -5 is out of range for an input of rank 4"):
        q(_kv(16))
    q = _fp8({1: None, -3: None})
    with pytest.raises(ValueError, match=r"'kq': bias axes \(1, -3\) name the same dimension twice"):
        q(_kv(16))
    q = _fp8({-2: None, "type": "dynamic"})
    x = _kv(16)
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="'kq': the input contains NaN or Inf, so its bias is not finite"):
        q(x)
    q = _fp8()
    q.enable_calib()
    with pytest.raises(ValueError, match="'kq': the input contains NaN or Inf"):
        q(x)
    q = _fp8()
    _calibrate(q, [_kv(17)])
    with pytest.raises(ValueError, match=r"'kq': the stored bias of shape \(1, 3, 1, 4\) does not fit an input"):
        q(torch.zeros(2, 5, 3, 4))
    q = _fp8()
    q.enable_calib()
    q(_kv(18))
    with pytest.raises(ValueError, match=r"'kq': bias shape changed from \(1, 3, 1, 4\) to \(1, 2, 1, 4\)"):
        q(torch.zeros(2, 2, 3, 4))


def test_bias_value_setter_validates():
    q = _fp8()
    with pytest.raises(ValueError, match=r"'kq': the bias value must be finite, got nan"):
        q.bias_value = torch.full((1, 3, 1, 4), float("nan"))
    with pytest.raises(ValueError, match=r"'kq': the bias value must be finite, got inf"):
        q.bias_value = torch.full((1, 3, 1, 4), float("inf"))
    with pytest.raises(ValueError, match=r"'kq': bias value of shape \(2, 3, 1, 4\) does not fit: the reduced"):
        q.bias_value = torch.zeros(2, 3, 1, 4)
    with pytest.raises(ValueError, match=r"'kq': bias value of shape \(\) does not fit: .* got a scalar"):
        q.bias_value = torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"'kq': the bias value must be a floating-point tensor"):
        q.bias_value = torch.zeros(1, 3, 1, 4, dtype=torch.int32)
    q.bias_value = torch.ones(1, 3, 1, 4, dtype=torch.float64)
    assert q.bias_value.dtype == torch.float32
    with pytest.raises(ValueError, match=r"'kq': new bias value has shape \(1, 2, 1, 4\)"):
        q.bias_value = torch.ones(1, 2, 1, 4)
    plain = TensorQuantizer(name="p")
    with pytest.raises(ValueError, match="'p': .* the quantizer has no bias configured"):
        plain.bias_value = torch.ones(1, 3, 1, 4)
    dyn = _fp8({-2: None, "type": "dynamic"})
    with pytest.raises(ValueError, match="a dynamic bias stores no value"):
        dyn.bias_value = torch.ones(1, 3, 1, 4)


def test_state_dict_round_trip_and_corrupted_bias():
    q = _fp8()
    _calibrate(q, [_kv(19)])
    sd = q.state_dict()
    assert set(sd) == {"_amax", "_bias_value"}
    fresh = _fp8()
    fresh.load_state_dict(sd)
    x = _kv(20)
    assert torch.equal(fresh.bias_value, q.bias_value) and torch.equal(fresh(x), q(x))
    bad = {k: v.clone() for k, v in sd.items()}
    bad["_bias_value"][0, 1, 0, 2] = float("nan")
    with pytest.raises(ValueError, match=r"'kq' at '<root>': the bias value must be finite, got nan"):
        _fp8().load_state_dict(bad)
    bad["_bias_value"] = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match=r"bias value of shape \(1, 3, 2, 4\) does not fit"):
        _fp8().load_state_dict(bad)
    with pytest.raises(ValueError, match="the quantizer has no bias configured"):
        TensorQuantizer(name="kq").load_state_dict(sd)


def test_bias_does_not_depend_on_the_inputs_strides():
    """K/V reach the quantizer as strided views (transposed, heads expanded for grouped-query attention); the mean
    is taken on a contiguous copy, so the bias is the same bits whatever the layout."""
    g = torch.Generator().manual_seed(25)
    base = torch.randn(2, 1, 7, 16, generator=g) * 0.1 + 0.3
    views = [base.expand(2, 4, 7, 16), base.repeat(1, 4, 1, 1).transpose(-1, -2).contiguous().transpose(-1, -2)]
    want = compute_bias(base.repeat(1, 4, 1, 1).contiguous(), (-2, -4))
    for v in views:
        assert torch.equal(compute_bias(v, (-2, -4)), want)
        q = _fp8()
        _calibrate(q, [v])
        assert torch.equal(q.bias_value, want)


def test_bias_calibrator_directly():
    cal = BiasCalibrator("mean", (0,))
    assert cal.compute_bias() is None and cal.num_collected == 0
    x = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    assert torch.equal(cal.collect(x), torch.tensor([[2.0, 4.0]]))
    assert torch.equal(cal.collect(torch.zeros(3, 2)), torch.tensor([[1.0, 2.0]]))
    cal.reset()
    assert cal.compute_bias() is None
    assert torch.equal(compute_bias(x, (0, 1), "max_min"), torch.tensor([[3.5]]))
    with pytest.raises(ValueError, match="bias method must be one of"):
        BiasCalibrator("median", (0,))
    with pytest.raises(ValueError, match="empty tensor"):
        compute_bias(torch.zeros(0, 2), (0,))


# --- the peer's standalone quantizer (CPU: FP8 runs through its pure-torch fp8_eager) -----------------------------------
@pytest.mark.parametrize("method", ["mean", "max_min"])
def test_bias_and_amax_equal_the_peers(method):
    peer = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.tensor_quant import fp8_eager

    bias = {-2: None, -4: None, "type": "static", "method": method}
    theirs = peer.nn.TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None, bias=copy.deepcopy(bias)))
    ours = _fp8(bias)
    batches = [_kv(21, 5), _kv(22, 6), _kv(23, 9)]
    _calibrate(ours, batches)
    theirs.enable_calib()
    theirs.disable_quant()
    for x in batches:
        theirs(x)
    theirs.load_calib_amax()
    theirs.load_calib_bias()
    theirs.enable_quant()
    theirs.disable_calib()
    assert torch.equal(ours.bias_value, theirs._bias_value)
    assert torch.equal(ours.amax, theirs._amax.float())
    x = _kv(24, 17)
    b, amax = ours.bias_value, ours.amax
    with torch.no_grad():
        y_theirs = theirs(x)
    # the same affine function: the peer's FP8 multiplies by 448/amax (our scale divides: the contract), so
    # compare each with its own FP8 of x - b, for the same b and amax
    assert torch.equal(y_theirs, fp8_eager(x - b, amax) + b)
    assert torch.equal(ours(x), reference.fake_e4m3(x - b, amax / 448.0) + b)


def test_histogram_calibration_sees_x_minus_b():
    q = _fp8()
    x = _kv(26, 40)
    with mtq.calibrate(q, {"method": "percentile", "percentile": 100.0}):
        q(x)
    b = x.mean(dim=(0, 2), keepdim=True)
    assert q.quant_desc.calib_method == "histogram" and torch.equal(q.bias_value, b)
    # the histogram's 100th percentile is max |x - b| to within its bin width (and far below max |x| ~ 9)
    m = (x - b).abs().max()
    assert 0.99 * m < q.amax < 1.01 * m and x.abs().max() > 4 * m


def test_fake2real_refuses_an_input_bias():
    from modelopt_lite.real import fake2real

    lin = torch.nn.Sequential(torch.nn.Linear(4, 3))
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"bias": {0: None}}}}
    x = torch.randn(5, 4)
    m = mtq.quantize(lin, {**cfg, "algorithm": "max"}, lambda mm: mm(x))
    assert m[0].input_quantizer.bias_value.shape == (1, 4)
    with pytest.raises(ValueError, match=r"fake2real: module '0': input_quantizer has an affine bias"):
        fake2real(m, inplace=False)
