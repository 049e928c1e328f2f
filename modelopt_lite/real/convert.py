"""``fake2real`` (alias ``compress``): turn a calibrated fake-quant model into a real INT8/INT4 model.

Every ``QuantLinear`` / ``QuantConv2d`` becomes a :class:`~.modules.QuantizedLinear` /
:class:`~.modules.QuantizedConv2d` holding integer weight codes and float32 scales. The conversion checks that the
stored codes and scales reproduce the fake-quant module bit for bit (dequantized weights equal the weight quantizer's
output, the input scale reproduces the input quantizer on a probe) and raises otherwise.

What converts (anything else raises ValueError naming the module and quantizer):

- weights: integer, signed, <= 8 bits, per tensor, per channel or in blocks (INT4 blocks are stored packed);
- inputs: integer, <= 8 bits (signed or unsigned), per tensor, static amax, any number of temporal steps, or
  disabled (weight-only);
- output quantizers must be disabled: a real module returns float outputs (re-quantizing them would need the
  float result to be on the same side of every rounding tie as the fake-quant model's);
- a quantized module whose quantizers are all disabled goes back to its float class (auto_skip leaves such layers);
- ``QuantMaxPool1d/2d/3d`` become :mod:`.pooling`'s ``QuantizedMaxPool*d`` (they pool integer codes, which is exact:
  max pooling commutes with the monotone quantizer), so the default presets' CNNs convert as a whole;
- every enabled static quantizer must be calibrated (ValueError listing the ones without an amax).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, NoReturn, cast

import torch
from torch import nn

from ..conversion.utils import is_quantizer
from ..formats import int_range
from ..functional import blocks, library
from ..functional.checks import check_axes
from ..functional.scales import scale_from_amax
from ..nn.modules._registry import QuantModuleRegistry
from . import fast_gemm, fp8, microscaling
from .checkpoint import save_real
from .int8_gemm import check_backend
from .packing import dequantize_weight, pack_int4
from .pooling import pool_args
from .real_types import (
    FLOAT_CLASSES,
    POOL_DIMS,
    REAL_CLASSES,
    WEIGHTED_TYPES,
    RealModule,
    all_real_modules,
    build_real_module,
    real_modules,
)
from .seed_api import finish_calibration, has_pending_calibration

__all__ = [
    "REAL_CLASSES",
    "build_real_module",
    "compress",
    "fake2real",
    "real_modules",
    "revert_to_float",
    "set_validate",
]

log = logging.getLogger(__name__)

#: float class -> the real module type replacing it (each real type names its float class in ``real_types``)
_REAL_OF_FLOAT: dict[type, str] = {f: kind for kind, f in FLOAT_CLASSES.items()}


def real_kind(module: nn.Module, registry=QuantModuleRegistry) -> str | None:
    """The real type a quantized module converts to, decided by the registry: ``type(module)`` must be the class
    registered for a float class (``nn.Linear`` -> ``QuantLinear``) that has a real counterpart
    (``QuantizedLinear``); None otherwise (a class registered by the user for ``nn.Linear`` converts too, and the
    conversion still checks it reproduces the fake-quant module bit for bit)."""
    float_cls = registry.float_class_of(type(module))
    if float_cls is None or registry.get(float_cls) is not type(module):
        return None
    return _REAL_OF_FLOAT.get(float_cls)


def convertible_classes(registry=QuantModuleRegistry) -> list[type]:
    """The quantized classes :func:`fake2real` converts now (the registry's classes for the real types' floats)."""
    return [q for f in _REAL_OF_FLOAT for q in [registry.get(f)] if q is not None]


def _quantizers(module: nn.Module) -> dict:
    return {n: q for n, q in module.named_children() if is_quantizer(q)}


def _fail(name: str, what: str, why: str) -> NoReturn:
    raise ValueError(f"fake2real: module {name!r}: {what} {why}")


def _weight_part(name: str, module: nn.Module, wq) -> tuple[dict, dict]:
    weight = cast(torch.Tensor, module.weight)  # the Linear / Conv2d weight parameter
    if microscaling.scheme_of(wq) is not None:  # NVFP4 / MX: packed codes and E4M3/E8M0 block scales
        with torch.no_grad():
            return microscaling.weight_part(name, weight, wq, wq(weight))
    info = wq.export_info()
    w = weight.detach()
    if info["kind"] == "e4m3":  # FP8 E4M3 codes (see .fp8)
        return fp8.weight_part(name, weight, wq, info)
    if info["kind"] not in ("int", "block"):
        _fail(name, "weight_quantizer", f"is {info['kind']}; only integer weights have real integer storage")
    if info["dynamic"]:
        _fail(name, "weight_quantizer", "is dynamic; calibrate it (static amax) before fake2real")
    if info["unsigned"] or info["num_bits"] > 8:
        _fail(
            name,
            "weight_quantizer",
            f"has num_bits={info['num_bits']} unsigned={info['unsigned']}; real storage "
            "needs signed weights with <= 8 bits",
        )
    codes, scale = wq.quantize_weight_codes(w)
    codes = codes.to(torch.int8)
    if info["kind"] == "block":
        sizes = blocks.normalize(info["block_sizes"], w.shape)
        layout, axis, bs = "block", None, {str(a): s for a, s in sizes.items()}
        stored_scale, deq_scale = scale.float(), scale.float()
    elif scale.numel() == 1 and info["axis"] is None:
        layout, axis, bs = "tensor", None, None
        stored_scale = deq_scale = scale.float().reshape(())
    else:
        axis = list(check_axes(info["axis"], w.dim(), "weight axis"))
        layout, bs = "channel", None
        deq_scale = scale.float().reshape([w.shape[d] if d in axis else 1 for d in range(w.dim())])
        stored_scale = deq_scale.reshape(-1) if axis == [0] else deq_scale
    with torch.no_grad():
        fake_w = wq(weight)
    deq = dequantize_weight(codes, deq_scale, {int(k): v for k, v in bs.items()} if bs else None).to(w.dtype)
    if not torch.equal(deq, fake_w):
        raise RuntimeError(
            f"fake2real: module {name!r}: the integer weights do not reproduce the weight quantizer's "
            "output; please report this (quantizer settings: " + repr(info) + ")"
        )
    storage = "int4" if info["num_bits"] <= 4 else "int8"
    spec = {
        "num_bits": info["num_bits"],
        "unsigned": False,
        "narrow_range": info["narrow_range"],
        "layout": layout,
        "axis": axis,
        "block_sizes": bs,
        "storage": storage,
        "dtype": str(w.dtype).replace("torch.", ""),
    }
    tensors = {"weight_scale": stored_scale.contiguous()}
    tensors["weight" if storage == "int8" else "weight_packed"] = codes if storage == "int8" else pack_int4(codes)
    return spec, tensors


def _input_scales(name: str, iq, in_features: int | None = None) -> tuple[dict, torch.Tensor | None]:
    if getattr(iq, "bias", None) is not None:  # nn/_affine_bias.py
        _fail(name, "input_quantizer", f"has an affine bias {iq.bias}; real modules have no input offset")
    if microscaling.scheme_of(iq) is not None:
        return microscaling.input_part(name, iq)
    if iq.export_info()["kind"] == "e4m3" and in_features is not None:  # FP8 E4M3 activations (see .fp8)
        return fp8.input_part(name, iq, in_features)
    info = iq.export_info()
    if info["kind"] != "int" or info["dynamic"] or info["axis"] is not None or info["num_bits"] > 8:
        _fail(
            name,
            "input_quantizer",
            f"({info['kind']}, num_bits={info['num_bits']}, axis={info['axis']}, "
            f"dynamic={info['dynamic']}) is not supported; real modules need static per-tensor integer inputs "
            "with <= 8 bits",
        )
    bound, qmin, qmax = int_range(info["num_bits"], info["unsigned"], info["narrow_range"])
    steps = int(getattr(iq, "num_steps", 1))
    saved = iq.step if steps > 1 else None
    scales = []
    pqs = iq.pre_quant_scale
    iq.pre_quant_scale = None  # the probe checks the grid alone; restored below
    try:
        for t in range(steps):
            if steps > 1:
                iq.step = t
            amax = iq.export_info()["amax"]
            if amax.numel() != 1:
                _fail(name, "input_quantizer", f"has an amax of shape {tuple(amax.shape)}; expected per tensor")
            scale = scale_from_amax(amax.reshape(()), bound)
            probe = _probe(amax.reshape(()), bound)
            probe = probe.abs() if info["unsigned"] else probe
            with torch.no_grad():
                if not torch.equal(library.fake_quant_int(probe, scale, qmin, qmax), iq(probe)):
                    raise RuntimeError(
                        f"fake2real: module {name!r}: the input scale does not reproduce the input "
                        f"quantizer at step {t}; please report this ({info!r})"
                    )
            scales.append(scale)
    finally:
        iq.pre_quant_scale = pqs
        if saved is not None:
            iq.step = saved
    spec = {
        "num_bits": info["num_bits"],
        "unsigned": info["unsigned"],
        "narrow_range": info["narrow_range"],
        "num_steps": steps,
    }
    return spec, torch.stack(scales).float().contiguous()


def _probe(amax: torch.Tensor, bound: int) -> torch.Tensor:
    """Values across (and beyond) the range, including the grid's exact rounding ties."""
    a = float(amax) if float(amax) > 0 else 1.0
    grid = torch.linspace(-1.3 * a, 1.3 * a, 1031)
    ties = (torch.arange(-(bound + 3), bound + 3) + 0.5) * (a / float(bound))
    return torch.cat([grid, ties]).to(amax.device).view(1, -1)


