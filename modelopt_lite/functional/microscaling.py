"""The pure-torch reference of the 4-bit and microscaling formats: FP4 E2M1, FP8 E5M2, NVFP4 and OCP MX.

Every backend (C++, CUDA) is tested bit for bit against these functions, so each float32 operation and its order
is written down here. Blocks run along the LAST axis; a partial last block is treated as zero-padded (padding never
changes a block's amax, and the padded elements are never returned). ``x`` may be float32, float16 or bfloat16; it
is converted to float32 first (exact) and fake-quant results are cast back to ``x``'s dtype at the very end.
``rne`` = round to nearest, ties to even; ``/`` = IEEE float32 true division; ``*`` = IEEE float32 multiplication.

Element formats (``v`` a float32 value already divided by its scale):

- E2M1 (FP4, ``num_bits=(2, 1)``): magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, no Inf/NaN. ``e2m1_round(v)``:
  ``m = min(|v|, 6)``; ``step = 0.5`` if ``m < 2``, ``1`` if ``m < 4``, else ``2``; ``m = rne(m / step) * step``
  (``m / step`` and ``* step`` are exact: powers of two); the result is ``-m`` where ``v < 0`` else ``m`` (so a
  negative value that rounds to 0 gives ``-0.0``, code ``0b1000``; ``-0.0`` itself gives ``+0.0``). Rounding on the
  uniform grid of each binade is round-half-to-even on the codes: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
  2.5 -> 2, 3.5 -> 4, 5 -> 4; everything above 6 saturates to 6.
  Codes (uint8 0..15): bit 3 is the sign (``v < 0``), bits 0..2 the magnitude's index in the list above.
- E4M3 (``(4, 3)``): ``float8_e4m3fn(clamp(v, -448, 448))`` (rne cast, saturating; max 448, subnormals down to
  2**-9).
- E5M2 (``(5, 2)``): ``float8_e5m2(clamp(v, -57344, 57344))`` (rne cast, saturating; max 57344, subnormals down to
  2**-16). ``e5m2_round`` returns it as float32.
- INT8 of MX (MXINT8): a 1.6 fixed-point value ``q / 64``, ``q = clamp(rne(v * 64), -127, 127)`` (``v * 64`` is
  exact). The grid is kept symmetric (-128, the value -2.0, is never produced; OCP v1.0 allows an implementation
  to avoid it), so the element maximum is ``127 / 64``.

NVFP4 (``{"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}``), with ``gs`` a
per-tensor float32 global scale:

1. ``gs = float32(amax) / 2688.0`` (``2688 = 6 * 448``, one division); ``gs = 0`` where ``amax <= 2**-24``
   (a dead tensor: every output is 0). ``amax`` is a calibrated (static) value or the tensor's own max.
2. per block: ``a = max |x|`` over the block (exact; static NVFP4, ``"type": "static"``: ``a`` is the stored,
   calibrated block amax instead, and nothing else changes), ``d = 6.0 * gs`` (one rounded multiply, computed once),
   ``s = float8_e4m3fn(min(a / d, 448))`` (the E4M3 block scale; saturates at 448 when ``a`` exceeds the static
   amax); ``s = 0`` everywhere when ``gs == 0``. A block whose scale rounds to 0 (``a / d <= 2**-10``, including
   an all-zero block) is dead: codes 0, outputs ``+0.0``, never NaN. (ModelOpt instead clamps such scales up to
   2**-9; only blocks more than ~2**18.8 times smaller than the tensor's amax differ.)
3. per element: ``ds = s * gs`` (one rounded multiply per block), ``v = x / ds`` (true division, NOT ``x * (1 /
   ds)``), ``q = e2m1_round(v)``, ``y = q * ds``.

Allowed NVFP4 block sizes: 16 (the NVFP4 format) and 32 (ModelOpt's ``W4A8_NVFP4_FP8_CFG`` weights).

OCP Microscaling (MX v1.0; ``"scale_bits": (8, 0)``), blocks of 32 (the only size v1.0 defines), element ``elem``
in ``{"e4m3", "e5m2", "e2m1", "int8"}`` with ``emax_elem`` 8, 15, 2, 0 and element maximum 448, 57344, 6, 127/64:

1. per block: ``a = max |x|`` (exact). ``floor_log2(a)`` is the exponent of ``a`` (exact: for a normal float32 its
   unbiased exponent field; for a subnormal the position of its leading bit, -127..-149).
   ``rounding="floor"`` (the OCP rule): ``k = floor_log2(a) - emax_elem``; elements above the element maximum
   then saturate (e.g. E4M3 with ``a = 1.9 * 2**e``).
   ``rounding="rceil"`` (the variant of NVIDIA's Blackwell MX conversion and ModelOpt's qtensors: the smallest
   power of two with ``a / 2**k <= elem_max``): ``k = floor_log2(a) - emax_elem + 1`` when the significand of
   ``a`` (``a / 2**floor_log2(a)``, in [1, 2)) exceeds the element maximum's significand (1.75 for E4M3 and E5M2,
   1.5 for E2M1, 127/64 for INT8), else ``floor_log2(a) - emax_elem``. Computed exactly on the bits, never with a
   float ``log2``.
   Then ``k = clamp(k, -127, 127)``; an all-zero block (``a == 0``) gets ``k = -127``. Stored as E8M0:
   ``uint8(k + 127)`` (255, the E8M0 NaN, is never produced).
2. per element: ``X = 2**k`` (exact in float32, 2**-127 being subnormal), ``v = x / X`` (equal to ``x * 2**-k``
   bit for bit: both are the correctly rounded value of the same real number), element rounding above,
   ``y = elem(v) * X``.

Bad input gets a ValueError: NaN/Inf in ``x`` (no E2M1/INT8 code can hold it and an Inf amax has no scale), a
negative/NaN/Inf amax, an unknown element or rounding name, a block size not allowed above. (The checks are skipped
while torch.compile/torch.export trace.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..formats import (
    AMAX_EPS,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E5M2_MAX,
    FLOAT_ELEMENTS,
    MX_SCALE_ROUNDINGS,
    e2m1_round,
    e4m3_round,
    e5m2_round,
)
from .checks import _compiling, check_input, first_bad
from .division import true_div, true_div_

__all__ = [
    "E2M1_MAX", "E2M1_VALUES", "E5M2_MAX", "MX_ELEMENTS", "NVFP4_BLOCK_SIZES", "MX_BLOCK_SIZES", "MX_ROUNDINGS",
    "e2m1_round", "e2m1_codes", "e2m1_decode", "e4m3_round", "e5m2_round", "int8_mx_round",
    "nvfp4_global_scale", "nvfp4_block_scales", "check_nvfp4_block_amax", "fake_nvfp4", "quantize_nvfp4", "dequantize_nvfp4",
    "mx_scale_exponents", "fake_mx", "quantize_mx", "dequantize_mx", "nvfp4_backward", "mx_backward",
]  # fmt: skip

#: ``6 * 448``: NVFP4's global scale is ``amax / NVFP4_GLOBAL_BOUND``.
NVFP4_GLOBAL_BOUND = E2M1_MAX * E4M3_MAX
#: NVFP4 block sizes accepted (16: the format; 32: ModelOpt's W4A8_NVFP4_FP8 weights) and the MX block size.
NVFP4_BLOCK_SIZES = (16, 32)
MX_BLOCK_SIZES = (32,)
MX_ROUNDINGS = MX_SCALE_ROUNDINGS  #: the E8M0 scale rules (block_sizes["scale_rounding"] picks one)
#: E8M0 exponent range (bias 127; biased 255 is NaN and never produced).
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


class MXElement(NamedTuple):
    """An MX element format: its exponent of the largest power of two, its maximum, and its code container."""

    name: str
    emax: int  #: exponent of the largest power of two the element holds
    max_value: float  #: largest finite element value
    max_significand: float  #: max_value / 2**emax, in [1, 2): the "rceil" threshold
    code_dtype: torch.dtype  #: how quantize_mx returns codes


#: The MX element formats, by name.
MX_ELEMENTS: dict[str, MXElement] = {
    e.name: e
    for e in (
        *(
            MXElement(f.name, f.emax, f.qmax, f.max_significand, f.code_dtype or torch.uint8)  # type: ignore[arg-type]
            for f in (FLOAT_ELEMENTS[nb] for nb in ((4, 3), (5, 2), (2, 1)))
        ),
        MXElement("int8", 0, 127.0 / 64.0, 127.0 / 64.0, torch.int8),
    )
}


# --- element rounding (e2m1_round, e4m3_round, e5m2_round: the formats' own, re-exported here) ------------------
def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15: bit 3 the sign ``v < 0``, bits 0..2 the magnitude index) of float values."""
    v = v.float()
    m = e2m1_round(v).abs_()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    idx = torch.bucketize(m, values)  # m is exactly one of the values: its index
    return (idx + torch.where(v < 0, 8, 0)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (code 8 is ``-0.0``)."""
    c = codes.to(torch.int64)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    m = values[c & 7]
    return torch.where((c & 8) != 0, -m, m)


def int8_mx_round(v: torch.Tensor) -> torch.Tensor:
    """MXINT8 element: ``clamp(rne(v * 64), -127, 127) / 64`` as float32."""
    return true_div_((v.float() * 64.0).round_().clamp_(-127.0, 127.0), 64.0)


_ELEM_ROUND = {"e4m3": e4m3_round, "e5m2": e5m2_round, "e2m1": e2m1_round, "int8": int8_mx_round}


# --- validation and blocks -----------------------------------------------------------------------------------------
def _check_finite(x: torch.Tensor, what: str) -> None:
    if _compiling() or x.numel() == 0:
        return
    bad = ~torch.isfinite(x.detach())
    if bool(bad.any()):
        v = first_bad(x, bad)
        raise ValueError(f"{what} contains NaN or Inf ({v!r}); NVFP4/MX formats cannot represent it: clean the input")


def _check_block(block, allowed: tuple[int, ...], fmt: str) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block not in allowed:
        raise ValueError(f"{fmt} block size must be one of {allowed} along the last axis, got {block!r}")
    return block


def _element(elem) -> MXElement:
    if elem not in MX_ELEMENTS:
        raise ValueError(f"MX element format must be one of {tuple(MX_ELEMENTS)}, got {elem!r}")
    return MX_ELEMENTS[elem]


def _check_blocked_input(x, what: str) -> None:
    """x's dtype and rank (blocks run along the last axis); no pass over the data."""
    check_input(x, what)
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dimension (blocks run along the last axis), got a scalar")


def _prepare(x, what: str) -> None:
    _check_blocked_input(x, what)
    _check_finite(x, what)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 view ``(..., nblocks, block)`` of x, the last partial block zero-padded."""
    xf = x.float()
    pad = (-xf.shape[-1]) % block
    if pad:
        xf = F.pad(xf, (0, pad))
    return xf.reshape(*xf.shape[:-1], xf.shape[-1] // block, block)


def _unblock(y: torch.Tensor, n: int) -> torch.Tensor:
    # the merged length spelled out: -1 is ambiguous for an empty tensor
    return y.reshape(*y.shape[:-2], y.shape[-2] * y.shape[-1])[..., :n]


def _block_amax(xb: torch.Tensor) -> torch.Tensor:
    return xb.abs().amax(dim=-1) if xb.numel() else xb.new_zeros(xb.shape[:-1])


# --- NVFP4 ---------------------------------------------------------------------------------------------------------
def nvfp4_global_scale(amax) -> torch.Tensor:
    """float32 ``amax / 2688`` (``6 * 448``); 0 where ``amax <= 2**-24``. ValueError for NaN/Inf/negative amax.
    (The CUDA kernels of ``library_mx.fake_nvfp4_amax`` compute the same in the kernel and flag a bad amax.)"""
    a = torch.as_tensor(amax).detach().float() if not isinstance(amax, torch.Tensor) else amax.float()
    if not _compiling():
        bad = ~torch.isfinite(a) | (a < 0)
        if bool(bad.any()):
            raise ValueError(f"NVFP4 global amax must be finite and >= 0, got {first_bad(a, bad)!r}")
    gs = true_div(a, NVFP4_GLOBAL_BOUND)  # a tensor divisor: on CUDA, `a / 2688.0` multiplies by the reciprocal
    return torch.where(a <= AMAX_EPS, torch.zeros_like(gs), gs)


def _as_global_scale(global_scale, x: torch.Tensor) -> torch.Tensor:
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    if gs.numel() != 1:
        raise ValueError(f"NVFP4 global_scale must be a single (per-tensor) value, got shape {tuple(gs.shape)}")
    if not _compiling():
        v = float(gs)
        if not v >= 0 or v == float("inf"):
            raise ValueError(f"NVFP4 global_scale must be finite and >= 0, got {v!r}")
    return gs.float().reshape(())


def _nvfp4_scales_from_amax(a: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """``e4m3(min(a / (6 * gs), 448))`` of block amaxes ``a`` (float32), 0 everywhere when ``gs == 0``."""
    d = gs * E2M1_MAX
    safe = torch.where(d == 0, torch.ones_like(d), d)
    s = (a / safe).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(d == 0, torch.zeros_like(s), s)


def check_nvfp4_block_amax(block_amax, x: torch.Tensor, block: int) -> torch.Tensor:
    """Static NVFP4's stored block amaxes as float32 on x's device, shape ``(*x.shape[:-1], nblocks)``; ValueError
    for another shape or a NaN/Inf/negative value."""
    a = torch.as_tensor(block_amax).to(device=x.device, dtype=torch.float32)
    want = (*x.shape[:-1], -(-x.shape[-1] // block))
    if tuple(a.shape) != want:
        raise ValueError(
            f"NVFP4 block amax has shape {tuple(a.shape)}, but an input of shape {tuple(x.shape)} with blocks of "
            f"{block} needs {want} (one per block)"
        )
    if not _compiling():
        bad = ~torch.isfinite(a) | (a < 0)
        if bool(bad.any()):
            raise ValueError(f"NVFP4 block amax must be finite and >= 0, got {first_bad(a, bad)!r}")
    return a


def nvfp4_block_scales(x: torch.Tensor, global_scale, block: int = 16, block_amax=None) -> torch.Tensor:
    """The E4M3-valued float32 block scales ``e4m3(min(block_amax / (6 * gs), 448))``, shape ``(..., nblocks)``;
    ``block_amax`` None: each block's max |x| (dynamic), else the stored amaxes (static NVFP4)."""
    return _nvfp4_values(x, global_scale, block, block_amax)[2]


def _nvfp4_values(x: torch.Tensor, global_scale, block: int, block_amax=None):
    """(v = x / ds with 0 in dead blocks, ds (..., nblocks, 1), block scales, dead mask) on the blocked view.

    The block amaxes are x's own (dynamic NVFP4) or ``block_amax`` (static NVFP4: stored, one per block)."""
    _prepare(x, "NVFP4 input")
    _check_block(block, NVFP4_BLOCK_SIZES, "NVFP4")
    gs = _as_global_scale(global_scale, x)
    xb = _blocks(x, block)
    a = _block_amax(xb) if block_amax is None else check_nvfp4_block_amax(block_amax, x, block)
    s = _nvfp4_scales_from_amax(a, gs)
    ds = (s * gs).unsqueeze(-1)
    dead = ds == 0
    v = xb / torch.where(dead, torch.ones_like(ds), ds)
    return v.masked_fill_(dead, 0.0), ds, s, dead


def fake_nvfp4(x: torch.Tensor, global_scale, block: int = 16, block_amax=None) -> torch.Tensor:
    """NVFP4 quantize-dequantize ``e2m1(x / ds) * ds`` (``ds = s * gs``), in x's dtype; dead blocks give +0.0.
    ``block_amax``: the stored block amaxes of static NVFP4 (None: each block's own max |x|)."""
    v, ds, _, dead = _nvfp4_values(x, global_scale, block, block_amax)
    y = e2m1_round(v).mul_(ds).masked_fill_(dead, 0.0)
    return _unblock(y, x.shape[-1]).to(x.dtype)


def quantize_nvfp4(x: torch.Tensor, global_scale, block: int = 16, block_amax=None):
    """``(codes, block_scales)``: E2M1 codes (uint8 0..15, x's shape, code 0 in dead blocks) and the block scales as
    ``float8_e4m3fn`` of shape ``(..., nblocks)`` (``block_amax`` as in :func:`fake_nvfp4`)."""
    v, _, s, _ = _nvfp4_values(x, global_scale, block, block_amax)
    codes = _unblock(e2m1_codes(v), x.shape[-1])
    return codes, s.to(torch.float8_e4m3fn)


def dequantize_nvfp4(codes: torch.Tensor, block_scales: torch.Tensor, global_scale, block: int = 16, dtype=None):
    """Inverse of :func:`quantize_nvfp4`: ``e2m1(code) * (s * gs)`` (float32 unless ``dtype`` is given)."""
    _check_block(block, NVFP4_BLOCK_SIZES, "NVFP4")
    n = codes.shape[-1]
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=codes.device).reshape(())
    vals = _blocks(e2m1_decode(codes), block)
    y = vals * (block_scales.float() * gs).unsqueeze(-1)
    return _unblock(y, n).to(dtype or torch.float32)


