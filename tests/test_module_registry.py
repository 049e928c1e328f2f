"""QuantModuleRegistry (ModelOpt's API), mtq.register / unregister / replace_quant_module, set_quantizer_attribute,
enable/disable_quantizer, quant_modules from the one registry, enable_onnx_export."""

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import quant_modules, quant_nn
from modelopt_lite.conversion import registry as conv_registry
from modelopt_lite.nn import QuantModuleRegistry, QuantModuleRegistryCls, TensorQuantizer


class Scale(nn.Module):
    def __init__(self, s=2.0):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(s))

    def forward(self, x):
        return x * self.s


class QuantScale(Scale):
    """ModelOpt-style: subclasses the float class, _setup() creates the quantizers."""

    def _setup(self):
        self.input_quantizer = TensorQuantizer()

    def forward(self, x):
        return super().forward(self.input_quantizer(x))


@pytest.fixture
def fresh():
    return QuantModuleRegistryCls()


def test_one_registry_everywhere():
    assert mtq.QuantModuleRegistry is QuantModuleRegistry is conv_registry.REGISTRY
    assert quant_nn.QuantModuleRegistry is QuantModuleRegistry
    assert nn.Linear in QuantModuleRegistry and nn.Linear(2, 2) in QuantModuleRegistry
    assert QuantModuleRegistry[nn.Linear] is quant_nn.QuantLinear
    assert QuantModuleRegistry.get_key(nn.Conv2d) == "nn.Conv2d" and QuantModuleRegistry.get_key(Scale) is None
    assert conv_registry.quant_class_for(nn.Conv2d) is quant_nn.QuantConv2d
    assert conv_registry.float_class_for(quant_nn.QuantConvTranspose2d) is nn.ConvTranspose2d
    assert conv_registry.quant_class_for(Scale) is None and conv_registry.float_class_for(Scale) is None
    with pytest.raises(KeyError, match="Scale is not registered"):
        QuantModuleRegistry[Scale]


def test_register_decorator_and_convert(fresh):
    @fresh.register({Scale: "Scale"})
    class QS(QuantScale):
        pass

    assert fresh[Scale] is QS and fresh.get_key(Scale) == "Scale" and len(fresh) == 1
    f = Scale(3.0).eval()
    q = fresh.convert(f)
    assert type(q) is QS and not q.training and isinstance(q.input_quantizer, TensorQuantizer)
    assert type(f) is Scale and not hasattr(f, "input_quantizer")  # the float module is left alone
    assert q.s is not f.s and torch.equal(q.s, f.s)
    q.input_quantizer.amax = 127.0  # scale 1: 1.5 -> 2 (half to even), 200 -> 127 (clipped)
    assert torch.equal(q(torch.tensor([1.5, 200.0])), torch.tensor([6.0, 381.0]))
    assert fresh.unregister(Scale) is QS and Scale not in fresh
    with pytest.raises(ValueError, match="unregister: Scale is not registered"):
        fresh.unregister(Scale)


def test_registry_rejects_bad_pairs(fresh):
    with pytest.raises(TypeError, match="non-empty dict"):
        fresh.register({})
    with pytest.raises(TypeError, match="key of Scale must be a non-empty str"):
        fresh.register({Scale: 3})
    with pytest.raises(TypeError, match="float class must be an nn.Module subclass, got 'x'"):
        fresh.register({"x": "x"})

    class NotSub(nn.Module):
        def _setup(self):
            pass

    with pytest.raises(TypeError, match="NotSub has a _setup\\(\\) method but does not subclass"):
        fresh.add(Scale, NotSub)
    with pytest.raises(ValueError, match="the same class Scale"):
        fresh.add(Scale, Scale)
    assert len(fresh) == 0


def test_convert_builtin_classes_keeps_values_and_mode():
    lin = nn.Linear(3, 2).eval()
    q = QuantModuleRegistry.convert(lin)
    assert type(q) is quant_nn.QuantLinear and not q.training and torch.equal(q.weight, lin.weight)
    assert q.weight.data_ptr() != lin.weight.data_ptr()
    with pytest.raises(KeyError, match="Scale is not registered"):
        QuantModuleRegistry.convert(Scale())


def test_mtq_register_model_opt_style_and_replace_quant_module():
    model = nn.Sequential(Scale(2.0), nn.Linear(2, 2), nn.Sequential(Scale(0.5)))
    mtq.register(original_cls=Scale, quantized_cls=QuantScale)
    try:
        out = mtq.replace_quant_module(model)
        assert out is model and type(model[0]) is QuantScale and type(model[2][0]) is QuantScale
        assert type(model[1]) is quant_nn.QuantLinear
        assert mtq.replace_quant_modules is mtq.replace_quant_module
        model2 = mtq.quantize(nn.Sequential(Scale()), mtq.INT8_DEFAULT_CFG)
        assert type(model2[0]) is QuantScale and model2[0].input_quantizer.name == "0.input_quantizer"
    finally:
        assert mtq.unregister(original_cls=Scale) is QuantScale
    assert type(mtq.quantize(nn.Sequential(Scale()), mtq.INT8_DEFAULT_CFG)[0]) is Scale
    with pytest.raises(TypeError, match="from_float\\(module\\) classmethod or a _setup\\(\\) method"):
        mtq.register(Scale, nn.ReLU)