def _spec_and_tensors(name: str, module: nn.Module, kind: str) -> tuple[dict, dict]:
    qs = _quantizers(module)
    wq, iq, oq = qs.get("weight_quantizer"), qs.get("input_quantizer"), qs.get("output_quantizer")
    if oq is not None and oq.is_enabled:
        _fail(
            name,
            "output_quantizer",
            "is enabled; real modules return float outputs. Disable it "
            "(quant_cfg {'*output_quantizer': {'enable': False}}) or keep this model fake-quantized",
        )
    for q, what in ((wq, "weight_quantizer"), (iq, "input_quantizer")):
        if q is not None and q.is_enabled and (q.is_calib_enabled or not q.is_quant_enabled):
            _fail(name, what, "is still calibrating (or has quantization off); finish calibration first")
    if wq is None or not wq.is_enabled:
        _fail(
            name,
            "weight_quantizer",
            "is disabled while the input quantizer is enabled; real modules store quantized weights",
        )
    wspec, tensors = _weight_part(name, module, wq)
    weight = cast(torch.Tensor, module.weight)  # the Linear / Conv2d parameters
    bias = cast("torch.Tensor | None", module.bias)
    spec: dict[str, Any] = {
        "type": kind,
        "weight_shape": list(weight.shape),
        "weight": wspec,
        "input": None,
        "bias": None if bias is None else str(bias.dtype).replace("torch.", ""),
    }
    if bias is not None:
        tensors["bias"] = bias.detach().clone()
    pqs = None if iq is None else iq.pre_quant_scale
    if iq is not None and pqs is not None and kind != "QuantizedLinear":
        _fail(
            name,
            "input_quantizer",
            "has a SmoothQuant pre_quant_scale, which real modules support only on a Linear input; keep this model "
            "fake-quantized (or export it to ONNX, where it is a Mul)",
        )
    if iq is not None and iq.is_enabled:
        k = weight.shape[1] if kind == "QuantizedLinear" else None
        spec["input"], scales = _input_scales(name, iq, k)
        if scales is not None:
            tensors["input_scale"] = scales
    if pqs is not None:  # SmoothQuant's in the input entry; weight-only (AWQ's unfolded scale) at the top
        (spec if spec["input"] is None else spec["input"])["pre_quant_scale"] = True
        tensors["pre_quant_scale"] = pqs.detach().clone()
    if kind == "QuantizedConv2d":
        conv = cast(nn.Conv2d, module)  # the class registered for nn.Conv2d: it has Conv2d's arguments
        p = conv.padding
        spec["conv"] = {
            "stride": list(conv.stride),
            "padding": p if isinstance(p, str) else list(p),
            "dilation": list(conv.dilation),
            "groups": conv.groups,
            "padding_mode": conv.padding_mode,
        }
    return spec, tensors