# --- OCP MX --------------------------------------------------------------------------------------------------------
def _check_rounding(rounding) -> str:
    if rounding not in MX_ROUNDINGS:
        raise ValueError(f"MX scale rounding must be one of {MX_ROUNDINGS}, got {rounding!r}")
    return rounding


def _mx_exponents_blocked(xb: torch.Tensor, e: MXElement, rounding: str) -> torch.Tensor:
    a = _block_amax(xb)
    mant, ex = torch.frexp(a)  # a = mant * 2**ex, mant in [0.5, 1): floor(log2(a)) = ex - 1, significand 2 * mant
    k = ex - 1 - e.emax
    if rounding == "rceil":
        k = k + (mant * 2.0 > e.max_significand).to(k.dtype)
    k = k.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    return torch.where(a == 0, torch.full_like(k, E8M0_MIN_EXP), k).to(torch.int32)


def mx_scale_exponents(x: torch.Tensor, elem: str, block: int = 32, rounding: str = "floor") -> torch.Tensor:
    """The unbiased E8M0 exponents ``k`` (int32, shape ``(..., nblocks)``): the block scale is ``2**k``."""
    e = _element(elem)
    _check_rounding(rounding)
    _prepare(x, f"MX ({elem}) input")
    _check_block(block, MX_BLOCK_SIZES, "MX")
    return _mx_exponents_blocked(_blocks(x, block), e, rounding)


