"""Weight and calibration algorithms: what a config's ``"algorithm"`` names besides the plain calibration methods.

- :mod:`.awq` (``awq_lite``, ``awq_clip``, ``awq_full``; search, statistics, folding and replay in ``awq_*``),
- :mod:`.gptq` (``gptq``; Hessian passes, solver and refit in ``gptq_*``),
- :mod:`.weight_mse` (``weight_mse``: ModelOpt's ``mse``, a multiplier search on each weight amax),
- :mod:`.local_hessian` (``local_hessian``: that search weighted by each Linear's input block Hessians),
- :mod:`.nvfp4_act_headroom` (``nvfp4_act_headroom``: NVFP4 activation global amaxes with headroom),
- :mod:`.layerwise` (``layerwise``: any of them decoder layer by decoder layer, ModelOpt's ``"layerwise"``),
- :mod:`.lsq` (``lsq``: the scale calibration, then learnable pre/post amaxes on static NVFP4 weights), :mod:`.weight_scale` (their weight-scale option),
- :mod:`.smoothquant` (``smoothquant``), :mod:`.svdquant` (``svdquant``: a low-rank float branch, residual quantized), :mod:`.sequence` (a list of algorithms run in order),
- :mod:`.block_replay` (replaying one block of a model on recorded inputs, shared by AWQ and GPTQ),
- :mod:`.relu_grids` (shared grids across a ReLU), :mod:`.auto_quantize` (per-layer format search).

Each registers itself by name in :data:`ALGORITHMS` (the table lives in :mod:`modelopt_lite.conversion.algorithm_registry`,
one layer down, because ``calibrate`` dispatches on it); importing this package registers them all. ModelOpt's split
is the model: its ``model_calib`` holds the calibration algorithms, its ``algorithms`` the format search.
"""

from ..conversion.algorithm_registry import ALGORITHMS, Algorithm, register_algorithm
from . import (
    lsq,  # noqa: F401  (registers "lsq")
    nvfp4_act_headroom,  # noqa: F401  (registers "nvfp4_act_headroom")
    sequence,  # noqa: F401  (registers "sequence": a list under "algorithm")
)
from .auto_quantize import auto_quantize
from .awq import awq  # registers "awq_lite", "awq_clip", "awq_full"
from .gptq import run_gptq  # registers "gptq"
from .layerwise import decoder_layers  # registers "layerwise"
from .local_hessian import LocalHessian  # registers "local_hessian"
from .relu_grids import find_relu_pairs, share_relu_grids
from .smoothquant import smooth_quant  # registers "smoothquant"
from .svdquant import add_lowrank, svd_factors, svdquant  # registers "svdquant"
from .weight_mse import refine_weights, search_amax  # registers "weight_mse" (ModelOpt's "mse")

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "LocalHessian",
    "add_lowrank",
    "auto_quantize",
    "decoder_layers",
    "awq",
    "find_relu_pairs",
    "refine_weights",
    "register_algorithm",
    "run_gptq",
    "search_amax",
    "share_relu_grids",
    "smooth_quant",
    "svd_factors",
    "svdquant",
]