def _pool_spec_and_tensors(name: str, module: nn.Module, kind: str) -> tuple[dict, dict]:
    qs = _quantizers(module)
    iq, oq = qs.get("input_quantizer"), qs.get("output_quantizer")
    if oq is not None and oq.is_enabled:
        _fail(name, "output_quantizer", "is enabled; real pooling returns the pooled input grid. Disable it")
    if iq is None or not iq.is_enabled:
        _fail(name, "input_quantizer", "is disabled while another quantizer is enabled")
    if iq.is_calib_enabled or not iq.is_quant_enabled:
        _fail(name, "input_quantizer", "is still calibrating (or has quantization off); finish calibration first")
    if iq.pre_quant_scale is not None:
        _fail(name, "input_quantizer", "has a SmoothQuant pre_quant_scale, which real pooling does not support")
    spec_in, scales = _input_scales(name, iq)
    spec = {"type": kind, "pool": pool_args(module, POOL_DIMS[kind]), "input": spec_in}
    return spec, {"input_scale": scales}


def revert_to_float(module: nn.Module) -> nn.Module:
    """A float copy of a quantized module (its ``_float_cls``) without quantizers; weights identical."""
    new = copy.copy(module)
    new._modules = {k: v for k, v in module._modules.items() if k not in _quantizers(module)}
    new._parameters, new._buffers = dict(module._parameters), dict(module._buffers)
    new.__class__ = cast("type[nn.Module]", module._float_cls)
    return new