def _calibrated():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    m = mtq.quantize(m, mtq.INT8_DEFAULT_CFG, lambda mm: mm(torch.randn(8, 4)))
    return m


def test_disable_enable_quantizer_by_wildcard_and_filter():
    m = _calibrated()
    x = torch.randn(3, 4)
    y_q = m(x)
    assert mtq.disable_quantizer(m, "*weight_quantizer") == ["0.weight_quantizer", "2.weight_quantizer"]
    assert not m[0].weight_quantizer.is_enabled and m[0].input_quantizer.is_enabled
    names = mtq.disable_quantizer(m, lambda n: n.endswith("input_quantizer"))
    assert names == ["0.input_quantizer", "2.input_quantizer"]
    ref = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, m[0].weight, m[0].bias)), m[2].weight)
    assert torch.equal(m(x), ref + m[2].bias)  # every quantizer off: the float model
    assert mtq.enable_quantizer(m, "*") == [
        "0.input_quantizer",
        "0.weight_quantizer",
        "0.output_quantizer",
        "2.input_quantizer",
        "2.weight_quantizer",
        "2.output_quantizer",
    ]
    mtq.disable_quantizer(m, "*output_quantizer")
    assert torch.equal(m(x), y_q)
    with pytest.raises(TypeError, match="wildcard str or a filter callable"):
        mtq.disable_quantizer(m, 3)


def test_set_quantizer_attribute_parent_class_and_atomicity():
    m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2, 2))
    m = mtq.quantize(m, mtq.INT8_DEFAULT_CFG)
    changed = mtq.set_quantizer_attribute(m, "*input_quantizer", {"num_bits": 4}, parent_class=nn.Linear)
    assert changed == ["2.input_quantizer"]
    assert m[2].input_quantizer.num_bits == 4 and m[0].input_quantizer.num_bits == 8
    before = (m[0].weight_quantizer.num_bits, m[2].weight_quantizer.num_bits)
    with pytest.raises((ValueError, TypeError), match="bogus"):
        mtq.set_quantizer_attribute(m, "*weight_quantizer", {"num_bits": 6, "bogus": 1})
    assert (m[0].weight_quantizer.num_bits, m[2].weight_quantizer.num_bits) == before
    with pytest.raises(TypeError, match="attribute must be a dict"):
        mtq.set_quantizer_attribute(m, "*", [{"enable": False}])
    with pytest.raises(TypeError, match="parent_class must be a class"):
        mtq.set_quantizer_attribute(m, "*", {"enable": False}, parent_class="nn.Linear")


# --- quant_modules reads the same registry ---------------------------------------------------------------------------
@pytest.fixture
def restore_nn():
    originals = {name: getattr(nn, name) for name in quant_modules.DEFAULT_FLOAT_MODULES}
    yield
    quant_modules.deactivate()
    for name, cls in originals.items():
        setattr(nn, name, cls)


def test_quant_modules_follow_the_registry(restore_nn):
    assert len(quant_modules.DEFAULT_QUANT_MAP) == 15
    mtq.unregister(nn.modules.conv.Conv1d)
    try:
        with quant_modules.enable():
            assert nn.Conv1d is nn.modules.conv.Conv1d  # unregistered: not patched
            assert nn.Conv2d is quant_nn.QuantConv2d and "Conv1d" not in quant_modules.active()
        assert nn.Conv2d is nn.modules.conv.Conv2d
    finally:
        mtq.register(nn.modules.conv.Conv1d, quant_nn.QuantConv1d)

    class MyQuantLinear(quant_nn.QuantLinear):
        pass

    quant_modules.initialize(custom_quant_modules=[(torch.nn, "Linear", MyQuantLinear)])
    assert nn.Linear is MyQuantLinear and isinstance(nn.Linear(2, 2), MyQuantLinear)
    quant_modules.deactivate()
    assert nn.Linear is nn.modules.linear.Linear


def test_enable_onnx_export_is_a_safe_no_op(tmp_path):
    m = _calibrated().eval()
    x = torch.randn(2, 4)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    flags = dict(vars(TensorQuantizer))
    with quant_modules.enable_onnx_export(), mtq.enable_onnx_export():
        report = mtq.export_onnx(m, (x,), tmp_path / "m.onnx")
    assert dict(vars(TensorQuantizer)) == flags
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())
    import onnx

    ops = [n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops and report is not None
    with pytest.raises(ZeroDivisionError), mtq.enable_onnx_export():
        raise ZeroDivisionError
