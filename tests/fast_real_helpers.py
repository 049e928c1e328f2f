"""Small calibrated fake-quant MLPs in bf16/fp16/fp32 for the GPU-first real paths (tests/test_real_fast_*.py)."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import modelopt_lite as mtl

#: aten ops that only make views or touch metadata (no kernel launch): left out of the op counts
VIEW_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "expand",
    "slice",
    "select",
    "detach",
    "alias",
    "as_strided",
    "unsqueeze",
    "squeeze",
    "permute",
}
SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}


class OpCounter(TorchDispatchMode):
    """Records the aten ops a block issues (views excluded) and fails on any host read-back."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            raise AssertionError(f"host synchronization in a real forward: aten.{name}")
        if name not in VIEW_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def fp8_cfg(weight_axis=None, dynamic=None):
    """FP8_DEFAULT_CFG with per-channel weights (axis 0) and/or dynamic inputs ("row" / "tensor")."""
    cfg = copy.deepcopy(mtl.FP8_DEFAULT_CFG)
    cfg["quant_cfg"]["*weight_quantizer"]["axis"] = weight_axis
    if dynamic is not None:
        axis = (0,) if dynamic == "row" else None
        cfg["quant_cfg"]["*input_quantizer"] = {"num_bits": (4, 3), "axis": axis, "dynamic": True, "enable": True}
    return cfg


def int4_cfg(group: int, algorithm=None):
    cfg = copy.deepcopy(mtl.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    cfg["quant_cfg"]["*weight_quantizer"]["block_sizes"] = {-1: group}
    if algorithm is not None:
        cfg["algorithm"] = algorithm
    return cfg


def int8_weight_only_cfg(axis=0):
    cfg = copy.deepcopy(mtl.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*weight_quantizer"] = {"num_bits": 8, "axis": axis, "enable": True}
    cfg["quant_cfg"]["*input_quantizer"] = {"enable": False}
    return cfg


def fake_mlp(cfg, dtype=torch.bfloat16, dims=(64, 128, 32), seed=0):
    """A calibrated fake-quant ``Linear-ReLU-Linear`` MLP built and calibrated in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.ReLU(), torch.nn.Linear(dims[1], dims[2]))
    m = m.to(dtype)
    data = [(torch.randn(16, dims[0], generator=g) * 2).to(dtype) for _ in range(3)]
    return mtl.quantize(m, copy.deepcopy(cfg), lambda mm: [mm(d) for d in data]).eval()


def inputs(k: int, dtype, seed=1, rows=7):
    """Rows across magnitudes, with a zero row and a dead (tiny) row; plus values beyond the calibrated range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 1, rows).view(rows, 1)
    x[1] = 0.0
    x[2] *= 1e-30
    x[3, :4] = torch.tensor([-0.0, 1e4, -1e4, 0.5])
    return x.to(dtype)


def assert_within(fake_out, real_out, bound, what=""):
    diff = (fake_out.double() - real_out.double()).abs()
    assert real_out.dtype == fake_out.dtype and real_out.shape == fake_out.shape, what
    worst = float((diff - bound).max())
    assert bool((diff <= bound).all()), f"{what}: exceeds the bound by {worst}"
