"""Real quantization: integer weight storage, exact integer GEMMs, compact checkpoints, seed-style entry points.

- :func:`fake2real` / :func:`compress` (:mod:`.convert`): calibrated fake-quant model -> ``QuantizedLinear`` /
  ``QuantizedConv2d`` with int8 (or packed int4) codes, ``QuantizedMaxPool*d`` (:mod:`.pooling`, exact); outputs equal the fake-quant model's up to float32
  rounding (a derived bound, :func:`.int8_gemm.error_bound`).
- :func:`save_real`, :func:`load_real`, :func:`real_quant` (:mod:`.checkpoint`): safetensors + JSON checkpoints.
- :func:`fake_quant`, :func:`finish_calibration` (:mod:`.seed_api`): the torch_quantizer-style workflow.
- :mod:`.int8_gemm`: the exact integer product backends (``torch._int_mm``, oneDNN, float-exact, reference).
"""

from .checkpoint import load_real, read_checkpoint, real_quant, save_real
from .convert import compress, fake2real
from .modules import QuantizedConv2d, QuantizedLinear
from .pooling import QuantizedMaxPool1d, QuantizedMaxPool2d, QuantizedMaxPool3d
from .real_steps import set_real_step
from .real_types import real_modules
from .seed_api import fake_quant, finish_calibration, seed_config

__all__ = [
    "QuantizedConv2d",
    "QuantizedLinear",
    "QuantizedMaxPool1d",
    "QuantizedMaxPool2d",
    "QuantizedMaxPool3d",
    "compress",
    "fake2real",
    "fake_quant",
    "finish_calibration",
    "load_real",
    "read_checkpoint",
    "real_modules",
    "real_quant",
    "save_real",
    "seed_config",
    "set_real_step",
]
