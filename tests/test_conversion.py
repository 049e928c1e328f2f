"""modelopt_lite.quantize: registry, instance-level conversion, config validation and pattern rules, presets."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
import modelopt_lite.algorithms  # noqa: F401  (registers awq/gptq/svdquant..., which presets name; conversion alone does not)
from modelopt_lite.conversion import config as C
from modelopt_lite.conversion.config import QuantConfigError, normalize_config
from modelopt_lite.conversion.registry import QuantModuleRegistryCls, registered
from modelopt_lite.conversion.utils import named_quantizers


# --- config validation (no model needed) ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_every_preset_validates(name):
    cfg = normalize_config(C.PRESETS[name])
    assert cfg.rules[0].label == "'default'" and cfg.rules[0].attrs == {"enable": False}
    labels = [r.label for r in cfg.rules]
    # the default-disabled entries come last, so they win over the enabling patterns
    assert labels[-1] == "'*mlp.gate.*'" and "'nn.BatchNorm2d']['*'" in labels and "'*lm_head*'" in labels
    if name.startswith("MX"):  # dynamic OCP MX: nothing to calibrate (ModelOpt's algorithm None too)
        assert cfg.algorithm is None
    else:
        assert cfg.algorithm[0] in (
            "max",
            "percentile",
            "smoothquant",
            "awq_lite",
            "svdquant",
            "weight_mse",
            "local_hessian",
        )


def test_preset_contents():
    w = C.INT8_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"]
    assert w == {"num_bits": 8, "axis": 0, "calib_method": "max", "enable": True}
    from modelopt_lite.nn import QuantConvTranspose2d

    ct_axis = QuantConvTranspose2d.default_quant_desc_weight.axis  # the modules' choice (1: per output channel)
    assert C.INT8_DEFAULT_CFG["quant_cfg"]["nn.ConvTranspose2d"]["*weight_quantizer"]["axis"] == ct_axis == 1
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


@pytest.mark.parametrize(
    "config, message",
    [
        ([], r"config must be a dict"),
        ({"quant_cfg": {}, "algo": "max"}, r"config has unknown key\(s\) \['algo'\]"),
        ({"quant_cfg": 3}, r"config\['quant_cfg'\] must be a dict \{pattern: attrs\} or a list of ModelOpt entries"),
        (
            {"quant_cfg": {"*weight_quantizer": 8}},
            r"quant_cfg\['\*weight_quantizer'\]: attributes must be a dict, got int",
        ),
        ({"quant_cfg": {"*weight_quantizer": []}}, r"an empty list of attribute dicts"),
        (
            {"quant_cfg": {"*weight_quantizer": [{"num_bits": 4}, 8]}},
            r"\['\*weight_quantizer'\]\[1\]: attributes must be",
        ),
        (
            {"quant_cfg": {"*weight_quantizer": {"num_bit": 8}}},
            r"quant_cfg\['\*weight_quantizer'\]: unknown quantizer attribute 'num_bit'",
        ),
        (
            {"quant_cfg": {"nn.Conv2d": {"*input_quantizer": {"axes": 0}}}},
            r"quant_cfg\['nn.Conv2d'\]\['\*input_quantizer'\]: unknown quantizer attribute 'axes'",
        ),
        ({"quant_cfg": {"default": {"enable": 1}}}, r"quant_cfg\['default'\]: 'enable' must be a bool, got 1"),
        ({"quant_cfg": {"*x": {"num_steps": 0}}}, r"'num_steps' must be an int >= 1, got 0"),
        ({"quant_cfg": {"nn.Conv9d": {"*": {"enable": False}}}}, r"torch.nn has no module class 'Conv9d'"),
        ({"quant_cfg": {"nn.Conv2d": {}}}, r"a class key needs a non-empty dict"),
        ({"quant_cfg": {nn.Conv2d: {"enable": False}}}, r"quant_cfg\[Conv2d\]\['enable'\]: attributes must be a dict"),
        ({"quant_cfg": {5: {"enable": False}}}, r"quant_cfg key must be a pattern string"),
        ({"quant_cfg": {"": {"enable": False}}}, r"empty pattern"),
        ({"quant_cfg": {}, "algorithm": "minmax"}, r"unknown calibration method 'minmax'"),
        ({"quant_cfg": {}, "algorithm": {"percentile": 99}}, r"algorithm dict needs a 'method' key"),
        (
            {"quant_cfg": {}, "algorithm": {"method": "max", "percentile": 99}},
            r"method 'max' got unknown parameter\(s\) \['percentile'\]; allowed: none",
        ),
        (
            {"quant_cfg": {}, "algorithm": {"method": "percentile", "percentile": 150}},
            r"percentile must be a number in \(0, 100\], got 150",
        ),
        ({"quant_cfg": {}, "algorithm": {"method": "entropy", "stride": 0}}, r"stride must be an int >= 1, got 0"),
        ({"quant_cfg": {}, "algorithm": 3}, r"algorithm must be None, a method name or a dict"),
    ],
)
def test_malformed_config_raises_value_error_saying_what(config, message):
    with pytest.raises(ValueError, match=message):
        normalize_config(config)


def test_unknown_attribute_is_also_a_type_error():
    with pytest.raises(TypeError, match="unknown quantizer attribute 'bits'"):
        normalize_config({"quant_cfg": {"*": {"bits": 8}}})


def test_normalize_never_mutates_and_completes_granularity():
    cfg = {
        "quant_cfg": {"*w": {"num_bits": 4, "block_sizes": {-1: 64}}, "*a": {"axis": 1}},
        "algorithm": {"method": "entropy", "start_bin": 64},
    }
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
    rules = normalize_config(
        {
            "quant_cfg": {
                "*fc*": {"enable": False},
                "nn.Conv2d": {"*input_quantizer": {"num_bits": 4}},
                "Block": {"*": {"num_bits": 6}},
                (lambda name: name.endswith("x")): {"num_bits": 3},
            }
        }
    ).rules
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
    reg = QuantModuleRegistryCls()
    assert reg.get(nn.ReLU) is None and len(reg) == 0
    assert reg.add(nn.ReLU, _Twin) is _Twin
    assert reg.get(nn.ReLU) is _Twin and reg.float_class_of(_Twin) is nn.ReLU and reg.get_key(nn.ReLU) == "nn.ReLU"
    assert reg.unregister(nn.ReLU) is _Twin and reg.get(nn.ReLU) is None
    with pytest.raises(ValueError, match="unregister: ReLU is not registered"):
        reg.unregister(nn.ReLU)
    with pytest.raises(TypeError, match="the float class must be an nn.Module subclass, got 3"):
        reg.add(3, _Twin)
    with pytest.raises(TypeError, match="must have a from_float\\(module\\) classmethod or a _setup\\(\\) method"):
        reg.add(nn.ReLU, nn.Linear)


def test_default_registry_map():
    from modelopt_lite import nn as qnn

    reg = registered()
    for name in qnn.__all__:
        cls = getattr(qnn, name)
        if name.startswith("Quant") and isinstance(cls, type) and hasattr(cls, "_float_cls"):
            assert reg[cls._float_cls] is cls, name
    assert reg[nn.Linear] is qnn.QuantLinear and reg[qnn.MatMul] is qnn.QuantMatMul
    # 29 + BatchNorm1-3d + MultiheadAttention and its out_proj (NonDynamicallyQuantizableLinear) + ResidualAdd
    # + TransformerEncoderLayer/TransformerEncoder (no fused fast path while quantized)
    # Finders (Hugging Face attention, residual outputs) register third-party classes on first lookup, so count only
    # the static registrations: the map's other entries must all be classes a finder brought in.
    static = {k: v for k, v in reg.items() if v in qnn.QUANT_MODULE_CLASSES}
    assert len(static) == len(qnn.QUANT_MODULE_CLASSES) == 37
    assert all(k.__module__.startswith("transformers.") for k in reg if k not in static)


def test_registry_count_ignores_classes_found_later():
    transformers = pytest.importorskip("transformers")
    from modelopt_lite import nn as qnn
    from modelopt_lite.nn.modules._registry import QuantModuleRegistry

    bert = transformers.models.bert.modeling_bert
    assert QuantModuleRegistry.get(bert.BertSelfOutput) is not None  # a finder registers it now
    test_default_registry_map()
    assert len(registered()) > len(qnn.QUANT_MODULE_CLASSES)


def test_unregister_default_then_register_back():
    from modelopt_lite import nn as qnn

    try:
        assert mtq.unregister(nn.Linear) is qnn.QuantLinear
        m = mtq.quantize(nn.Sequential(nn.Linear(4, 4)), C.INT8_DEFAULT_CFG)
        assert type(m[0]) is nn.Linear
    finally:
        mtq.register(nn.Linear, qnn.QuantLinear)
    assert type(mtq.quantize(nn.Sequential(nn.Linear(4, 4)), C.INT8_DEFAULT_CFG)[0]) is qnn.QuantLinear


# --- conversion on models ---------------------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.lm_head = nn.Linear(16, 4)
        self.fc = nn.Linear(4 * 4 * 4, 16)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.lm_head(torch.relu(self.fc(x.flatten(1))))


def _net():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net().eval()


def _flags(model):
    return {n: (q.is_enabled, q.quant_desc) for n, q in named_quantizers(model)}


def test_quantize_converts_instances_only_and_names_quantizers():
    from modelopt_lite import nn as qnn

    model = _net()
    float_weights = {k: v.clone() for k, v in model.state_dict().items()}
    out = mtq.quantize(model, C.INT8_DEFAULT_CFG)
    assert out is model
    assert torch.nn.Linear is nn.modules.linear.Linear and torch.nn.Conv2d is nn.modules.conv.Conv2d  # no patching
    assert type(model.conv) is qnn.QuantConv2d and type(model.fc) is qnn.QuantLinear
    assert type(model.pool) is qnn.QuantMaxPool2d and type(model.bn) is qnn.QuantBatchNorm2d  # as ModelOpt
    assert isinstance(nn.Linear(2, 2), nn.Linear) and type(nn.Linear(2, 2)) is nn.Linear
    for k, v in float_weights.items():  # exact weight copy
        assert torch.equal(model.state_dict()[k], v), k
    names = [n for n, _ in named_quantizers(model)]
    assert names[:3] == ["conv.input_quantizer", "conv.weight_quantizer", "conv.output_quantizer"]
    assert all(q.name == n for n, q in named_quantizers(model))
    flags = _flags(model)
    assert flags["conv.weight_quantizer"][0] and flags["conv.weight_quantizer"][1].axis == 0
    assert flags["fc.input_quantizer"][0] and flags["fc.input_quantizer"][1].axis is None
    assert not flags["fc.output_quantizer"][0]  # "default": disabled
    assert not flags["lm_head.input_quantizer"][0] and not flags["lm_head.weight_quantizer"][0]  # lm_head disabled
    assert flags["pool.input_quantizer"][0]
    assert not flags["bn.input_quantizer"][0]  # the presets' default-disabled "nn.BatchNorm2d" entry


def test_presets_are_never_mutated():
    before = copy.deepcopy(C.PRESETS)
    for cfg in C.PRESETS.values():
        mtq.quantize(_net(), cfg)
    assert C.PRESETS == before


def test_class_keys_callable_keys_and_later_patterns_win():
    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            "*input_quantizer": {"num_bits": 8, "enable": True},
            "nn.Conv2d": {"*input_quantizer": {"num_bits": 6}, "weight_quantizer": {"num_bits": 5, "enable": True}},
            "*fc.input_quantizer": {"num_bits": 4},
            "*nothing_matches_this*": {"num_bits": 2},
            (lambda name: name.startswith("lm_head.")): {"enable": True, "num_bits": 3},
            "*lm_head.weight*": {"enable": False},
        },
        "algorithm": None,
    }
    model = mtq.quantize(_net(), cfg)
    f = _flags(model)
    assert f["conv.input_quantizer"][0] and f["conv.input_quantizer"][1].num_bits == 6
    assert f["conv.weight_quantizer"][0] and f["conv.weight_quantizer"][1].num_bits == 5
    assert f["fc.input_quantizer"][1].num_bits == 4 and not f["fc.weight_quantizer"][0]
    assert f["pool.input_quantizer"][1].num_bits == 8
    assert f["lm_head.input_quantizer"][0] and f["lm_head.input_quantizer"][1].num_bits == 3
    assert not f["lm_head.weight_quantizer"][0]


def test_class_key_by_class_object_and_by_user_class_name():
    from modelopt_lite.nn import QuantMatMul

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            from modelopt_lite.nn import MatMul

            self.mm = MatMul()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(self.mm(x, x.transpose(-1, -2)))

    cfg = {
        "quant_cfg": {
            "default": {"enable": False},
            nn.Linear: {"*weight_quantizer": {"enable": True}},
            "MatMul": {"other_input_quantizer": {"enable": True, "num_bits": 7}},
        },
        "algorithm": None,
    }
    model = mtq.quantize(Attn(), cfg)
    assert type(model.mm) is QuantMatMul
    f = _flags(model)
    assert f["proj.weight_quantizer"][0] and not f["proj.input_quantizer"][0]
    assert f["mm.other_input_quantizer"][0] and f["mm.other_input_quantizer"][1].num_bits == 7
    assert not f["mm.input_quantizer"][0]


def test_bad_attribute_value_names_quantizer_and_patterns_and_leaves_model_unchanged():
    model = _net()
    ref = copy.deepcopy(model)
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8}, "nn.Linear": {"*weight_quantizer": {"num_bits": 99}}}}
    with pytest.raises(
        ValueError,
        match=r"quantizer 'lm_head.weight_quantizer': the attributes from "
        r"quant_cfg\['\*weight_quantizer'\] \+ "
        r"quant_cfg\['nn.Linear'\]\['\*weight_quantizer'\] \(merged: "
        r"\{'enable': True, 'num_bits': 99\}\) were rejected: .*num_bits must be in 1..16, got 99",
    ):
        mtq.quantize(model, cfg)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]  # conversion undone
    assert type(model.fc) is nn.Linear
    with pytest.raises(QuantConfigError):
        mtq.quantize(model, {"quant_cfg": {"*": {"bits": 8}}})
    assert type(model.conv) is nn.Conv2d


def test_exception_in_forward_loop_undoes_conversion():
    model = _net()

    def boom(m):
        m(torch.randn(2, 1, 8, 8))
        raise KeyError("data loader broke")

    with pytest.raises(KeyError, match="data loader broke"):
        mtq.quantize(model, C.INT8_DEFAULT_CFG, boom)
    assert type(model.conv) is nn.Conv2d and type(model.fc) is nn.Linear


def test_quantize_twice_reapplies_and_keeps_shared_modules_shared():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    mtq.quantize(model, C.INT8_DEFAULT_CFG)
    assert model[0] is model[2] and type(model[0]).__name__ == "QuantLinear"
    mtq.quantize(model, C.FP8_DEFAULT_CFG)
    assert model[0].input_quantizer.quant_desc.num_bits == (4, 3)
    with pytest.raises(TypeError, match="forward_loop must be a callable"):
        mtq.quantize(model, C.INT8_DEFAULT_CFG, forward_loop=[1, 2])


def test_root_module_conversion_and_custom_registration():
    from modelopt_lite.nn import QuantLinear

    q = mtq.quantize(nn.Linear(3, 3), C.INT8_DEFAULT_CFG)
    assert type(q) is QuantLinear and q.weight_quantizer.name == "weight_quantizer"

    class MyLinear(nn.Linear):
        pass

    class QuantMyLinear(QuantLinear):
        _float_cls = MyLinear

    m = nn.Sequential(MyLinear(3, 3))
    mtq.quantize(m, C.INT8_DEFAULT_CFG)
    assert type(m[0]) is MyLinear  # subclasses are not converted implicitly
    mtq.register(MyLinear, QuantMyLinear)
    try:
        mtq.quantize(m, C.INT8_DEFAULT_CFG)
        assert type(m[0]) is QuantMyLinear
    finally:
        mtq.unregister(MyLinear)


def test_int8_ort_cfg_enables_conv_and_linear_outputs_only():
    model = mtq.quantize(_net(), C.INT8_ORT_CFG)
    f = _flags(model)
    assert f["conv.output_quantizer"][0] and f["fc.output_quantizer"][0]
    assert not f["pool.output_quantizer"][0] and not f["lm_head.output_quantizer"][0]


def test_summary_rows_and_table(digits_model):
    model = digits_model("mlp")
    data = torch.rand(64, 1, 8, 8)
    mtq.quantize(model, C.INT8_DEFAULT_CFG, lambda m: m(data))
    rows = mtq.summary(model)
    assert [r["name"] for r in rows][:3] == [
        "body.0.input_quantizer",
        "body.0.weight_quantizer",
        "body.0.output_quantizer",
    ]
    r0, r1, r2 = rows[:3]
    assert (r0["format"], r0["granularity"], r0["calibrated"], r0["enabled"]) == ("int8", "per-tensor", True, True)
    assert r0["amax_max"] == pytest.approx(float(data.abs().max()))
    assert r1["granularity"] == "axis=0" and r1["amax_min"] < r1["amax_max"]
    assert (r2["enabled"], r2["calibrated"], r2["amax_min"]) == (False, False, None)
    buf = io.StringIO()
    assert mtq.print_quant_summary(model, file=buf) == rows
    text = buf.getvalue()
    lines = text.splitlines()
    assert lines[0].split() == ["name", "module", "format", "granularity", "amax", "calibrated", "state"]
    assert "body.0.weight_quantizer" in lines[3] and "axis=0" in lines[3] and "quant" in lines[3]
    assert lines[-1] == "9 quantizers: 6 enabled, 6 calibrated"
    fp8 = mtq.quantize(_net(), C.FP8_DEFAULT_CFG)
    w4 = mtq.quantize(_net(), C.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    assert mtq.summary(fp8)[0]["format"] == "fp8_e4m3"
    assert mtq.summary(w4)[1]["granularity"] == "blocks{-1:128}" and mtq.summary(w4)[1]["format"] == "int4"


def test_algorithm_none_skips_the_forward_loop_with_a_warning_and_bare_quant_cfg():
    from modelopt_lite.conversion.model_quant import set_quantizer_by_cfg

    calls = []
    with pytest.warns(UserWarning, match="algorithm is None, so forward_loop was not run"):
        model = mtq.quantize(_net(), {"quant_cfg": {}, "algorithm": None}, calls.append)
    assert calls == [] and not model.fc.input_quantizer.has_amax
    applied = set_quantizer_by_cfg(model, {"*fc.*": {"num_bits": 5}})
    assert applied == {
        "fc.input_quantizer": ["'*fc.*'"],
        "fc.weight_quantizer": ["'*fc.*'"],
        "fc.output_quantizer": ["'*fc.*'"],
    }
    assert model.fc.weight_quantizer.num_bits == 5 and mtq.calibrate_loop is not None
