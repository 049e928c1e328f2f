"""ModelOpt 0.47's FP8_PER_CHANNEL_PER_TOKEN_CFG and FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG presets, and need_calibration."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.conversion.config import QuantConfigError
from modelopt_lite.presets import PRESETS

E4M3_MAX = torch.tensor(448.0)


def _fp8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The contract: scale = float32(amax) / 448 (true division), q = E4M3(x / scale) (round half to even)."""
    scale = amax.float() / E4M3_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def _linear(cin=200, cout=300):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(cin, cout), nn.ReLU(), nn.Linear(cout, 10)).eval()


def test_per_channel_per_token_quantizes_weights_per_row_and_inputs_per_token():
    cfg = mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG
    assert mtq.need_calibration(cfg) is False
    model = mtq.quantize(_linear(), cfg)  # nothing to calibrate from data: no forward_loop
    lin = model[0]
    wq, iq = lin.weight_quantizer, lin.input_quantizer
    assert wq.quant_desc.num_bits == (4, 3) and wq.quant_desc.axis == 0 and not wq.dynamic
    w_amax = lin.weight.detach().abs().amax(1, keepdim=True)
    assert torch.equal(wq.amax, w_amax) and wq.amax.dtype == torch.float32
    assert iq.dynamic and iq.quant_desc.num_bits == (4, 3)
    with pytest.raises(RuntimeError, match="is dynamic: its amax is recomputed from every input"):
        _ = iq.amax
    x = torch.randn(3, 5, 200)
    x[1, 2] *= 50.0  # one loud token: per-token scales keep the others fine
    with torch.no_grad():
        assert torch.equal(iq(x), _fp8(x, x.abs().amax(-1, keepdim=True)))
        assert torch.equal(wq(lin.weight), _fp8(lin.weight, w_amax))
        y = model(x)
    assert y.shape == (3, 5, 10) and y.dtype == torch.float32
    assert not model[0].output_quantizer.is_enabled


def test_per_channel_per_token_convtranspose_weights_are_per_output_channel():
    model = mtq.quantize(nn.Sequential(nn.ConvTranspose2d(4, 6, 3)), mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG)
    wq = model[0].weight_quantizer
    assert wq.quant_desc.axis == mtq.presets.CONVTRANSPOSE_WEIGHT_AXIS == 1
    assert wq.amax.shape == (1, 6, 1, 1)


def test_2d_blockwise_weight_only_blocks_of_128_by_128():
    cfg = mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG
    assert cfg["quant_cfg"]["*weight_quantizer"]["block_sizes"] == {-1: 128, -2: 128}
    assert mtq.need_calibration(cfg) is False
    model = mtq.quantize(_linear(200, 300), cfg)
    lin = model[0]
    assert not lin.input_quantizer.is_enabled and not lin.output_quantizer.is_enabled
    w = lin.weight.detach()  # (300, 200): 3 x 2 blocks, the last row/column blocks partial (44 rows, 72 columns)
    ref_amax = torch.stack(
        [torch.stack([w[r : r + 128, c : c + 128].abs().amax() for c in (0, 128)]) for r in (0, 128, 256)]
    )
    amax = lin.weight_quantizer.amax
    assert amax.numel() == 6 and torch.equal(amax.reshape(3, 2), ref_amax)
    expect = torch.empty_like(w)
    for i, r in enumerate((0, 128, 256)):
        for j, c in enumerate((0, 128)):
            expect[r : r + 128, c : c + 128] = _fp8(w[r : r + 128, c : c + 128], ref_amax[i, j])
    with torch.no_grad():
        assert torch.equal(lin.weight_quantizer(lin.weight), expect)


def test_new_presets_are_in_the_table_with_modelopts_disabled_entries():
    for name in ("FP8_PER_CHANNEL_PER_TOKEN_CFG", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"):
        cfg = PRESETS[name]
        assert getattr(mtq, name) is cfg and cfg["algorithm"] == "max"
        assert cfg["quant_cfg"]["default"] == {"enable": False} and cfg["quant_cfg"]["*lm_head*"] == {"enable": False}


EXPECTED = {  # ModelOpt 0.47's need_calibration on its presets of these names (MX: see the next test)
    "FP8_DEFAULT_CFG": True,
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": False,
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": False,
    "INT4_AWQ_CFG": True,
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": False,
    "INT8_DEFAULT_CFG": True,
    "INT8_SMOOTHQUANT_CFG": True,
    "NVFP4_DEFAULT_CFG": True,
    "NVFP4_AWQ_LITE_CFG": True,
    "NVFP4_SVDQUANT_DEFAULT_CFG": True,
    "W4A16_NVFP4_CFG": False,
    "W4A8_AWQ_BETA_CFG": True,
    "W4A8_NVFP4_FP8_CFG": True,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_need_calibration_matches_modelopt(name):
    assert mtq.need_calibration(PRESETS[name]) is EXPECTED[name]


def test_need_calibration_mx_is_dynamic_and_rules():
    for name in ("MXFP8_DEFAULT_CFG", "MXFP4_DEFAULT_CFG", "MXINT8_DEFAULT_CFG"):  # ModelOpt: True (reads "type" only)
        assert mtq.need_calibration(PRESETS[name]) is False, name
    w_only = {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 8, "axis": 0}}}
    assert mtq.need_calibration(w_only) is False  # weights are calibrated from themselves
    assert mtq.need_calibration({**w_only, "algorithm": "gptq"}) is True  # any algorithm but max reads data
    assert mtq.need_calibration({**w_only, "algorithm": [{"method": "max"}, "local_hessian"]}) is True
    act = copy.deepcopy(w_only)
    act["quant_cfg"]["*input_quantizer"] = {"num_bits": 8, "axis": None}
    assert mtq.need_calibration(act) is True
    act["quant_cfg"]["*input_quantizer"]["type"] = "dynamic"  # ModelOpt's spelling of dynamic
    assert mtq.need_calibration(act) is False
    act["quant_cfg"]["*output_quantizer"] = [{"num_bits": 4, "dynamic": True}, {"num_bits": 8}]  # a sequence
    assert mtq.need_calibration(act) is True
    listed = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8}}], "algorithm": None}  # fmt: skip
    assert mtq.need_calibration(listed) is True
    listed["quant_cfg"][1]["enable"] = False
    assert mtq.need_calibration(listed) is False


def test_need_calibration_rejects_bad_configs():
    with pytest.raises(QuantConfigError, match="config must be a dict, got list"):
        mtq.need_calibration([])
    with pytest.raises(QuantConfigError, match="'type' must be 'static' or 'dynamic', got 'sometimes'"):
        mtq.need_calibration({"quant_cfg": {"*input_quantizer": {"type": "sometimes"}}})
