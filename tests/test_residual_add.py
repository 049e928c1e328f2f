"""QuantResidualAdd: the skip branch quantized, the Conv/GEMM branch left in float (TensorRT fuses the Add into the
layer that produces it), in user models, presets and ONNX export."""

import onnx
import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import quant_nn
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.functional import reference
from modelopt_lite.nn import QuantResidualAdd, ResidualAdd
from modelopt_lite.onnx_export.ort_runner import ort_session


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Block(nn.Module):
    """A ResNet basic block with the residual add as a module."""

    def __init__(self, c=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.relu = nn.ReLU()
        self.add = ResidualAdd()

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.add(self.bn2(self.conv2(y)), x))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.add = ResidualAdd()

    def forward(self, a, r):
        return self.add(a, r)


def test_only_the_residual_is_quantized():
    add = QuantResidualAdd(quant_desc_input=QD(num_bits=8, amax=2.0))
    assert not hasattr(add, "input_quantizer") and not add.output_quantizer.is_enabled
    a, r = _x(3, 5, seed=1) * 3, _x(3, 5, seed=2) * 3
    out = add(a, r)
    ref = a + reference.fake_quant_int(r, torch.tensor(2.0) / 127, -128, 127)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    assert not torch.equal(out, a + r)


def test_from_float_quantize_and_preset_patterns():
    f = ResidualAdd()
    q = QuantResidualAdd.from_float(f, quant_desc_input=QD(num_bits=4))
    assert type(q) is QuantResidualAdd and q.residual_input_quantizer.num_bits == 4 and type(f) is ResidualAdd
    assert mtq.QuantModuleRegistry.get(ResidualAdd) is QuantResidualAdd
    torch.manual_seed(0)
    m = Block().eval()
    x = _x(2, 4, 6, 6)
    mtq.quantize(m, mtq.INT8_DEFAULT_CFG, lambda mm: mm(x))
    rq = m.add.residual_input_quantizer
    assert isinstance(m.add, QuantResidualAdd) and rq.is_enabled  # reached by "*input_quantizer"
    assert torch.equal(rq.amax, x.abs().amax())
    with torch.no_grad():
        main = m.bn2(m.conv2(m.relu(m.bn1(m.conv1(x)))))
        expected = torch.relu(main + reference.fake_quant_int(x, x.abs().amax() / 127, -128, 127))
        assert torch.equal(m(x), expected)
    with pytest.raises(TypeError, match="QuantResidualAdd has no weight"):
        QuantResidualAdd.from_float(ResidualAdd(), quant_desc_weight=QD())


def test_real_quant_residual_quantizer_is_rejected():
    with pytest.raises(ValueError, match="QuantResidualAdd: quant_desc_input has fake_quant=False"):
        QuantResidualAdd(quant_desc_input=QD(fake_quant=False, amax=1.0))
    add = QuantResidualAdd(quant_desc_input=QD(amax=1.0))
    add.residual_input_quantizer.set_from_attribute_config({"fake_quant": False})
    with pytest.raises(ValueError, match="QuantResidualAdd: quantizer 'residual_input_quantizer'.*fake_quant=False"):
        add(_x(2, 2), _x(2, 2))


def test_export_places_qdq_on_the_skip_branch_only(tmp_path):
    torch.manual_seed(0)
    m = Block().eval()
    x = _x(2, 4, 6, 6)
    mtq.quantize(m, mtq.INT8_DEFAULT_CFG, lambda mm: mm(x))
    path = tmp_path / "block.onnx"
    mtq.export_onnx(m, x, path)
    g = onnx.load(path).graph
    prod = {o: n for n in g.node for o in n.output}
    (add,) = [n for n in g.node if n.op_type == "Add"]
    main, skip = (prod.get(i) for i in add.input)
    assert main.op_type == "BatchNormalization" and prod[main.input[0]].op_type == "Conv"  # float, fusable
    assert skip.op_type == "DequantizeLinear" and prod[skip.input[0]].op_type == "QuantizeLinear"
    # the skip Q/DQ quantizes the block input with conv1's scale: one Q/DQ pair feeds both (merged)
    assert prod[skip.input[0]].input[0] == "input"
    with torch.no_grad():
        expected = m(x)
    got = torch.from_numpy(ort_session(path).run(None, {"input": x.numpy()})[0])
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-4)


def test_export_add_alone_is_bit_exact_in_ort(tmp_path):
    m = TwoInputs().eval()
    a, r = _x(4, 7, seed=3), _x(4, 7, seed=4) * 2
    mtq.quantize(m, {"quant_cfg": {"*residual_input_quantizer": {"num_bits": 8, "axis": None}}}, lambda mm: mm(a, r))
    path = tmp_path / "add.onnx"
    mtq.export_onnx(m, (a, r), path, input_names=["a", "r"])
    g = onnx.load(path).graph
    assert [n.op_type for n in g.node] == ["QuantizeLinear", "DequantizeLinear", "Add"]
    assert g.node[0].input[0] == "r" and g.node[2].input[0] == "a"
    for seed in range(3):
        a2, r2 = _x(4, 7, seed=10 + seed) * 3, _x(4, 7, seed=20 + seed) * 3
        with torch.no_grad():
            expected = m(a2, r2)
        got = ort_session(path).run(None, {"a": a2.numpy(), "r": r2.numpy()})[0]
        assert torch.equal(torch.from_numpy(got), expected)


def test_listed_in_quant_nn():
    assert "QuantResidualAdd" in quant_nn.__all__ and "ResidualAdd" in quant_nn.__all__
    assert quant_nn.QuantResidualAdd.__doc__
