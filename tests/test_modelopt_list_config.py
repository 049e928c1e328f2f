"""ModelOpt 0.47's list form of ``quant_cfg`` (``[{"quantizer_name": ..., "cfg": ..., "enable": ...,
"parent_class": ...}, ...]``) means what the equivalent dict form means."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.conversion.config import QuantConfigError

LIST_INT8 = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None}},
        {"quantizer_name": "*lm_head*", "enable": False},
        {"quantizer_name": "*", "parent_class": "nn.BatchNorm2d", "enable": False},
    ],
    "algorithm": "max",
}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def test_list_form_equals_the_dict_form():
    x = torch.randn(4, 3, 8, 8)
    a = mtq.quantize(_net().eval(), copy.deepcopy(LIST_INT8), lambda m: m(x))
    b = mtq.quantize(_net().eval(), mtq.INT8_DEFAULT_CFG, lambda m: m(x))
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    assert a[0].weight_quantizer.is_enabled and a[0].weight_quantizer.amax.shape == (8, 1, 1, 1)
    assert not any(q.is_enabled for _, q in mtq.conversion.named_quantizers(a[1]))  # parent_class entry


def test_list_form_of_the_installed_peer_presets():
    peer = pytest.importorskip("modelopt.torch.quantization")
    x = torch.randn(4, 3, 8, 8)
    for name in ("INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "MXFP8_DEFAULT_CFG"):
        cfg = getattr(peer, name)
        assert isinstance(cfg["quant_cfg"], list)
        a = mtq.quantize(_net().eval(), cfg, lambda m: m(x))
        b = mtq.quantize(_net().eval(), getattr(mtq, name), lambda m: m(x))
        with torch.no_grad():
            assert torch.equal(a(x), b(x)), name


@pytest.mark.parametrize(
    "entry,match",
    [
        ("x", r"quant_cfg\[0\]: a list entry must be a dict"),
        ({"cfg": {}}, r"quant_cfg\[0\]: 'quantizer_name' must be a non-empty pattern, got None"),
        ({"quantizer_name": "*", "bogus": 1}, r"quant_cfg\[0\]: unknown key\(s\) \['bogus'\]"),
        ({"quantizer_name": "*", "cfg": 3}, r"quant_cfg\[0\]: 'cfg' must be a dict or a list of dicts, got 3"),
        (
            {"quantizer_name": "*", "cfg": {"num_bitz": 8}},
            r"quant_cfg\[0: '\*'\]: unknown quantizer attribute 'num_bitz'",
        ),
    ],
)
def test_bad_list_entries(entry, match):
    with pytest.raises(QuantConfigError, match=match):
        mtq.quantize(_net(), {"quant_cfg": [entry], "algorithm": "max"})
