"""Checks on the model's quantizers before export, with errors that name every offending quantizer.

Also works out the lowest opset that can express every enabled quantizer: 13 for per-channel, 19 for FP8 E4M3/E5M2,
23 for FP4 E2M1, 21 for blocked weights and 16-bit (or 9..15-bit) grids; 4-bit weights prefer 21 (packed INT4 storage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from onnx import TensorProto
from torch import nn

from ..formats import is_float_format, scaled_float_format
from .ort_runner import NO_ORT_KERNELS

BASE_OPSET = 17
#: highest opset the TorchScript exporter writes; higher opsets are reached with onnx's version converter
TORCHSCRIPT_MAX_OPSET = 20


@dataclass
class Plan:
    """What the quantizers need: minimum opset (and why), notes, and how many quantizers are exported."""

    min_opset: int = 10
    reasons: list[tuple[int, str]] = field(default_factory=list)
    preferred_opset: int = BASE_OPSET
    notes: list[str] = field(default_factory=list)
    enabled: int = 0

    def need(self, opset: int, why: str) -> None:
        self.reasons.append((opset, why))
        self.min_opset = max(self.min_opset, opset)


def quantizers(model: nn.Module):
    """``(name, quantizer)`` for every TensorQuantizer in the model (none when the nn layer is absent)."""
    try:
        from ..conversion.utils import named_quantizers
    except ImportError:  # pragma: no cover - layers not installed
        return []
    try:
        return list(named_quantizers(model))
    except ImportError:  # pragma: no cover
        return []


def _is_weight(name: str) -> bool:
    parts = name.split(".")
    if len(parts) > 1 and parts[-1].isdigit():  # a member of a SequentialQuantizer (``weight_quantizer.0``)
        parts = parts[:-1]
    return parts[-1].startswith("weight_quantizer")


def plan(model: nn.Module, *, target: str, opset: int | None) -> Plan:
    """Validate every enabled quantizer; raise one ValueError listing all problems of the first kind found."""
    p = Plan()
    problems: list[str]
    uncalibrated, calibrating, real, dynamic, problems, no_bias = [], [], [], [], [], []
    for name, q in quantizers(model):
        if not (q.is_enabled and q.is_quant_enabled):
            continue
        p.enabled += 1
        if getattr(q, "bias_type", None) == "static" and q.bias_value is None:  # affine bias (nn/_affine_bias.py)
            no_bias.append(name)
        elif getattr(q, "bias_type", None) == "dynamic":
            p.notes.append(f"{name}: dynamic affine bias computed in the graph (ReduceMean may round differently)")
        if q.is_calib_enabled:
            calibrating.append(name)
        if not q.fake_quant:
            real.append(name)
        scheme = getattr(q.quant_desc, "block_scheme", None)
        if scheme is not None:  # NVFP4 / MX: per-block scales computed in the graph (see microscaling.py)
            if scheme.calibrates_amax and not q.is_calibrated:
                uncalibrated.append(name)
            else:
                _scheme_requirements(p, name, scheme)
            continue
        if q.dynamic:
            if not _is_weight(name):
                dynamic.append(name)
            continue
        if not q.is_calibrated:
            uncalibrated.append(name)
            continue
        _requirements(p, name, q.export_info(), target, problems)
        if getattr(q, "num_steps", 1) > 1:
            p.notes.append(
                f"{name}: temporal quantizer with {q.num_steps} steps; exported with the amax of the "
                f"current step ({getattr(q, 'step', 0)})"
            )
    for names, what in (
        (uncalibrated, ("enabled quantizer(s) not calibrated (no amax); calibrate them or disable them before export")),
        (
            calibrating,
            (
                "quantizer(s) still in calibration mode; finish calibration (load_calib_amax, "
                "disable_calib) before export"
            ),
        ),
        (no_bias, "quantizer(s) with an uncalibrated static affine bias; calibrate them or set bias_value"),
        (real, "quantizer(s) in real-quant mode (fake_quant=False); export needs fake quantization"),
        (dynamic, "activation quantizer(s) with dynamic amax; ONNX Q/DQ export needs static, calibrated scales"),
    ):
        if names:
            raise ValueError(f"cannot export: {len(names)} {what}: {', '.join(names)}")
    if problems:
        raise ValueError("cannot export: " + "; ".join(problems))
    if opset is not None:
        low = [why for need, why in p.reasons if need > opset]
        if low:
            raise ValueError(f"opset {opset} is too low: " + "; ".join(low))
    p.preferred_opset = max(BASE_OPSET, p.min_opset, p.preferred_opset)
    return p


def _scheme_requirements(p: Plan, name: str, scheme) -> None:
    """Opsets of an NVFP4 / MX quantizer: FP4 elements need 23; MX activations compute E8M0 scales with a
    ``Cast(round_mode="down")`` (24); MX weights prefer 24 (E8M0 scale initializers; float32 scales below)."""
    weight = _is_weight(name)
    if scheme.elem == "e2m1":
        p.need(23, f"{name}: FP4 E2M1 (FLOAT4E2M1) needs opset >= 23")
    elif scheme.elem in ("e4m3", "e5m2"):
        p.need(19, f"{name}: FP8 elements need opset >= 19")
    if scheme.kind == "mx" and not weight:
        p.need(24, f"{name}: MX activations compute E8M0 scales (Cast round_mode) at opset >= 24")
    elif scheme.kind == "mx":
        p.need(21, f"{name}: MX weights are a blocked DequantizeLinear (opset >= 21)")
        p.preferred_opset = max(p.preferred_opset, 24)
    p.notes.append(
        f"{name}: {scheme.name} (FLOAT4E2M1/FLOAT8E8M0 need onnx's ReferenceEvaluator: ONNX Runtime's CPU provider "
        "has no kernels for them)"
        if scheme.elem == "e2m1" or scheme.kind == "mx"
        else f"{name}: {scheme.name}"
    )


def _requirements(p: Plan, name: str, info: dict, target: str, problems: list[str]) -> None:
    kind, bits = info.get("kind"), info.get("num_bits")
    weight = _is_weight(name)
    axis = info.get("axis")
    if axis is not None and len(tuple(axis)) > 0:
        if len(tuple(axis)) > 1 and not weight:
            problems.append(
                f"{name}: activation quantized along several axes {tuple(axis)}: ONNX QuantizeLinear supports one axis"
            )
        p.need(13, f"{name}: per-channel quantization (axis) needs opset >= 13")
    fmt = scaled_float_format(bits) if kind != "block" and is_float_format(bits) else None
    if fmt is not None:  # a scaled float format: it has an ONNX type and opset
        p.need(cast(int, fmt.onnx_opset), f"{name}: {fmt.title} needs opset >= {fmt.onnx_opset} ({fmt.onnx_type})")
        if getattr(TensorProto, cast(str, fmt.onnx_type)) in NO_ORT_KERNELS:
            p.notes.append(f"{name}: {fmt.onnx_type} Q/DQ (opset {fmt.onnx_opset}): ONNX Runtime's CPU provider has "
                           "no kernels for it; run the model with onnx.reference.ReferenceEvaluator")  # fmt: skip
        return
    if kind == "block":
        if not weight:
            problems.append(
                f"{name}: block quantization of an activation cannot be exported (ONNX "
                "QuantizeLinear blocks are for constants; TensorRT and ONNX Runtime take blocked "
                "weights only)"
            )
            return
        sizes = {k: v for k, v in (info.get("block_sizes") or {}).items() if not isinstance(k, str)}
        if len(sizes) > 1:
            problems.append(
                f"{name}: blocks along several axes {sorted(sizes)} cannot be expressed by ONNX "
                "DequantizeLinear (one block axis)"
            )
        p.need(21, f"{name}: block-quantized weights need opset >= 21 (DequantizeLinear block_size)")
        return
    qmin, qmax = info.get("qmin"), info.get("qmax")
    if kind == "affine" and target == "tensorrt":
        problems.append(
            f"{name}: affine quantization (non-zero zero point) is not supported by TensorRT; "
            "export with target='onnxruntime'"
        )
    if isinstance(bits, int) and bits > 8:
        p.need(21, f"{name}: num_bits={bits} has no ONNX representation below opset 21 (16-bit Q/DQ)")
    elif (
        weight
        and isinstance(bits, int)
        and bits <= 4
        and qmin is not None
        and qmax is not None
        and qmin >= -8
        and qmax <= 15
    ):
        p.preferred_opset = max(p.preferred_opset, 21)
    if not weight and isinstance(bits, int) and bits < 8:
        p.notes.append(
            f"{name}: {bits}-bit activations are exported as 8-bit Q/DQ after a Clip to [{qmin}, {qmax}] steps (exact)"
        )
