"""``torch.compile(fullgraph=True)`` of a model quantized with each preset family (tests/preset_models.py) on the CPU
path: dynamo and AOT autograd (the aot_eager backend, without inductor's codegen) trace forward and backward in
one graph, and the compiled step gives the eager output and input gradient bit for bit. The CUDA path's twin is
tests/test_cuda_path_graphs.py."""

from __future__ import annotations

import copy

import pytest
import torch
from preset_models import CONFIGS, model_and_input


def step(model, x):
    xg = x.clone().requires_grad_()
    y = model(xg)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return y.detach(), xg.grad


@pytest.mark.parametrize("name", list(CONFIGS))
def test_preset_compiles_in_one_graph(name):
    model, x = model_and_input(CONFIGS[name])
    torch._dynamo.reset()
    want = step(model, x)
    got = step(torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True), x)
    torch._dynamo.reset()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
