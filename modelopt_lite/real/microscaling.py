"""Real NVFP4 and OCP MX weights (and their activations) in the real modules: packed codes, E4M3/E8M0 block scales.

Storage of a weight quantized with a :class:`~modelopt_lite.formats.BlockScheme` (spec ``weight`` entry
``{"format": "nvfp4" | "mx", "scheme", "elem", "block", "rounding", "storage", "dtype"}``):

- ``weight_packed`` (``storage="fp4"``): uint8, two E2M1 codes per byte (element ``2j`` in the low nibble, the ONNX
  FLOAT4E2M1 order); or ``weight_codes`` (``"e4m3"``/``"e5m2"``: the float8 bit patterns as uint8; ``"int8"``:
  MXINT8's ``q`` of ``q / 64``);
- ``weight_block_scale``: uint8 of shape ``(..., nblocks)``: NVFP4's E4M3 block scales (their bit patterns) or MX's
  E8M0 exponents (biased by 127);
- ``weight_global_scale``: float32 ``()``, NVFP4 only: ``amax / (6 * 448)``.

NVFP4 weights take 4.5 bits per element (+ one float32): about 0.14x of float32. Dequantization
(:func:`~modelopt_lite.functional.microscaling.dequantize_nvfp4` / ``dequantize_mx``) gives exactly the weight
quantizer's output, which :func:`weight_part` checks at conversion. Activations (spec ``input`` entry ``{"format",
"scheme", "elem", "block", "rounding", "num_steps": 1}``) are fake-quantized at run time by the same op as the
fake-quant input quantizer; NVFP4 keeps its calibrated global scale in ``input_scale`` (shape ``(1,)``). Such
modules compute with ``compute="dequant"`` (the float op on dequantized weights), bit-identical to fake quantization.
"""

from __future__ import annotations

import torch

from ..functional import library_mx
from ..functional import microscaling as mx
from .packing import pack_int4, unpack_int4

#: weight storage of each MX element (E2M1 is packed two per byte)
STORAGE = {"e2m1": "fp4", "e4m3": "e4m3", "e5m2": "e5m2", "int8": "int8"}
_FLOAT8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: the keys of a microscaling weight / input spec
WEIGHT_KEYS = {"format", "scheme", "elem", "block", "rounding", "storage", "dtype"}
INPUT_KEYS = {"format", "scheme", "elem", "block", "rounding", "num_steps"}
FORMATS = ("nvfp4", "mx")


def scheme_of(q):
    """The quantizer's block scheme (NVFP4 / MX), or None."""
    return getattr(q.quant_desc, "block_scheme", None)


def is_microscaling(spec_entry: dict | None) -> bool:
    """Whether a weight/input spec entry is NVFP4/MX (it has a ``format`` key)."""
    return spec_entry is not None and "format" in spec_entry


def _entry(q) -> dict:
    s = scheme_of(q)
    block = int(q.quant_desc.block_sizes[-1])
    return {"format": s.kind, "scheme": s.name, "elem": s.elem, "block": block, "rounding": s.rounding}


def _global_scale(q) -> torch.Tensor:
    return mx.nvfp4_global_scale(q.amax.detach().float().reshape(()))


def weight_part(name: str, weight: torch.Tensor, wq, fake_w: torch.Tensor) -> tuple[dict, dict]:
    """``(spec["weight"], tensors)`` of an NVFP4/MX weight; RuntimeError if they do not reproduce ``fake_w``."""
    e = _entry(wq)
    w = weight.detach().float()
    if e["format"] == "nvfp4" and wq.is_nvfp4_static:  # stored block amaxes under the stored global amax
        if wq.amax_pre is not None:
            raise ValueError(
                f"fake2real: module {name!r}: the weight quantizer is in LSQ mode (learned pre/post amaxes): its weight has no single "
                "NVFP4 encoding; call weight_quantizer.disable_lsq() (or fold the learned amax into .amax) first"
            )
        gs = mx.nvfp4_global_scale(wq.global_amax.detach().float().reshape(()))
        codes, s = mx.quantize_nvfp4(w, gs, e["block"], block_amax=wq._block_amax_for(w))
    if e["format"] == "nvfp4":
        if not wq.is_nvfp4_static:
            gs = _global_scale(wq)
            codes, s = mx.quantize_nvfp4(w, gs, e["block"])
        tensors = {
            "weight_packed": pack_int4(codes),
            "weight_block_scale": s.view(torch.uint8),
            "weight_global_scale": gs,
        }
        storage = "fp4"
    else:
        codes, e8 = mx.quantize_mx(w, e["elem"], e["block"], e["rounding"])
        storage = STORAGE[e["elem"]]
        stored = pack_int4(codes) if storage == "fp4" else codes.view(torch.uint8) if storage in _FLOAT8 else codes
        tensors = {"weight_packed" if storage == "fp4" else "weight_codes": stored, "weight_block_scale": e8}
    spec = dict(e, storage=storage, dtype=str(weight.dtype).replace("torch.", ""))
    deq = dequantize(spec, tensors, tuple(weight.shape)).to(weight.dtype)
    if not torch.equal(deq, fake_w):
        raise RuntimeError(
            f"fake2real: module {name!r}: the {e['scheme']} codes do not reproduce the weight quantizer's output; "
            "please report this"
        )
    return spec, {k: v.contiguous() for k, v in tensors.items()}


