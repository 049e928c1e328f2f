"""Small quantized models, one per preset family, shared by the compile and export tests of the CPU and the CUDA
paths (tests/test_compile_presets.py, tests/test_cuda_path_graphs.py)."""

from __future__ import annotations

import torch
from torch import nn

import modelopt_lite as mtq


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


def model_and_input(config: dict) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(8, 64)
    # calibrated on the CPU path: every variant of a test starts from one state
    mtq.quantize(model, config, lambda m: m(x))
    return model.eval(), x
