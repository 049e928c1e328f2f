"""Real FP8 (E4M3) W8A8: weight storage, conversion checks and the activation codes ``torch._scaled_mm`` consumes.

Storage (spec ``weight`` entry ``{"num_bits": 8, "storage": "e4m3", "layout": "tensor" | "channel", ...}``):
``weight`` holds the ``float8_e4m3fn`` codes ``e4m3(clamp(w / s, -448, 448))`` ``(N, K)`` row-major and
``weight_scale`` the float32 scale (``()`` per tensor, ``(N,)`` per output channel). The input spec entry
``{"num_bits": 8, "elem": "e4m3", "dynamic": None | "tensor" | "row", ...}`` keeps the calibrated static scale
(``input_scale``, per temporal step) or, for dynamic quantizers, none: the scale is recomputed per call
(per tensor, or per row = per token, the amax over the last dim).

Activation codes equal the fake-quant input quantizer's bit for bit: ``float32(x) / s`` is a true division by a
float32 TENSOR (never a Python number, which CUDA evaluates as a reciprocal multiply), saturated to +-448 and cast
with round-to-nearest-even. A dead range (``amax <= 2**-24``, scale 0) gives ``+0`` codes, as the fake quantizer
does. The dynamic chain has no clamp: ``|x| / fl(amax / 448) <= 448 (1 + 2**-23) < 464`` always rounds to a finite
code, so the float-to-E4M3 cast alone is the saturating cast there.
"""

from __future__ import annotations

from typing import cast

import torch

from ..formats import E4M3_DTYPE, E4M3_MAX, e4m3_codes
from ..functional import library, library_real
from ..functional.scales import scale_from_amax

#: the dynamic granularities of an FP8 input spec
DYNAMIC = (None, "tensor", "row")


def _fail(name: str, what: str, why: str):
    raise ValueError(f"fake2real: module {name!r}: {what} {why}")


def is_fp8_weight(w: dict) -> bool:
    """Whether a (non-microscaling) weight spec entry stores E4M3 codes."""
    return w.get("storage") == "e4m3"


def is_fp8_input(inp: dict | None) -> bool:
    """Whether an input spec entry is an E4M3 activation quantizer."""
    return inp is not None and inp.get("elem") == "e4m3"


