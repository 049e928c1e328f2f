"""modelopt_lite.quantize: registry, instance-level conversion, config validation and pattern rules, presets."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.conversion import config as C
from modelopt_lite.conversion.config import QuantConfigError, normalize_config
from modelopt_lite.conversion.registry import QuantModuleRegistry, registered
from modelopt_lite.conversion.utils import named_quantizers


# --- config validation (no model needed) ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_every_preset_validates(name):
    cfg = normalize_config(C.PRESETS[name])
    assert cfg.rules[0].label == "'default'" and cfg.rules[0].attrs == {"enable": False}
    labels = [r.label for r in cfg.rules]
    # the default-disabled entries come last, so they win over the enabling patterns
    assert labels[-1] == "'*mlp.gate.*'" and "'nn.BatchNorm2d']['*'" in labels and "'*lm_head*'" in labels
    assert cfg.algorithm[0] in ("max", "percentile")


def test_preset_contents():
    w = C.INT8_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"]
    assert w == {"num_bits": 8, "axis": 0, "calib_method": "max", "enable": True}
    assert C.INT8_DEFAULT_CFG["quant_cfg"]["nn.ConvTranspose2d"]["*weight_quantizer"]["axis"] == 1
    assert C.INT8_HISTOGRAM_CFG["quant_cfg"]["*input_quantizer"]["calib_method"] == "histogram"
    assert C.INT8_HISTOGRAM_CFG["algorithm"] == {"method": "percentile", "percentile": 99.99}
    assert C.FP8_DEFAULT_CFG["quant_cfg"]["*input_quantizer"]["num_bits"] == (4, 3)
    w4 = C.INT4_BLOCKWISE_WEIGHT_ONLY_CFG["quant_cfg"]
    assert w4["*weight_quantizer"]["block_sizes"] == {-1: 128} and w4["*input_quantizer"] == {"enable": False}
    assert C.W4A8_CFG["quant_cfg"]["*input_quantizer"]["num_bits"] == 8
    ort = C.INT8_ORT_CFG["quant_cfg"]
    assert ort["nn.Conv2d"]["*output_quantizer"]["enable"] is True
    assert ort["nn.Linear"]["*output_quantizer"]["num_bits"] == 8
    assert "*output_quantizer" not in C.INT8_DEFAULT_CFG["quant_cfg"]


@pytest.mark.parametrize("config, message", [
    ([], r"config must be a dict"),
    ({"quant_cfg": {}, "algo": "max"}, r"config has unknown key\(s\) \['algo'\]"),
    ({"quant_cfg": []}, r"config\['quant_cfg'\] must be a dict"),
    ({"quant_cfg": {"*weight_quantizer": 8}}, r"quant_cfg\['\*weight_quantizer'\]: attributes must be a dict, got int"),
    ({"quant_cfg": {"*weight_quantizer": [{"num_bits": 4}, {"num_bits": 8}]}}, r"sequential quantizers"),
    ({"quant_cfg": {"*weight_quantizer": {"num_bit": 8}}},
     r"quant_cfg\['\*weight_quantizer'\]: unknown quantizer attribute 'num_bit'"),
    ({"quant_cfg": {"nn.Conv2d": {"*input_quantizer": {"axes": 0}}}},
     r"quant_cfg\['nn.Conv2d'\]\['\*input_quantizer'\]: unknown quantizer attribute 'axes'"),
    ({"quant_cfg": {"default": {"enable": 1}}}, r"quant_cfg\['default'\]: 'enable' must be a bool, got 1"),
    ({"quant_cfg": {"*x": {"num_steps": 0}}}, r"'num_steps' must be an int >= 1, got 0"),
    ({"quant_cfg": {"nn.Conv9d": {"*": {"enable": False}}}}, r"torch.nn has no module class 'Conv9d'"),
    ({"quant_cfg": {"nn.Conv2d": {}}}, r"a class key needs a non-empty dict"),
    ({"quant_cfg": {nn.Conv2d: {"enable": False}}}, r"quant_cfg\[Conv2d\]\['enable'\]: attributes must be a dict"),
    ({"quant_cfg": {5: {"enable": False}}}, r"quant_cfg key must be a pattern string"),
    ({"quant_cfg": {"": {"enable": False}}}, r"empty pattern"),
    ({"quant_cfg": {}, "algorithm": "minmax"}, r"unknown calibration method 'minmax'"),
    ({"quant_cfg": {}, "algorithm": {"percentile": 99}}, r"algorithm dict needs a 'method' key"),
    ({"quant_cfg": {}, "algorithm": {"method": "max", "percentile": 99}},
     r"method 'max' got unknown parameter\(s\) \['percentile'\]; allowed: none"),
    ({"quant_cfg": {}, "algorithm": {"method": "percentile", "percentile": 150}},
     r"percentile must be a number in \(0, 100\], got 150"),
    ({"quant_cfg": {}, "algorithm": {"method": "entropy", "stride": 0}}, r"stride must be an int >= 1, got 0"),
    ({"quant_cfg": {}, "algorithm": 3}, r"algorithm must be None, a method name or a dict"),
])
def test_malformed_config_raises_value_error_saying_what(config, message):
    with pytest.raises(ValueError, match=message):
        normalize_config(config)


def test_unknown_attribute_is_also_a_type_error():
    with pytest.raises(TypeError, match="unknown quantizer attribute 'bits'"):
        normalize_config({"quant_cfg": {"*": {"bits": 8}}})


def test_normalize_never_mutates_and_completes_granularity():
    cfg = {"quant_cfg": {"*w": {"num_bits": 4, "block_sizes": {-1: 64}}, "*a": {"axis": 1}},
           "algorithm": {"method": "entropy", "start_bin": 64}}
    before = copy.deepcopy(cfg)
    n = normalize_config(cfg)
    assert cfg == before
    assert n.rules[0].attrs == {"num_bits": 4, "block_sizes": {-1: 64}, "axis": None}
    assert n.rules[1].attrs == {"axis": 1, "block_sizes": None}
    assert n.algorithm == ("entropy", {"start_bin": 64})
    n.rules[0].attrs["block_sizes"][-1] = 7
    assert cfg["quant_cfg"]["*w"]["block_sizes"] == {-1: 64}  # deep-copied
    assert normalize_config({"quant_cfg": {}}).algorithm == ("max", {})
    assert normalize_config({"quant_cfg": {}, "algorithm": None}).algorithm is None


def test_rule_matching():
    rules = normalize_config({"quant_cfg": {
        "*fc*": {"enable": False},
        "nn.Conv2d": {"*input_quantizer": {"num_bits": 4}},
        "Block": {"*": {"num_bits": 6}},
        (lambda name: name.endswith("x")): {"num_bits": 3},
    }}).rules
    fc, conv_in, block, fn = rules

    class Block(nn.Module):
        pass

    conv, lin, blk = nn.Conv2d(1, 1, 1), nn.Linear(1, 1), Block()
    assert fc.matches("a.fc.input_quantizer", "input_quantizer", lin)
    assert not fc.matches("a.conv.input_quantizer", "input_quantizer", conv)
    assert conv_in.matches("a.conv.input_quantizer", "input_quantizer", conv)
    assert not conv_in.matches("a.fc.input_quantizer", "input_quantizer", lin)
    assert not conv_in.matches("a.conv.weight_quantizer", "weight_quantizer", conv)
    assert conv_in.matches("q", "input_quantizer", lin, float_cls=nn.Conv2d)  # a quant module counts as its float
    assert block.matches("b.res_quantizer", "res_quantizer", blk) and not block.matches("b.q", "q", lin)
    assert fn.matches("a.x", "x", None) and not fn.matches("a.y", "y", None)


# --- registry -------------------------------------------------------------------------------------------------------
class _Twin(nn.Module):
    @classmethod
    def from_float(cls, module):
        return cls()


def test_registry_register_unregister_and_errors():
    reg = QuantModuleRegistry(defaults={})
    assert reg.get(nn.ReLU) is None and len(reg) == 0
    assert reg.register(nn.ReLU, _Twin) is _Twin
    assert reg.get(nn.ReLU) is _Twin and reg.float_class_of(_Twin) is nn.ReLU
    assert reg.unregister(nn.ReLU) is _Twin and reg.get(nn.ReLU) is None
    with pytest.raises(ValueError, match="unregister: ReLU is not registered"):
        reg.unregister(nn.ReLU)
    with pytest.raises(TypeError, match="float_cls must be an nn.Module subclass, got 3"):
        reg.register(3, _Twin)
    with pytest.raises(TypeError, match="quant_cls must be a class with a from_float"):
        reg.register(nn.ReLU, nn.Linear)


def test_default_registry_map():
    from modelopt_lite import nn as qnn

    from modelopt_lite.conversion.registry import DEFAULT_QUANT_MAP

    reg = registered()
    for float_cls, name in DEFAULT_QUANT_MAP.items():
        assert reg[float_cls] is getattr(qnn, name), name
    assert len(DEFAULT_QUANT_MAP) == 18


def test_unregister_default_then_register_back():
    from modelopt_lite import nn as qnn

    try:
        assert mtq.unregister(nn.Linear) is qnn.QuantLinear
        m = mtq.quantize(nn.Sequential(nn.Linear(4, 4)), C.INT8_DEFAULT_CFG)
        assert type(m[0]) is nn.Linear
    finally:
        mtq.register(nn.Linear, qnn.QuantLinear)
    assert type(mtq.quantize(nn.Sequential(nn.Linear(4, 4)), C.INT8_DEFAULT_CFG)[0]) is qnn.QuantLinear