def _check_calibrated(plan) -> None:
    """ValueError naming every enabled static quantizer of the modules to convert that has no amax."""
    missing = []
    for name, m, kind in plan:
        if kind == "float":
            continue
        for local, q in _quantizers(m).items():
            if q.is_enabled and not q.quant_desc.dynamic and not q.is_calib_enabled and not q.has_amax:
                missing.append(f"{name}.{local}")
    if missing:
        raise ValueError(
            f"fake2real: {len(missing)} quantizer(s) are not calibrated (no amax): {', '.join(missing)}. "
            "Calibrate the model first (modelopt_lite.quantize(model, config, forward_loop) or "
            "modelopt_lite.calibrate), set their amax, or disable them"
        )


def _all_disabled(module: nn.Module) -> bool:
    qs = _quantizers(module)
    return bool(qs) and not any(q.is_enabled for q in qs.values())


def _targets(model: nn.Module, strict: bool):
    for name, m in model.named_modules():
        if not _quantizers(m) or name == "":
            continue
        kind = real_kind(m)
        if kind is not None:
            yield name, m, "float" if _all_disabled(m) else kind
        elif _all_disabled(m) and hasattr(m, "_float_cls"):
            yield name, m, "float"
        elif any(q.is_enabled for q in _quantizers(m).values()):
            msg = (
                f"fake2real: module {name!r} ({type(m).__name__}) has enabled quantizers but no real INT8 "
                f"implementation (only {', '.join(c.__name__ for c in convertible_classes())} convert); disable them or "
                "pass strict=False to keep it fake-quantized"
            )
            if strict:
                raise ValueError(msg)
            log.warning(msg)