def weight_part(name: str, weight: torch.Tensor, wq, info: dict) -> tuple[dict, dict]:
    """``(spec["weight"], tensors)`` of an E4M3 weight quantizer (per tensor or per output channel)."""
    if info["dynamic"]:
        _fail(name, "weight_quantizer", "is dynamic; calibrate it (static amax) before fake2real")
    if info["block_sizes"]:
        _fail(name, "weight_quantizer", "is E4M3 in blocks; real FP8 weights are per tensor or per output channel")
    codes, scale = wq.quantize_weight_codes(weight.detach())
    if scale.numel() == 1 and info["axis"] is None:
        layout, axis, stored = "tensor", None, scale.float().reshape(())
    elif tuple(info["axis"] or ()) == (0,) and scale.numel() == weight.shape[0]:
        layout, axis, stored = "channel", [0], scale.float().reshape(-1)
    else:
        _fail(name, "weight_quantizer", f"has axis={info['axis']}; real FP8 weights are per tensor or axis 0")
    spec = {
        "num_bits": 8,
        "unsigned": False,
        "narrow_range": False,
        "layout": layout,
        "axis": axis,
        "block_sizes": None,
        "storage": "e4m3",
        "dtype": str(weight.dtype).replace("torch.", ""),
    }
    with torch.no_grad():
        fake_w = wq(weight)
    if not torch.equal(dequantize(codes, stored).to(weight.dtype), fake_w):
        raise RuntimeError(
            f"fake2real: module {name!r}: the E4M3 weight codes do not reproduce the weight quantizer's output; "
            "please report this"
        )
    return spec, {"weight": codes.to(E4M3_DTYPE).contiguous(), "weight_scale": stored.contiguous()}


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``code * scale`` (per-channel scales ``(N,)`` broadcast over rows), the fake-quant weight."""
    s = scale.reshape(-1, *([1] * (codes.dim() - 1))) if scale.dim() == 1 else scale
    return codes.float() * s


def _dynamic_kind(name: str, iq, info: dict) -> str:
    axis = info["axis"]
    if axis is None:
        return "tensor"
    rank = getattr(iq, "_last_rank", None) or (max(axis) + 2)
    if tuple(sorted(axis)) != tuple(range(rank - 1)):
        _fail(
            name,
            "input_quantizer",
            f"is dynamic with axis={axis}; real FP8 activations are dynamic per tensor or per row (every dim but "
            "the last kept)",
        )
    return "row"


def input_part(name: str, iq, in_features: int) -> tuple[dict, torch.Tensor | None]:
    """``(spec["input"], input_scale or None)`` of an E4M3 input quantizer, checked on a probe bit for bit."""
    info = iq.export_info()
    steps = int(getattr(iq, "num_steps", 1))
    dynamic = _dynamic_kind(name, iq, info) if info["dynamic"] else None
    if dynamic is not None and steps != 1:
        _fail(name, "input_quantizer", "is dynamic and temporal; real FP8 dynamic inputs have one step")
    if info["block_sizes"]:
        _fail(name, "input_quantizer", "is E4M3 in blocks; real FP8 activations are per tensor or per row")
    if dynamic is None and info["axis"] is not None:
        _fail(name, "input_quantizer", f"has a static axis={info['axis']}; real FP8 static inputs are per tensor")
    spec = {
        "num_bits": 8,
        "unsigned": False,
        "narrow_range": False,
        "num_steps": steps,
        "elem": "e4m3",
        "dynamic": dynamic,
    }
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(6, in_features, generator=g) * torch.logspace(-3, 2, 6).view(6, 1)
    probe[2] = 0.0
    probe[3] *= 1e-30  # a dead row for the dynamic per-row scale
    pqs, iq.pre_quant_scale = iq.pre_quant_scale, None  # the probe checks the grid alone; restored below
    saved = iq.step if steps > 1 else None
    scales = []
    try:
        for t in range(steps):
            if steps > 1:
                iq.step = t
            scale = None if dynamic else scale_from_amax(iq.export_info()["amax"].reshape(()), E4M3_MAX).reshape(1)
            p = probe.to(scale.device) if scale is not None else probe
            codes, s = input_codes(p, dynamic, scale)
            with torch.no_grad():
                ok = torch.equal((codes.float() * s).to(p.dtype), iq(p))
            if not ok:
                raise RuntimeError(
                    f"fake2real: module {name!r}: the E4M3 input codes do not reproduce the input quantizer at "
                    f"step {t}; please report this ({info!r})"
                )
            if scale is not None:
                scales.append(scale.reshape(()))
    finally:
        iq.pre_quant_scale = pqs
        if saved is not None:
            iq.step = saved
    return spec, (torch.stack(scales).float().contiguous() if scales else None)


def dynamic_codes(x2d: torch.Tensor, per_row: bool, bound: torch.Tensor | None = None):
    """``(codes, scale)`` of a dynamic E4M3 quantization of ``(M, K)`` rows (pure torch, six ops; see
    :func:`~modelopt_lite.functional.library_real.fp8_dynamic_reference`, which the fused CUDA kernel equals). NaN/Inf
    inputs are not propagated (their rows give codes 0 and a NaN / Inf scale); ``validate=True`` on the real model
    rejects them."""
    return library_real.fp8_dynamic_reference(x2d, per_row, bound)


def static_codes(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``x / divisor`` (``divisor``: float32 ``(1,)``; a dead scale 0 is passed as +Inf, giving +-0
    codes). Ops: ``div`` (true division, float32 result), ``clamp_`` (saturation), ``_to_copy`` (E4M3)."""
    return library_real.fp8_static_reference(x, divisor)


def input_codes(x: torch.Tensor, dynamic: str | None, scale: torch.Tensor | None):
    """Reference entry (conversion probes, tests): ``(codes, scale broadcastable to x)`` for a static ``scale``
    (float32, one element; 0 = dead) or a dynamic granularity; x of any rank (rows = every dim but the last)."""
    if dynamic is None:
        s = cast(torch.Tensor, scale).reshape([1] * x.dim())  # a static quantizer comes with its scale
        return e4m3_codes(x, s), s
    rows = x.reshape(-1, x.shape[-1])
    codes, s = dynamic_codes(rows, dynamic == "row")
    shape = (*x.shape[:-1], 1) if dynamic == "row" else [1] * x.dim()
    return codes.reshape(x.shape), s.reshape(shape)


def fake_quant(x: torch.Tensor, dynamic: str | None, scale: torch.Tensor | None) -> torch.Tensor:
    """The fake-quant model's input quantization (x's dtype): the static op, or the dynamic codes times scale."""
    if dynamic is None:
        return library.fake_e4m3(x, cast(torch.Tensor, scale).reshape(()))  # static: the scale is given
    codes, s = input_codes(x, dynamic, None)
    return (codes.float() * s).to(x.dtype)


def check_values(path_bad, name: str, tensors: dict):
    """``(key, tensor, ok mask, why)`` of the first invalid stored FP8 weight value, or None."""
    c = tensors[f"{name}.weight"]
    if c.dtype != E4M3_DTYPE:
        return None  # the dtype itself is checked against the model's buffers
    cf = c.float()
    ok = torch.isfinite(cf)
    if not bool(ok.all()):
        return f"{name}.weight", cf, ok, "E4M3 weight codes must be finite (0x7F/0xFF are NaN)"
    return None