def dequantize(spec: dict, tensors: dict, shape: tuple) -> torch.Tensor:
    """float32 weights from the stored codes and scales (exactly the fake-quant weights)."""
    k = shape[-1]
    if spec["storage"] == "fp4":
        codes = unpack_int4(tensors["weight_packed"], k, signed=False).to(torch.uint8)
    elif spec["storage"] in _FLOAT8:
        codes = tensors["weight_codes"].view(_FLOAT8[spec["storage"]])
    else:
        codes = tensors["weight_codes"]
    if spec["format"] == "nvfp4":
        s = tensors["weight_block_scale"].view(torch.float8_e4m3fn)
        return mx.dequantize_nvfp4(codes, s, tensors["weight_global_scale"], spec["block"])
    return mx.dequantize_mx(codes, tensors["weight_block_scale"], spec["elem"], spec["block"])


def weight_buffers(spec: dict, shape: tuple) -> dict[str, torch.Tensor]:
    """Empty buffers (name -> tensor) of a weight spec, in their stored dtypes and shapes."""
    nb = (shape[-1] + spec["block"] - 1) // spec["block"]
    out = {}
    if spec["storage"] == "fp4":
        out["weight_packed"] = torch.zeros(shape[:-1] + ((shape[-1] + 1) // 2,), dtype=torch.uint8)
    else:
        out["weight_codes"] = torch.zeros(shape, dtype=torch.int8 if spec["storage"] == "int8" else torch.uint8)
    out["weight_block_scale"] = torch.zeros(shape[:-1] + (nb,), dtype=torch.uint8)
    if spec["format"] == "nvfp4":
        out["weight_global_scale"] = torch.zeros((), dtype=torch.float32)
    return out


def input_part(name: str, iq) -> tuple[dict, torch.Tensor]:
    """``(spec["input"], input_scale)`` of an NVFP4/MX input quantizer (checked on a probe)."""
    e = dict(_entry(iq), num_steps=1)
    if int(getattr(iq, "num_steps", 1)) != 1:
        raise ValueError(
            f"fake2real: module {name!r}: input_quantizer: temporal {e['scheme']} inputs are not supported"
        )
    scale = _global_scale(iq).reshape(1) if e["format"] == "nvfp4" else torch.zeros(1)
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(4, 4 * e["block"], generator=g) * torch.logspace(-3, 3, 4 * e["block"])
    with torch.no_grad():
        if not torch.equal(fake_quant(e, scale, probe), iq(probe)):
            raise RuntimeError(
                f"fake2real: module {name!r}: the stored {e['scheme']} input quantization does not reproduce the "
                "input quantizer; please report this"
            )
    return e, scale.float()


def fake_quant(inp: dict, input_scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The run-time NVFP4/MX fake quantization of an activation, as the fake-quant input quantizer computes it."""
    if inp["format"] == "nvfp4":
        return library_mx.fake_nvfp4(x, input_scale.reshape(()).to(x.device), inp["block"])
    return library_mx.fake_mx(x, inp["elem"], inp["block"], inp["rounding"])


# --- validation of untrusted specs and values (load_real) ----------------------------------------------------------
def check_entry(entry: dict, weight: bool) -> str | None:
    """Why a weight/input spec entry is malformed, or None (keys are checked by the caller)."""
    fmt, elem, block, rounding = entry["format"], entry["elem"], entry["block"], entry["rounding"]
    if fmt not in FORMATS:
        return f"format must be one of {FORMATS}, got {fmt!r}"
    if elem not in mx.MX_ELEMENTS or (fmt == "nvfp4" and elem != "e2m1"):
        return f"elem {elem!r} is not an element of {fmt}"
    allowed = mx.NVFP4_BLOCK_SIZES if fmt == "nvfp4" else mx.MX_BLOCK_SIZES
    if isinstance(block, bool) or block not in allowed:
        return f"block must be one of {allowed} for {fmt}, got {block!r}"
    if rounding not in mx.MX_ROUNDINGS:
        return f"rounding must be one of {mx.MX_ROUNDINGS}, got {rounding!r}"
    if fmt == "nvfp4" and rounding != "floor":
        return f"rounding must be 'floor' for nvfp4 (it has no E8M0 scales to round), got {rounding!r}"
    if not isinstance(entry["scheme"], str):
        return f"scheme must be a string, got {entry['scheme']!r}"
    if weight and entry["storage"] != STORAGE[elem]:
        return f"storage must be {STORAGE[elem]!r} for {elem}, got {entry['storage']!r}"
    if not weight and entry["num_steps"] != 1:
        return f"num_steps must be 1, got {entry['num_steps']!r}"
    return None


def check_values(spec: dict, tensors: dict, name: str):
    """``(key, tensor, ok mask, why)`` of the first invalid stored value of a weight, or None."""
    w = spec["weight"]
    s = tensors[f"{name}.weight_block_scale"]
    if w["format"] == "nvfp4":
        sv = s.view(torch.float8_e4m3fn).float()
        ok = torch.isfinite(sv) & (sv >= 0)
        if not bool(ok.all()):
            return f"{name}.weight_block_scale", sv, ok, "E4M3 block scales must be finite and >= 0"
        gs = tensors[f"{name}.weight_global_scale"]
        ok = torch.isfinite(gs) & (gs >= 0)
        if not bool(ok.all()):
            return f"{name}.weight_global_scale", gs, ok, "the global scale must be finite and >= 0"
    else:
        ok = s != 255
        if not bool(ok.all()):
            return f"{name}.weight_block_scale", s, ok, "E8M0 scales must not be 255 (NaN)"
    if w["storage"] in _FLOAT8:
        c = tensors[f"{name}.weight_codes"].view(_FLOAT8[w["storage"]]).float()
        ok = torch.isfinite(c)
        if not bool(ok.all()):
            return f"{name}.weight_codes", c, ok, f"{w['storage']} codes must be finite"
    elif w["storage"] == "int8":
        c = tensors[f"{name}.weight_codes"]
        ok = (c >= -127) & (c <= 127)
        if not bool(ok.all()):
            return f"{name}.weight_codes", c, ok, "MXINT8 codes must lie in [-127, 127]"
    return None
