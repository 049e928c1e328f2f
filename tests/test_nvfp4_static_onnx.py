"""ONNX export of static NVFP4 weights: FLOAT4E2M1 codes and E4M3 block scales from the stored block amaxes and global
amax (not recomputed from the weight), the dequantized weight bit-identical to the weight quantizer's output."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnx_helpers import gemm_weight

import modelopt_lite as mtq


def _quantized():
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24).eval()  # 40: a partial last block
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    cfg = {**mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, "algorithm": "max"}
    cfg["quant_cfg"] = {"*weight_quantizer": dict(cfg["quant_cfg"]["*weight_quantizer"])}
    cfg["quant_cfg"]["*input_quantizer"] = dict(mtq.NVFP4_DEFAULT_CFG["quant_cfg"]["*input_quantizer"])
    model = mtq.quantize(torch.nn.Sequential(lin), cfg, lambda m: m(x))
    wq = model[0].weight_quantizer
    wq.amax = wq.amax * torch.linspace(0.4, 1.0, 3)  # stored amaxes the weight alone does not give
    wq.global_amax = wq.global_amax * 1.5
    return model, x


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_static_nvfp4_weight_exports_its_stored_amaxes(tmp_path, dynamo):
    model, x = _quantized()
    lin = model[0]
    path = tmp_path / "s.onnx"
    rep = mtq.export_onnx(model, x, path, dynamo=dynamo)
    m = onnx.load(path)
    assert not [n for n in m.graph.node if n.domain not in ("", "ai.onnx")]
    assert TensorProto.FLOAT4E2M1 in {t.data_type for t in m.graph.initializer}
    assert len(rep.weights) == 1
    gemm, w_name, prod = gemm_weight(m)
    assert prod[w_name].op_type == "DequantizeLinear"
    (w,) = ReferenceEvaluator(m).run([w_name], {m.graph.input[0].name: x.numpy()})
    w = torch.from_numpy(w)
    with torch.no_grad():
        ref = lin.weight_quantizer(lin.weight)
        plain = mtq.nn.TensorQuantizer(dict(mtq.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"]))(lin.weight)
    if tuple(w.shape) != tuple(ref.shape):
        w = w.T
    assert not torch.equal(ref, plain)  # the stored amaxes matter
    assert torch.equal(w, ref)