def set_validate(model: nn.Module, validate: bool = True) -> None:
    """Turn the NaN/Inf scan of every real module's input on (ValueError naming the module) or off (the default:
    a scan reads a value back to the host, which the inference path avoids, as TensorRT and torchao do)."""
    for _, m in all_real_modules(model):
        cast(RealModule, m).validate = bool(validate)


def _check_backend_fits(name: str, spec: dict, backend: str) -> None:
    why = fast_gemm.why_not(spec, backend) if spec["type"] in WEIGHTED_TYPES else None
    if why is not None:
        raise ValueError(
            f"fake2real: module {name!r} ({fast_gemm.describe(spec)}): backend {backend!r} cannot compute it: {why}"
        )


def fake2real(
    model: nn.Module,
    save_dir=None,
    *,
    backend: str = "auto",
    strict: bool = True,
    inplace: bool = True,
    validate: bool = False,
) -> nn.Module:
    """Convert a calibrated fake-quant model into real INT8 (and packed INT4) modules; optionally save it.

    Args:
        model: a model quantized by :func:`modelopt_lite.quantize` (or :func:`modelopt_lite.fake_quant`) and
            calibrated. Quantizers left collecting by :func:`modelopt_lite.fake_quant` are finished first (on
            ``model`` itself, even with ``inplace=False``).
        save_dir: if given, a directory where ``model_int8.safetensors`` and ``model_int8.json`` are written
            (see :func:`modelopt_lite.real.checkpoint.save_real`).
        backend: GEMM backend, ``"auto"`` by default: the exact paths of :mod:`modelopt_lite.real.int8_gemm` on CPU
            and for float32, the kernels of :mod:`modelopt_lite.real.fast_gemm` for CUDA bfloat16/float16 inputs.
            ``"scaled_mm"`` (FP8), ``"int_mm"``, ``"int4pack"``, ``"int8pack"`` force a path on any device (a
            module the backend cannot compute is a ValueError naming it, its format and why).
        validate: scan every real module's input for NaN/Inf (ValueError); off by default (see :func:`set_validate`).
        strict: raise for quantized modules that cannot become real (otherwise they stay fake-quantized).
        inplace: convert ``model`` itself (default) or a deep copy.

    Returns:
        The converted model. Its outputs equal the fake-quant model's up to float32 accumulation-order rounding
        (``module.error_bound(x)``); dequant-path modules (weight-only, INT4 blocks) are bit-identical.

    Raises:
        ValueError: a module that cannot be converted (named, with the quantizer and the reason).
    """
    check_backend(backend)
    if not isinstance(model, nn.Module):
        raise TypeError(f"fake2real expects an nn.Module, got {type(model).__name__}")
    if has_pending_calibration(model):  # finished on the caller's model (also with inplace=False)
        finish_calibration(model)
    if not inplace:
        model = copy.deepcopy(model)
    plan = list(_targets(model, strict))
    if any(n == "" for n, _, _ in plan):
        raise ValueError("fake2real: the model itself is a quantized module; wrap it in a container")
    _check_calibrated(plan)
    built = []
    for name, m, kind in plan:  # build everything first: nothing changes if a module fails
        if kind == "float":
            built.append((name, revert_to_float(m)))
            continue
        if kind in WEIGHTED_TYPES:
            spec, tensors = _spec_and_tensors(name, m, kind)
            _check_backend_fits(name, spec, backend)
            device = m.weight.device
        else:
            spec, tensors = _pool_spec_and_tensors(name, m, kind)
            device = _quantizers(m)["input_quantizer"].amax.device
        real = cast(RealModule, build_real_module(spec, tensors, backend, device=device))
        real.train(m.training)
        real.label, real.validate = name, bool(validate)
        built.append((name, real))
    for name, new in built:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    real_kinds = tuple(REAL_CLASSES.values())
    log.info(
        "fake2real: %d real modules, %d reverted to float",
        sum(isinstance(n, real_kinds) for _, n in built),
        sum(not isinstance(n, real_kinds) for _, n in built),
    )
    if save_dir is not None:
        save_real(model, save_dir)
    return model


compress = fake2real
