"""BatchNorm quant modules are in the default registry (as ModelOpt converts them); the presets keep their
quantizers off, so export, fake2real and save/restore give what a float BatchNorm gave (issue 14)."""

from __future__ import annotations

import onnx
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import nn as quant_nn
from modelopt_lite.real import fake2real


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _x():
    return torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(2))


def _quantized():
    m = _net()
    m.train()
    with torch.no_grad():
        m(_x() * 2)  # non-trivial running statistics
    m.eval()
    return mtq.quantize(m, mtq.INT8_DEFAULT_CFG, lambda mm: mm(_x()))


def _ops(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_batchnorm_is_converted_with_its_quantizers_off():
    assert mtq.QuantModuleRegistry.get(nn.BatchNorm2d) is quant_nn.QuantBatchNorm2d
    assert mtq.QuantModuleRegistry.get(nn.BatchNorm1d) is quant_nn.QuantBatchNorm1d
    m = _quantized()
    assert type(m[1]) is quant_nn.QuantBatchNorm2d
    assert not m[1].input_quantizer.is_enabled and not m[1].output_quantizer.is_enabled
    ref = _net()
    ref.load_state_dict({k: v for k, v in m.state_dict().items() if "quantizer" not in k}, strict=True)
    ref.eval()
    with torch.no_grad():  # the BatchNorm computes exactly what the float one does
        h = m[0](_x())
        assert torch.equal(m[1](h), ref[1](h))


def test_export_is_the_graph_of_a_float_batchnorm(tmp_path):
    m = _quantized()
    mtq.export_onnx(m, _x(), tmp_path / "q.onnx")
    mtq.unregister(nn.BatchNorm2d)
    try:
        f = _net()
        f.train()
        with torch.no_grad():
            f(_x() * 2)
        f.eval()
        f = mtq.quantize(f, mtq.INT8_DEFAULT_CFG, lambda mm: mm(_x()))
        assert type(f[1]) is nn.BatchNorm2d
        mtq.export_onnx(f, _x(), tmp_path / "f.onnx")
    finally:
        mtq.register(nn.BatchNorm2d, quant_nn.QuantBatchNorm2d)
    assert _ops(tmp_path / "q.onnx") == _ops(tmp_path / "f.onnx")
    assert _ops(tmp_path / "q.onnx").count("BatchNormalization") == 1  # a float BatchNormalization, as before


def test_fake2real_gives_the_float_batchnorm_back():
    m = _quantized()
    with torch.no_grad():
        fake = m(_x())
    real = fake2real(m, inplace=False)
    assert type(real[1]) is nn.BatchNorm2d
    with torch.no_grad():
        assert torch.equal(real[1](m[0](_x())), m[1](m[0](_x())))
        assert real(_x()).shape == fake.shape


def test_save_restore_rebuilds_the_quant_batchnorm(tmp_path):
    m = _quantized()
    mtq.save(m, tmp_path / "s.json", include_weights=True)
    r = mtq.restore(_net(), tmp_path / "s.json")
    assert type(r[1]) is quant_nn.QuantBatchNorm2d and not r[1].input_quantizer.is_enabled
    r.eval()
    with torch.no_grad():
        assert torch.equal(r(_x()), m(_x()))
