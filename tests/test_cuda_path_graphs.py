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

onnx = pytest.importorskip("onnx")

from preset_models import CONFIGS, model_and_input  # noqa: E402
from test_compile_presets import step  # noqa: E402

from modelopt_lite.onnx_export import export_onnx  # noqa: E402

pytestmark = OPT_IN


@pytest.fixture(scope="module")
def emulated():
    return build()


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
    model, x = model_and_input(CONFIGS[name])
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
    model, x = model_and_input(CONFIGS[name])
    torch._dynamo.reset()
    with cuda_path_on_host(emulated):
        want = step(model, x)
        got = step(torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True), x)
    torch._dynamo.reset()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
