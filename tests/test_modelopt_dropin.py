"""ModelOpt drop-in gaps found by running ModelOpt's own unit tests against this package (imports changed only):
``modelopt_lite.utils``, ``QuantizerAttributeConfig``, ``postprocess_amax``, the ``model_calib`` entry points,
``SequentialQuantizer.convert_to_single_quantizer``, calibrator classes through ``modelopt_state``, restoring onto
a quantized model, ModelOpt's flat block amax in ``mto`` files, and list-valued ``quant_cfg`` entries end to end."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
import modelopt_lite.opt as mto
from modelopt_lite import model_calib, utils
from modelopt_lite.calib import MaxCalibrator
from modelopt_lite.nn import SequentialQuantizer, TensorQuantizer

W4A8_LIST_CFG = {
    "quant_cfg": {
        "*weight_quantizer": [
            {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "enable": True},
            {"num_bits": 8, "axis": 0, "enable": True},
        ],
        "*input_quantizer": {"num_bits": 8, "enable": True},
    },
    "algorithm": "max",
}


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 16), nn.ReLU(), nn.Linear(16, 4))


def _x() -> torch.Tensor:
    return torch.randn(32, 256, generator=torch.Generator().manual_seed(1))


# --- modelopt_lite.utils ---------------------------------------------------------------------------------------------
def test_utils_reductions_have_modelopts_names_and_values():
    x = torch.tensor([[1.0, -5.0, 2.0, 0.5], [-3.0, 4.0, -7.0, 6.0]])
    assert torch.equal(utils.reduce_amax(x), torch.tensor(7.0)) and utils.reduce_amax(x).dim() == 0
    assert torch.equal(utils.reduce_amax(x, axis=1), torch.tensor([[5.0], [7.0]]))
    assert torch.equal(utils.reduce_amax(x, axis=1, keepdims=False), torch.tensor([5.0, 7.0]))
    assert torch.equal(utils.reduce_amax(x[:1, :1], axis=1), torch.tensor(1.0))  # squeeze_scalar
    assert utils.reduce_amax(x[:1, :1], axis=1, squeeze_scalar=False).shape == (1, 1)
    assert torch.equal(utils.reduce_sum(x, axis=0, keepdims=False), torch.tensor([-2.0, -1.0, -5.0, 6.5]))
    b = utils.reduce_block_amax(x.to(torch.bfloat16), {-1: 2})
    assert b.dtype == torch.bfloat16 and torch.equal(b.float(), torch.tensor([[5.0, 2.0], [4.0, 7.0]]))
    assert utils.convert_quantization_axis_to_reduce_axis(torch.zeros(2, 3, 4), None) is None
    assert utils.convert_quantization_axis_to_reduce_axis(torch.zeros(2, 3, 4), -2) == [0, 2]
    assert utils.convert_quantization_axis_to_reduce_axis(torch.zeros(2, 3, 4, 5), [0, -1]) == [1, 2]
    with pytest.raises(ValueError, match="axis 3 is out of range for a 3-D tensor"):
        utils.reduce_amax(torch.zeros(2, 3, 4), axis=3)
    assert mtq.utils is utils


def test_utils_is_quantized_linear():
    model = mtq.quantize(nn.Sequential(nn.Linear(4, 4), nn.Conv2d(1, 1, 1)), mtq.INT8_DEFAULT_CFG)
    assert utils.is_quantized_linear(model[0]) and not utils.is_quantized_linear(model[1])
    assert utils.is_quantized(model) and not utils.is_quantized(nn.Linear(2, 2))
    assert not utils.is_quantized_linear(nn.Linear(2, 2))


def test_quantizer_attribute_config_and_nvfp4_awq_lite_preset():
    cfg = mtq.QuantizerAttributeConfig(num_bits=4, axis=0)
    assert cfg is not None and cfg == mtq.QuantDescriptor(num_bits=4, axis=0)
    assert TensorQuantizer(cfg).num_bits == 4
    assert mtq.NVFP4_AWQ_LITE_CFG["algorithm"] == "awq_lite"
    assert mtq.NVFP4_AWQ_LITE_CFG["quant_cfg"]["*weight_quantizer"]["num_bits"] == (2, 1)


# --- postprocess_amax ------------------------------------------------------------------------------------------------
def test_postprocess_amax_applies_to_matching_calibrated_quantizers():
    x = _x()
    model = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    w_before = model[0].weight_quantizer.amax.clone()
    assert float(model[0].input_quantizer.amax) > 0.5
    out = mtq.postprocess_amax(model, "*input_quantizer", lambda a: torch.clamp(a, max=0.5))
    assert out is model
    assert torch.equal(model[0].input_quantizer.amax, torch.tensor(0.5))
    assert torch.equal(model[0].weight_quantizer.amax, w_before)
    before = model[2].input_quantizer.amax.clone()
    with pytest.raises(ValueError):
        mtq.postprocess_amax(model, "*input_quantizer", lambda a: -a)
    assert torch.equal(model[2].input_quantizer.amax, before)  # restored
    with pytest.raises(TypeError, match="returned float, not a tensor"):
        mtq.postprocess_amax(model, "*input_quantizer", lambda a: 1.0)


# --- model_calib -----------------------------------------------------------------------------------------------------
def test_weight_only_quantize_calibrates_weights_only():
    model = mtq.replace_quant_modules(_mlp())
    mtq.set_quantizer_by_cfg(model, mtq.INT8_DEFAULT_CFG["quant_cfg"])
    model_calib.weight_only_quantize(model)
    w = model[0].weight.detach()
    assert torch.equal(model[0].weight_quantizer.amax.flatten(), w.abs().amax(1))
    assert model[0].input_quantizer.amax is None


def test_smoothquant_disable_and_reapply():
    x = _x()
    ref = mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    model = mtq.quantize(_mlp(), mtq.INT8_SMOOTHQUANT_CFG, lambda m: m(x))
    with torch.no_grad():
        y_sq = model(x)
    pqs = {i: model[i].input_quantizer.pre_quant_scale.clone() for i in (0, 2)}
    for i in (0, 2):
        model_calib.disable_pre_quant_scale_and_resmooth(model[i])
        assert model[i].input_quantizer.pre_quant_scale is None
        torch.testing.assert_close(model[i].weight, ref[i].weight, rtol=1e-6, atol=1e-7)
        assert torch.equal(model[i].input_quantizer.amax, ref[i].input_quantizer.amax)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    for i in (0, 2):
        model_calib.apply_pre_quant_scale_and_smooth(model[i])
        assert torch.equal(model[i].input_quantizer.pre_quant_scale, pqs[i])
    with torch.no_grad():
        torch.testing.assert_close(model(x), y_sq, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="already has a pre_quant_scale"):
        model_calib.apply_pre_quant_scale_and_smooth(model[0])
    with pytest.raises(ValueError, match="no per-channel input maxima from SmoothQuant"):
        model_calib.disable_pre_quant_scale_and_resmooth(ref[0])


# --- SequentialQuantizer ---------------------------------------------------------------------------------------------
def test_convert_to_single_quantizer_swaps_and_restores():
    x = _x()
    model = mtq.quantize(_mlp(), W4A8_LIST_CFG, lambda m: m(x))
    seqs = [m.weight_quantizer for m in (model[0], model[2])]
    assert all(isinstance(s, SequentialQuantizer) for s in seqs)
    with SequentialQuantizer.convert_to_single_quantizer(model, 1):
        assert model[0].weight_quantizer is seqs[0][1] and model[2].weight_quantizer is seqs[1][1]
    assert model[0].weight_quantizer is seqs[0] and model[2].weight_quantizer is seqs[1]
    with pytest.raises(RuntimeError, match="body"), SequentialQuantizer.convert_to_single_quantizer(model):
        raise RuntimeError("body")
    assert model[0].weight_quantizer is seqs[0]
    with pytest.raises(ValueError, match="has 2 quantizers, no index 2"):
        with SequentialQuantizer.convert_to_single_quantizer(model, 2):
            pass
    assert model[0].weight_quantizer is seqs[0]


def test_list_valued_quant_cfg_end_to_end_with_modelopt_state(tmp_path):
    x = _x()
    model = mtq.quantize(_mlp(), W4A8_LIST_CFG, lambda m: m(x))
    q0, q1 = model[0].weight_quantizer
    assert (q0.num_bits, q0.block_sizes, q1.num_bits, q1.axis) == (4, {-1: 128, "type": "static"}, 8, 0)
    state = mto.modelopt_state(model)
    cfg = state["modelopt_state_dict"][0][1]["config"]
    assert {e["quantizer_name"] for e in cfg["quant_cfg"]} == {"0.weight_quantizer", "2.weight_quantizer"}
    qs = state["modelopt_state_dict"][0][1]["metadata"]["quantizer_state"]
    assert qs["0.weight_quantizer"] == {"num_quantizers": 2, "is_sequential_quantizer": True}
    # ModelOpt's flat block layout in the state and the file: (rows * blocks, 1)
    assert tuple(qs["0.weight_quantizer.0"]["_pytorch_state_metadata"]["buffers"]["_amax"]["shape"]) == (32, 1)
    mto.save(model, tmp_path / "w4a8.pth")
    sd = torch.load(tmp_path / "w4a8.pth", weights_only=True)["model_state_dict"]
    assert sd["0.weight_quantizer.0._amax"].shape == (32, 1)
    assert torch.equal(sd["0.weight_quantizer.0._amax"].flatten(), q0.amax.flatten())
    back = mto.restore(_mlp(), tmp_path / "w4a8.pth")
    assert back[0].weight_quantizer[0].amax.shape == (16, 2)
    fresh = mto.restore_from_modelopt_state(_mlp(), state)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(back(x), model(x)) and torch.equal(fresh(x), model(x))


def test_our_blockwise_and_list_checkpoints_restore_in_modelopt(tmp_path):
    peer_mto = pytest.importorskip("modelopt.torch.opt")
    x = _x()
    for cfg in (mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, W4A8_LIST_CFG):
        model = mtq.quantize(_mlp(), cfg, lambda m: m(x))
        mto.save(model, tmp_path / "m.pth")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peer = peer_mto.restore(_mlp(), tmp_path / "m.pth")
        with torch.no_grad():  # the peer multiplies by a reciprocal on the CPU: float32 rounding apart
            torch.testing.assert_close(peer(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_block_amax_in_modelopts_flat_layout_is_accepted():
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    q = TensorQuantizer(mtq.QuantDescriptor(num_bits=4, block_sizes={-1: 8}))
    amax = w.reshape(-1, 8).abs().amax(1, keepdim=True)  # ModelOpt's (rows * blocks, 1)
    q.amax = amax
    ref = TensorQuantizer(mtq.QuantDescriptor(num_bits=4, block_sizes={-1: 8}))
    ref.amax = amax.reshape(6, 2)
    assert torch.equal(q(w), ref(w))


def test_restoring_onto_a_quantized_model_is_refused():
    x = _x()
    state = mto.modelopt_state(mtq.quantize(_mlp(), mtq.INT8_DEFAULT_CFG, lambda m: m(x)))
    target = mtq.quantize(_mlp(), mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, lambda m: m(x))
    before = str(target)
    for err in (ValueError, AssertionError):  # ours and ModelOpt's
        with pytest.raises(err, match=r"Model already has modelopt state! \(it holds quantizer '0.input_quantizer'"):
            mto.restore_from_modelopt_state(target, state)
    assert str(target) == before


# --- calibrator classes ----------------------------------------------------------------------------------------------
class _DoubleMax(MaxCalibrator):
    def compute_amax(self, method=None, **kwargs):
        return None if self._calib_amax is None else 2 * self._calib_amax


def test_calibrator_class_with_args_only_and_through_modelopt_state(tmp_path):
    x = _x()
    cfg = {"quant_cfg": {"*": {"num_bits": 8, "axis": None, "calibrator": (_DoubleMax, (8, None, False))}}}
    model = mtq.quantize(_mlp(), cfg, lambda m: m(x))
    assert torch.equal(model[0].input_quantizer.amax, 2 * x.abs().amax())
    fresh = mto.restore_from_modelopt_state(_mlp(), mto.modelopt_state(model))
    fresh.load_state_dict(model.state_dict())
    assert type(fresh[0].input_quantizer._calibrator) is _DoubleMax
    with pytest.warns(RuntimeWarning, match="calibrator classes of .* are not written"):
        mto.save(model, tmp_path / "c.pth")
    back = mto.restore(_mlp(), tmp_path / "c.pth")  # loads with weights_only=True: no class in the file
    assert type(back[0].input_quantizer._calibrator) is MaxCalibrator
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