def _mx_values(x: torch.Tensor, elem: str, block: int, rounding: str):
    e = _element(elem)
    _check_rounding(rounding)
    _prepare(x, f"MX ({elem}) input")
    _check_block(block, MX_BLOCK_SIZES, "MX")
    xb = _blocks(x, block)
    k = _mx_exponents_blocked(xb, e, rounding)
    scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k).unsqueeze(-1)
    return xb / scale, scale, k


def fake_mx(x: torch.Tensor, elem: str, block: int = 32, rounding: str = "floor") -> torch.Tensor:
    """MX quantize-dequantize ``elem(x / 2**k) * 2**k``, in x's dtype."""
    v, scale, _ = _mx_values(x, elem, block, rounding)
    y = _ELEM_ROUND[elem](v).mul_(scale)
    return _unblock(y, x.shape[-1]).to(x.dtype)


def quantize_mx(x: torch.Tensor, elem: str, block: int = 32, rounding: str = "floor"):
    """``(codes, scales)``: element codes of x's shape in the element's container (float8_e4m3fn, float8_e5m2,
    uint8 E2M1 codes, int8 ``q`` of ``q / 64``) and the E8M0 scales as uint8 ``k + 127`` of shape ``(..., nblocks)``."""
    v, _, k = _mx_values(x, elem, block, rounding)
    if elem == "e2m1":
        codes = e2m1_codes(v)
    elif elem == "int8":
        codes = (v * 64.0).round_().clamp_(-127.0, 127.0).to(torch.int8)
    else:
        codes = _ELEM_ROUND[elem](v).to(MX_ELEMENTS[elem].code_dtype)
    return _unblock(codes, x.shape[-1]), (k + E8M0_BIAS).to(torch.uint8)


