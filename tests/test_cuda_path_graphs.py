"""Graphs of a model whose quantizers take the CUDA path (the host-emulated CUDA bindings route CPU tensors as
CUDA ones: tests/emulated_build.py, opt-in ``MODELOPT_LITE_TEST_EMULATED=1``), for every preset:

- ONNX export with both exporters gives exactly the graph of the CPU path (same nodes, attributes and initializer
  bytes), and the eager outputs of the two paths are equal bit for bit. The CUDA path takes fused ops the CPU path
  does not (fused block kernels, NVFP4 with the global scale in the kernel, deferred checks); none of them may reach
  an exporter, which translates only the unfused ops.
- ``torch.compile(fullgraph=True)`` (the aot_eager backend: dynamo and AOT autograd, without inductor's codegen)
  traces the forward and backward without a graph break and gives the eager output and input gradient bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from emulated_build import OPT_IN, build, cuda_path_on_host
from torch import nn

onnx = pytest.importorskip("onnx")

import modelopt_lite as mtq  # noqa: E402
from modelopt_lite.onnx_export import export_onnx  # noqa: E402

pytestmark = OPT_IN


def _cfg(weight: dict, act: dict | None = None) -> dict:
    quant_cfg: dict = {"default": {"enable": False}, "*weight_quantizer": dict(weight, enable=True)}
    if act is not None:
        quant_cfg["*input_quantizer"] = dict(act, enable=True)
    return {"quant_cfg": quant_cfg, "algorithm": "max"}


_DYN = {"type": "dynamic"}
CONFIGS = {
    "int8 per channel, int8 activations": _cfg({"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}),
    "fp8 weights and activations": _cfg({"num_bits": (4, 3), "axis": None}, {"num_bits": (4, 3), "axis": None}),
    "int4 static blocks of 32": _cfg({"num_bits": 4, "block_sizes": {-1: 32}}),
    "int4 dynamic blocks of 32": _cfg({"num_bits": 4, "block_sizes": {-1: 32, **_DYN}}),
    "int4 static blocks, E4M3 (fp8) activations": _cfg(
        {"num_bits": 4, "block_sizes": {-1: 32}}, {"num_bits": (4, 3), "axis": None}
    ),
    "nvfp4": _cfg(
        {"num_bits": (2, 1), "block_sizes": {-1: 16, **_DYN, "scale_bits": (4, 3)}, "axis": None},
        {"num_bits": (2, 1), "block_sizes": {-1: 16, **_DYN, "scale_bits": (4, 3)}, "axis": None},
    ),
    "mxfp8": _cfg(
        {"num_bits": (4, 3), "block_sizes": {-1: 32, **_DYN, "scale_bits": (8, 0)}, "axis": None},
        {"num_bits": (4, 3), "block_sizes": {-1: 32, **_DYN, "scale_bits": (8, 0)}, "axis": None},
    ),
}


@pytest.fixture(scope="module")
def emulated():
    return build()


def _model(config: dict) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(8, 64)
    mtq.quantize(model, config, lambda m: m(x))  # calibrated on the CPU path: both exports start from one state
    return model.eval(), x


def _graph(path) -> tuple:
    m = onnx.load(str(path))
    nodes = [
        (n.op_type, n.domain, tuple(n.input), tuple(n.output), tuple(a.SerializeToString() for a in n.attribute))
        for n in m.graph.node
    ]
    inits = sorted((t.name, t.data_type, tuple(t.dims), t.SerializeToString()) for t in m.graph.initializer)
    return [op.version for op in m.opset_import], nodes, inits


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_path_exports_the_cpu_paths_graph(emulated, tmp_path, name, dynamo):
    model, x = _model(CONFIGS[name])
    on_cuda = copy.deepcopy(model)
    with torch.no_grad():
        want = model(x)
    export_onnx(model, (x,), str(tmp_path / "cpu.onnx"), dynamo=dynamo)
    with cuda_path_on_host(emulated), torch.no_grad():
        got = on_cuda(x)
        export_onnx(on_cuda, (x,), str(tmp_path / "cuda.onnx"), dynamo=dynamo)
    assert torch.equal(got, want), f"{name}: the CUDA path's eager output differs"
    assert _graph(tmp_path / "cuda.onnx") == _graph(tmp_path / "cpu.onnx"), name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_path_compiles_in_one_graph(emulated, name):
    model, x = _model(CONFIGS[name])

    def step(m):
        xg = x.clone().requires_grad_()
        y = m(xg)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        return y.detach(), xg.grad

    torch._dynamo.reset()
    with cuda_path_on_host(emulated):
        want = step(model)
        got = step(torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
