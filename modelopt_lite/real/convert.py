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
- a quantized module whose quantizers are all disabled goes back to its float class (auto_skip leaves such layers).
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from ..formats import int_range
from ..functional import blocks, library
from ..functional.checks import check_axes
from ..functional.scales import scale_from_amax
from .modules import QuantizedConv2d, QuantizedLinear
from .packing import dequantize_weight, pack_int4

log = logging.getLogger(__name__)


def _quant_classes():
    from ..nn.modules.quant_conv import QuantConv2d
    from ..nn.modules.quant_linear import QuantLinear

    return QuantLinear, QuantConv2d


def _quantizers(module: nn.Module) -> dict:
    from ..conversion.utils import is_quantizer

    return {n: q for n, q in module.named_children() if is_quantizer(q)}


def _fail(name: str, what: str, why: str):
    raise ValueError(f"fake2real: module {name!r}: {what} {why}")


def _weight_part(name: str, module: nn.Module, wq) -> tuple[dict, dict]:
    info = wq.export_info()
    w = module.weight.detach()
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
        fake_w = wq(module.weight)
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


def _input_scales(name: str, iq) -> tuple[dict, torch.Tensor]:
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
    spec = {
        "type": kind,
        "weight_shape": list(module.weight.shape),
        "weight": wspec,
        "input": None,
        "bias": None if module.bias is None else str(module.bias.dtype).replace("torch.", ""),
    }
    if module.bias is not None:
        tensors["bias"] = module.bias.detach().clone()
    pqs = None if iq is None else iq.pre_quant_scale
    if pqs is not None and (kind != "QuantizedLinear" or not iq.is_enabled):
        _fail(
            name,
            "input_quantizer",
            "has a SmoothQuant pre_quant_scale, which real modules support only on an "
            "enabled Linear input; keep this model fake-quantized (or export it to ONNX, where it is a Mul)",
        )
    if iq is not None and iq.is_enabled:
        spec["input"], tensors["input_scale"] = _input_scales(name, iq)
    if pqs is not None:
        spec["input"]["pre_quant_scale"] = True
        tensors["pre_quant_scale"] = pqs.detach().clone()
    if kind == "QuantizedConv2d":
        p = module.padding
        spec["conv"] = {
            "stride": list(module.stride),
            "padding": p if isinstance(p, str) else list(p),
            "dilation": list(module.dilation),
            "groups": module.groups,
            "padding_mode": module.padding_mode,
        }
    return spec, tensors


REAL_CLASSES = {"QuantizedLinear": QuantizedLinear, "QuantizedConv2d": QuantizedConv2d}


def build_real_module(spec: dict, tensors: dict | None = None, backend: str = "auto", device=None) -> nn.Module:
    """A real module from its spec (and tensors, copied in); used by :func:`fake2real` and the checkpoint loader."""
    if spec.get("type") not in REAL_CLASSES:
        raise ValueError(f"unknown real module type {spec.get('type')!r}; expected one of {sorted(REAL_CLASSES)}")
    mod = REAL_CLASSES[spec["type"]](spec, backend)
    if device is not None:
        mod = mod.to(device)
    if tensors is not None:
        for k, t in tensors.items():
            getattr(mod, k).copy_(t)
    return mod


def revert_to_float(module: nn.Module) -> nn.Module:
    """A float copy of a quantized module (its ``_float_cls``) without quantizers; weights identical."""
    new = copy.copy(module)
    new._modules = {k: v for k, v in module._modules.items() if k not in _quantizers(module)}
    new._parameters, new._buffers = dict(module._parameters), dict(module._buffers)
    new.__class__ = module._float_cls
    return new


def _all_disabled(module: nn.Module) -> bool:
    qs = _quantizers(module)
    return bool(qs) and not any(q.is_enabled for q in qs.values())


def _targets(model: nn.Module, strict: bool):
    quant_linear, quant_conv2d = _quant_classes()
    for name, m in model.named_modules():
        if not _quantizers(m) or name == "":
            continue
        if type(m) is quant_linear or type(m) is quant_conv2d:
            if _all_disabled(m):
                yield name, m, "float"
            else:
                yield name, m, "QuantizedLinear" if type(m) is quant_linear else "QuantizedConv2d"
        elif _all_disabled(m) and hasattr(m, "_float_cls"):
            yield name, m, "float"
        elif any(q.is_enabled for q in _quantizers(m).values()):
            msg = (
                f"fake2real: module {name!r} ({type(m).__name__}) has enabled quantizers but no real INT8 "
                "implementation (only QuantLinear and QuantConv2d convert); disable them or pass strict=False "
                "to keep it fake-quantized"
            )
            if strict:
                raise ValueError(msg)
            log.warning(msg)


def fake2real(
    model: nn.Module, save_dir=None, *, backend: str = "auto", strict: bool = True, inplace: bool = True
) -> nn.Module:
    """Convert a calibrated fake-quant model into real INT8 (and packed INT4) modules; optionally save it.

    Args:
        model: a model quantized by :func:`modelopt_lite.quantize` (or :func:`modelopt_lite.fake_quant`) and
            calibrated. Quantizers left collecting by :func:`modelopt_lite.fake_quant` are finished first (on
            ``model`` itself, even with ``inplace=False``).
        save_dir: if given, a directory where ``model_int8.safetensors`` and ``model_int8.json`` are written
            (see :func:`modelopt_lite.real.checkpoint.save_real`).
        backend: integer GEMM backend (see :mod:`modelopt_lite.real.int8_gemm`), ``"auto"`` by default.
        strict: raise for quantized modules that cannot become real (otherwise they stay fake-quantized).
        inplace: convert ``model`` itself (default) or a deep copy.

    Returns:
        The converted model. Its outputs equal the fake-quant model's up to float32 accumulation-order rounding
        (``module.error_bound(x)``); dequant-path modules (weight-only, INT4 blocks) are bit-identical.

    Raises:
        ValueError: a module that cannot be converted (named, with the quantizer and the reason).
    """
    from .int8_gemm import check_backend
    from .seed_api import finish_calibration, has_pending_calibration

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
    built = []
    for name, m, kind in plan:  # build everything first: nothing changes if a module fails
        if kind == "float":
            built.append((name, revert_to_float(m)))
            continue
        spec, tensors = _spec_and_tensors(name, m, kind)
        real = build_real_module(spec, tensors, backend, device=m.weight.device)
        real.train(m.training)
        built.append((name, real))
    for name, new in built:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    log.info(
        "fake2real: %d real modules, %d reverted to float",
        sum(not isinstance(n, nn.Linear | nn.Conv2d) for _, n in built),
        sum(isinstance(n, nn.Linear | nn.Conv2d) for _, n in built),
    )
    if save_dir is not None:
        from .checkpoint import save_real

        save_real(model, save_dir)
    return model


compress = fake2real


def real_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every real quantized module in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, tuple(REAL_CLASSES.values()))]