def dequantize_mx(codes: torch.Tensor, scales: torch.Tensor, elem: str, block: int = 32, dtype=None):
    """Inverse of :func:`quantize_mx`: ``value(code) * 2**(scale - 127)`` (float32 unless ``dtype`` is given)."""
    _element(elem)
    _check_block(block, MX_BLOCK_SIZES, "MX")
    if elem == "e2m1":
        vals = e2m1_decode(codes)
    elif elem == "int8":
        vals = true_div(codes.float(), 64.0)
    else:
        vals = codes.float()
    k = scales.to(torch.int32) - E8M0_BIAS
    scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k).unsqueeze(-1)
    y = _blocks(vals, block) * scale
    return _unblock(y, codes.shape[-1]).to(dtype or torch.float32)


# --- straight-through gradients ------------------------------------------------------------------------------------
def _ste(grad: torch.Tensor, x: torch.Tensor, top: torch.Tensor, block: int) -> torch.Tensor:
    """grad where ``|x| <= top`` (top: float32 per block, ``(..., nblocks, 1)``), else 0."""
    keep = _blocks(x, block).abs() <= top
    g = _blocks(grad, block) * keep
    return _unblock(g, x.shape[-1]).to(grad.dtype)


def nvfp4_backward(grad: torch.Tensor, x: torch.Tensor, global_scale, block: int = 16, block_amax=None):
    """STE gradient of :func:`fake_nvfp4`: ``grad`` where ``|x| <= 6 * s * gs`` (its block's range), else 0."""
    _, ds, _, _ = _nvfp4_values(x, global_scale, block, block_amax)
    return _ste(grad, x, ds * E2M1_MAX, block)


def mx_backward(grad: torch.Tensor, x: torch.Tensor, elem: str, block: int = 32, rounding: str = "floor"):
    """STE gradient of :func:`fake_mx`: ``grad`` where ``|x| <= elem_max * 2**k`` (its block's range), else 0."""
    _, scale, _ = _mx_values(x, elem, block, rounding)
    return _ste(grad, x, scale * MX_ELEMENTS[elem].max_value, block)
