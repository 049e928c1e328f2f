"""The tensors of a unified HF checkpoint: quantized weights in their storage dtypes and their scales.

Per quantized module ``m`` (keys relative to it; ``N x K`` weight):

=============  =====================================  ===========================================================
format         ``weight``                             scales
=============  =====================================  ===========================================================
FP8            float8_e4m3fn ``(N, K)``               ``weight_scale`` f32 ``()`` = amax/448; ``input_scale`` ()
W4A16_AWQ      uint8 ``(N/2, K)``: rows 2r (low       ``weight_scale`` f32 ``(N, K/g)`` = block amax/7;
               nibble) and 2r+1 (high) of column k    ``pre_quant_scale`` ``(K,)`` in the weight dtype, unless
                                                      folded into a norm
W4A8_AWQ       as W4A16_AWQ                           + ``weight_scale_2`` f32 ``()`` (the E4M3 weight amax/448),
                                                      ``input_scale`` f32 ``()``
NVFP4          uint8 ``(N, K/2)``: elements 2j (low   ``weight_scale`` float8_e4m3fn ``(N, K/16)`` block scales,
               nibble) and 2j+1 (high) of E2M1 codes  ``weight_scale_2`` f32 ``()`` = amax/2688, ``input_scale``
                                                      f32 ``()`` = input amax/2688
NVFP4_SVD      as NVFP4                               as NVFP4, + ``pre_quant_scale`` ``(K,)`` and the SVDQuant
                                                      factors ``weight_quantizer._svdquant_lora_a`` ``(r, K)`` /
                                                      ``_b`` ``(N, r)``, both in the weight dtype (ModelOpt's keys)
=============  =====================================  ===========================================================

KV cache: ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale``, f32 ``()`` = amax/448 (for NVFP4 too, as ModelOpt).
The codes come from the same quantizer code paths as fake quantization and are checked to reproduce the fake-quant
weight bit for bit (``real.fp8`` / ``real.microscaling`` for FP8 / NVFP4, here for INT4).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..conversion.utils import named_quantizers
from ..formats import E4M3_MAX
from ..functional.division import true_div
from ..nn.sequential_quantizer import SequentialQuantizer
from ..real import fp8, microscaling
from ..real.packing import dequantize_weight, pack_int4, unpack_int4
from .hf_formats import FP8, NVFP4, NVFP4_SVD, W4A8_AWQ, W4A16_AWQ

#: the SVDQuant factors' keys, relative to the module (ModelOpt writes the quantizer's buffer names)
LORA_KEYS = ("weight_quantizer._svdquant_lora_a", "weight_quantizer._svdquant_lora_b")


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """``(N, K)`` signed INT4 codes -> uint8 ``(N/2, K)``: byte ``(r, k)`` holds rows ``2r`` (low nibble) and
    ``2r + 1`` (high nibble) of column ``k`` (ModelOpt's layout)."""
    if codes.shape[0] % 2:
        raise ValueError(f"INT4 HF weights pack row pairs; {codes.shape[0]} output rows is odd")
    return pack_int4(codes.t().contiguous()).t().contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_rows`: int8 codes ``(N, K)``."""
    return unpack_int4(packed.t().contiguous(), 2 * packed.shape[0], signed=True).t().contiguous()


def _scale(amax: torch.Tensor, bound: float) -> torch.Tensor:
    return true_div(amax.detach().float(), bound).reshape(())


def _int4_part(name: str, weight: torch.Tensor, q0, check: bool) -> tuple[dict, int]:
    codes, scale = q0.quantize_weight_codes(weight.detach())
    info = q0.export_info()
    bs = {(k if k >= 0 else weight.dim() + k): v for k, v in info["block_sizes"].items() if not isinstance(k, str)}
    group = int(bs[1])
    if weight.shape[1] % group:
        raise ValueError(
            f"export_hf_checkpoint: module {name!r}: in_features={weight.shape[1]} is not a multiple of the INT4 "
            f"block size {group} (a partial block has no HF layout)"
        )
    scale = scale.float().reshape(weight.shape[0], weight.shape[1] // group)
    if check:
        with torch.no_grad():
            fake = q0(weight)
        deq = dequantize_weight(codes.to(torch.int8), scale, {1: group}).to(weight.dtype)
        if not torch.equal(deq, fake):
            raise RuntimeError(f"export_hf_checkpoint: module {name!r}: INT4 codes do not reproduce the fake weight")
    return {"weight": pack_int4_rows(codes.to(torch.int8)), "weight_scale": scale.contiguous()}, group


def _fp8_input(name: str, module: Any) -> dict:
    iq = module.input_quantizer
    if not iq.is_enabled:
        return {}
    _, s = fp8.input_part(name, iq, module.weight.shape[1])
    if s is None:  # pragma: no cover - static inputs are checked by hf_formats
        raise ValueError(f"export_hf_checkpoint: module {name!r}: the FP8 input_quantizer has no static scale")
    return {"input_scale": s.reshape(())}


def module_tensors(name: str, module: Any, fmt: str) -> tuple[dict[str, torch.Tensor], int | None]:
    """``({local key: tensor}, block size or None)`` of one quantized module (weight, scales, pre_quant_scale)."""
    w, wq = module.weight, module.weight_quantizer
    out: dict[str, torch.Tensor] = {}
    group = None
    if fmt == FP8:
        _, t = fp8.weight_part(name, w, wq, wq.export_info())
        out.update(t)
        out.update(_fp8_input(name, module))
    elif fmt in (W4A16_AWQ, W4A8_AWQ):
        q0 = wq[0] if isinstance(wq, SequentialQuantizer) else wq
        t, group = _int4_part(name, w, q0, check=fmt == W4A16_AWQ)
        out.update(t)
        if fmt == W4A8_AWQ:
            out["weight_scale_2"] = _scale(wq[1].export_info()["amax"], E4M3_MAX)
            out.update(_fp8_input(name, module))
    elif fmt in (NVFP4, NVFP4_SVD):
        with torch.no_grad():
            _, t = microscaling.weight_part(name, w, wq, wq(w))
        out["weight"] = t["weight_packed"]
        out["weight_scale"] = t["weight_block_scale"].view(torch.float8_e4m3fn)
        out["weight_scale_2"] = t["weight_global_scale"].reshape(())
        iq = module.input_quantizer
        if iq.pre_quant_scale is not None:  # the scale is exported on its own; check the quantization alone
            iq = copy.deepcopy(iq)
            iq.pre_quant_scale = None
        _, s = microscaling.input_part(name, iq)
        out["input_scale"] = s.reshape(())
        group = int(wq.quant_desc.block_sizes[-1])
        if getattr(wq, "has_lowrank", False):  # the float branch, in the dtype the forward computes it in
            out[LORA_KEYS[0]] = wq.svdquant_lora_a.detach().to(w.dtype).clone()
            out[LORA_KEYS[1]] = wq.svdquant_lora_b.detach().to(w.dtype).clone()
    else:  # pragma: no cover - formats are checked by hf_formats
        raise ValueError(f"export_hf_checkpoint: module {name!r}: unknown format {fmt!r}")
    pqs = module.input_quantizer.pre_quant_scale if hasattr(module, "input_quantizer") else None
    if pqs is not None:
        out["pre_quant_scale"] = pqs.detach().to(w.dtype).reshape(-1).clone()  # as the forward applies it
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}, group


def kv_tensors(name: str, module: Any) -> dict[str, torch.Tensor]:
    """``{"k_proj.k_scale", "v_proj.v_scale"}`` (relative to the attention module): amax / 448."""
    out = {}
    for attr, key in (("k_bmm_quantizer", "k_proj.k_scale"), ("v_bmm_quantizer", "v_proj.v_scale")):
        out[key] = _scale(getattr(module, attr).export_info()["amax"], E4M3_MAX).cpu()
    return out


def float_state(model: nn.Module, replaced: set[str]) -> dict[str, torch.Tensor]:
    """The model's state dict without quantizer state and without the weights of ``replaced`` modules."""
    prefixes = tuple(f"{n}." for n, _ in named_quantizers(model))
    seq = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, SequentialQuantizer))
    out = {}
    for key, t in model.state_dict().items():
        if key.startswith(prefixes) or key.startswith(seq):
            continue
        owner, _, leaf = key.rpartition(".")
        if owner in replaced and leaf == "weight":
            continue
        out[key] = t.detach().to("cpu").contiguous()
    return out
