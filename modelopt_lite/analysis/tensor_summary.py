"""``print_quantization_summary``: what a quantizer does to a tensor, or what a (real) quantized model holds.

It writes a plain-text table to ``file`` (default ``sys.stdout``: it is an explicit, user-facing print function)
and returns the rows as dicts, so the numbers can be checked or logged.
"""

from __future__ import annotations

import sys
from typing import TextIO, cast

import torch
from torch import nn

from .int8_quantizer import Int8Quantizer
from .layer_error import format_rows
from .metrics import calculate_quantization_error


def _tensor_rows(codes: torch.Tensor | None, xq: torch.Tensor, x: torch.Tensor, qmin, qmax) -> dict:
    row = calculate_quantization_error(x, xq)
    if codes is not None:
        c = codes.to(torch.int64).flatten()
        row["levels_used"] = int(torch.unique(c).numel())
        row["levels_total"] = int(qmax - qmin + 1)
        row["clipped_fraction"] = float(((c == qmin) | (c == qmax)).double().mean())
    return row


def _int8_quantizer_rows(q: Int8Quantizer, tensor) -> list[dict]:
    p = q.get_quantization_params()
    scale, zp = p["scale"], p["zero_point"]
    mode = "symmetric" if q.symmetric else "asymmetric"
    gran = (
        f"group_size={q.group_size}" if q.group_size else (f"axis={q.channel_axis}" if q.per_channel else "per-tensor")
    )
    row = {
        "name": "Int8Quantizer",
        "mode": mode,
        "granularity": gran,
        "qmin": p["qmin"],
        "qmax": p["qmax"],
        "scale_min": float(scale.min()),
        "scale_max": float(scale.max()),
        "num_scales": scale.numel(),
        "zero_point_min": int(zp.min()),
        "zero_point_max": int(zp.max()),
    }
    if tensor is not None:
        codes = q.quantize(tensor)
        row.update(_tensor_rows(codes, q.dequantize(codes), tensor.float(), p["qmin"], p["qmax"]))
    return [row]


def _tensor_quantizer_rows(q, tensor) -> list[dict]:
    from ..tensor_quant import (
        block_quant,
        fake_block_quant,
        fake_tensor_quant,
        tensor_quant,
    )

    info = q.export_info()
    row = {
        "name": q.name or "TensorQuantizer",
        "kind": info["kind"],
        "num_bits": str(info["num_bits"]),
        "granularity": str(
            info["block_sizes"] or (f"axis={info['axis']}" if info["axis"] is not None else "per-tensor")
        ),
        "enabled": q.is_enabled,
        "qmin": info["qmin"],
        "qmax": info["qmax"],
    }
    if info["amax"] is not None:
        row.update(
            amax_min=float(info["amax"].min()),
            amax_max=float(info["amax"].max()),
            scale_min=float(info["scale"].min()),
            scale_max=float(info["scale"].max()),
        )
    if tensor is not None:
        if info["amax"] is None:
            raise ValueError(f"print_quantization_summary: {row['name']} has no amax (dynamic or uncalibrated)")
        amax, nb = info["amax"], info["num_bits"]
        codes = None
        if info["kind"] != "block" and isinstance(nb, tuple):  # E4M3, E5M2, E2M1: no integer codes
            xq = fake_tensor_quant(tensor, amax, nb)
        elif info["kind"] == "block":
            xq = fake_block_quant(tensor, info["block_sizes"], amax, nb, info["unsigned"], info["narrow_range"])
            codes = block_quant(tensor, info["block_sizes"], amax, nb, info["unsigned"], info["narrow_range"])[0]
        else:
            if amax.numel() > 1 and amax.dim() != tensor.dim():
                raise ValueError(
                    f"print_quantization_summary: amax of shape {tuple(amax.shape)} does not fit a "
                    f"tensor of shape {tuple(tensor.shape)}"
                )
            xq = fake_tensor_quant(tensor, amax, nb, info["unsigned"], info["narrow_range"])
            codes = tensor_quant(tensor, amax, nb, info["unsigned"], info["narrow_range"])[0]
        row.update(_tensor_rows(codes, xq.float(), tensor.float(), info["qmin"], info["qmax"]))
    return [row]


def _model_rows(model: nn.Module) -> list[dict]:
    from ..conversion.quantizer_table import summary
    from ..real.convert import real_modules

    rows = [dict(r, kind="quantizer") for r in summary(model)]
    for name, m in real_modules(model):
        spec = cast(dict, m.spec)  # every real module holds its spec dict
        w, inp = spec["weight"], spec.get("input")
        nbytes = sum(t.numel() * t.element_size() for t in m.buffers())
        rows.append(
            {
                "name": name,
                "kind": "real",
                "module": type(m).__name__,
                "format": f"w:int{w['num_bits']} {w['layout']}"
                + (f" a:{'u' if inp['unsigned'] else ''}int{inp['num_bits']}" if inp else ""),
                "compute": m.compute,
                "bytes": nbytes,
                "num_steps": m.num_steps,
            }
        )
    return rows


def print_quantization_summary(
    quantizer_or_model, tensor: torch.Tensor | None = None, file: TextIO | None = None
) -> list[dict]:
    """Summarize a quantizer (optionally applied to ``tensor``) or a model; write a table to ``file``.

    - :class:`~modelopt_lite.analysis.Int8Quantizer` or ``TensorQuantizer``: its parameters (mode, granularity,
      qmin/qmax, scale and zero-point or amax ranges); with ``tensor``, also the error metrics of quantizing it
      (``mse``, ``mae``, ``max_abs_error``, ``sqnr_db``, ``cosine_similarity``), ``levels_used`` out of
      ``levels_total`` and ``clipped_fraction`` (codes at qmin or qmax).
    - a model: one row per quantizer (as :func:`modelopt_lite.summary`) and per real quantized module (format,
      compute path, bytes).

    Returns:
        The rows (list of dicts).
    """
    from ..conversion.utils import is_quantizer

    if isinstance(quantizer_or_model, Int8Quantizer):
        rows = _int8_quantizer_rows(quantizer_or_model, tensor)
    elif is_quantizer(quantizer_or_model):
        rows = _tensor_quantizer_rows(quantizer_or_model, tensor)
    elif isinstance(quantizer_or_model, nn.Module):
        if tensor is not None:
            raise TypeError("print_quantization_summary: tensor= applies to a quantizer, not to a model")
        rows = _model_rows(quantizer_or_model)
    else:
        raise TypeError(
            f"print_quantization_summary expects an Int8Quantizer, a TensorQuantizer or an nn.Module, "
            f"got {type(quantizer_or_model).__name__}"
        )
    out = file if file is not None else sys.stdout
    columns = list(dict.fromkeys(k for r in rows for k in r))
    out.write(format_rows(rows, columns) + "\n")
    return rows
