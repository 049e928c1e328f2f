"""Numeric formats: the integer ranges, code containers and FP8 constants every layer shares.

This module is the one owner of every numeric table: ``bound``, ``qmin`` and ``qmax`` of each integer format
(:func:`int_range`, :func:`format_range`), the containers codes are stored in (:data:`CODE_TYPES`: range, torch
dtype, numpy dtype, ONNX element type and the opset whose Q/DQ accept it; :func:`torch_code_dtype`,
:func:`smallest_code_type`) and FP8 E4M3 (its max, dtype, ONNX type and saturating cast). The reference, the
kernels' callers, the calibrators, the real modules and the exporters ask here, so they cannot disagree (see
``numerics.md`` in the project docs). The int32 bias codes of integer requantization are computed once, in
:func:`modelopt_lite.functional.requant.bias_codes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import NamedTuple

import numpy as np
import torch

#: amax at or below this value marks a "dead" tensor/channel/block: it quantizes to exact zeros.
AMAX_EPS = 2.0**-24

#: Largest finite value of float8 E4M3FN; the FP8 "bound".
E4M3_MAX = 448.0
#: torch dtype of E4M3 codes, and the ONNX ``TensorProto`` element type (by name) that stores them.
E4M3_DTYPE = torch.float8_e4m3fn
E4M3_ONNX_TYPE = "FLOAT8E4M3FN"


class IntRange(NamedTuple):
    """Integer grid of a format: ``scale = amax / bound`` and ``q`` is clamped to ``[qmin, qmax]``."""

    bound: int
    qmin: int
    qmax: int


class UnsupportedFormatError(ValueError, TypeError):
    """An ``(E, M)`` ``num_bits`` that is not a supported float format: a ValueError, and also the TypeError that
    pytorch-quantization raises for it, so code catching either works."""


def int_range(num_bits: int, unsigned: bool = False, narrow_range: bool = False) -> IntRange:
    """Return ``(bound, qmin, qmax)`` for an integer format.

    >>> int_range(8)
    IntRange(bound=127, qmin=-128, qmax=127)
    >>> int_range(8, narrow_range=True)
    IntRange(bound=127, qmin=-127, qmax=127)
    >>> int_range(4, unsigned=True)
    IntRange(bound=15, qmin=0, qmax=15)
    """
    if isinstance(num_bits, bool) or not isinstance(num_bits, int):
        raise TypeError(f"num_bits must be an int for integer formats, got {num_bits!r}")
    if not 1 <= num_bits <= 16:
        raise ValueError(f"num_bits must be in 1..16, got {num_bits}")
    if unsigned:
        bound = 2**num_bits - 1
        return IntRange(bound, 0, bound)
    if num_bits == 1:
        raise ValueError("num_bits=1 needs unsigned=True (a signed 1-bit grid has no positive level)")
    bound = 2 ** (num_bits - 1) - 1
    return IntRange(bound, -bound if narrow_range else -bound - 1, bound)


def is_e4m3(num_bits) -> bool:
    """True when ``num_bits`` names FP8 E4M3, written ``(4, 3)`` (prefer ``element_format(nb).is_e4m3``)."""
    return isinstance(num_bits, tuple) and tuple(num_bits) == (4, 3)


class FloatRange(NamedTuple):
    """The FP8 "grid": ``scale = amax / bound``, ``x / scale`` saturates to ``[qmin, qmax]``."""

    bound: float
    qmin: float
    qmax: float


#: E4M3's range as a grid: bound 448, values saturate to [-448, 448].
E4M3_RANGE = FloatRange(E4M3_MAX, -E4M3_MAX, E4M3_MAX)


def format_range(num_bits, unsigned: bool = False, narrow_range: bool = False) -> IntRange | FloatRange:
    """``(bound, qmin, qmax)`` of any format: the element format's for ``(E, M)`` tuples, else :func:`int_range`.

    >>> format_range((4, 3))
    FloatRange(bound=448.0, qmin=-448.0, qmax=448.0)
    """
    if is_float_format(num_bits):
        return element_format(num_bits).float_range
    return int_range(num_bits, unsigned, narrow_range)


# --- E4M3 codes ----------------------------------------------------------------------------------------------------
def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of float values to ``float8_e4m3fn`` (NaN stays NaN)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE)


def e4m3_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``x / scale`` (float32 true division) as ``float8_e4m3fn``; 0 where ``scale == 0`` (dead)."""
    dead = scale == 0
    safe = torch.where(dead, torch.ones_like(scale), scale)
    v = to_e4m3(x.float() / safe).float()
    return torch.where(dead, torch.zeros_like(v), v).to(E4M3_DTYPE)


def e4m3_levels(device=None) -> torch.Tensor:
    """The 127 non-negative finite E4M3 values (codes 0x00..0x7E; 0x7F is NaN), ascending, as float64."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8, device=device)
    return codes.view(E4M3_DTYPE).to(torch.float64)


# --- integer code containers ---------------------------------------------------------------------------------------
class CodeType(NamedTuple):
    """A container of integer codes: its range and how torch, numpy and ONNX name it."""

    name: str  #: "int8", ...
    lo: int
    hi: int
    torch_dtype: torch.dtype | None  #: None: no torch dtype (4-bit codes are packed by hand)
    numpy_dtype: type | None  #: None: no numpy dtype (4-bit)
    onnx_type: str  #: the ``onnx.TensorProto`` element type name
    onnx_opset: int  #: first opset whose QuantizeLinear/DequantizeLinear accept the type


#: Every integer container, by name (ranges are two's complement / unsigned of ``bits``).
CODE_TYPES: dict[str, CodeType] = {
    c.name: c
    for c in (
        CodeType("int4", -(2**3), 2**3 - 1, None, None, "INT4", 21),
        CodeType("uint4", 0, 2**4 - 1, None, None, "UINT4", 21),
        CodeType("int8", -(2**7), 2**7 - 1, torch.int8, np.int8, "INT8", 10),
        CodeType("uint8", 0, 2**8 - 1, torch.uint8, np.uint8, "UINT8", 10),
        CodeType("int16", -(2**15), 2**15 - 1, torch.int16, np.int16, "INT16", 21),
        CodeType("uint16", 0, 2**16 - 1, torch.uint16, np.uint16, "UINT16", 21),
        CodeType("int32", -(2**31), 2**31 - 1, torch.int32, np.int32, "INT32", 10),  # DequantizeLinear only
    )
}
#: int32: the accumulator and bias grid of integer requantization.
INT32 = CODE_TYPES["int32"]

#: torch dtypes integer codes are returned in (``quantize(..., mode="hardware")``, ``tensor_quant(dtype=...)``).
TORCH_CODE_TYPES = ("int8", "uint8", "int16", "int32")
#: ONNX QuantizeLinear outputs for activations (smallest first; 4-bit activations use int8 after a Clip).
ONNX_ACTIVATION_TYPES = ("int8", "uint8", "int16", "uint16")
#: ONNX initializer types for weight codes (smallest first).
ONNX_WEIGHT_TYPES = ("int4", "uint4", "int8", "uint8", "int16", "uint16")


def smallest_code_type(qmin: int, qmax: int, names=TORCH_CODE_TYPES) -> CodeType | None:
    """The first container of ``names`` (smallest first) holding ``[qmin, qmax]``, or None."""
    for name in names:
        c = CODE_TYPES[name]
        if c.lo <= qmin and qmax <= c.hi:
            return c
    return None


def torch_dtype_range(dtype: torch.dtype) -> tuple[int, int] | None:
    """``(lo, hi)`` of a torch integer dtype codes may be returned in (:data:`TORCH_CODE_TYPES`), else None."""
    for name in TORCH_CODE_TYPES:
        c = CODE_TYPES[name]
        if c.torch_dtype == dtype:
            return c.lo, c.hi
    return None


def torch_code_dtype(num_bits: int, unsigned: bool = False) -> torch.dtype:
    """The torch dtype of an integer format's real codes: int8/uint8 up to 8 bits, int16 (signed) or int32
    (unsigned: torch's uint16 lacks most ops) up to 16 bits.

    >>> torch_code_dtype(4, unsigned=True), torch_code_dtype(16, unsigned=True)
    (torch.uint8, torch.int32)
    """
    int_range(num_bits, unsigned)  # validates num_bits
    if num_bits <= 8:
        return torch.uint8 if unsigned else torch.int8
    return torch.int32 if unsigned else torch.int16


# --- formats as data -----------------------------------------------------------------------------------------------
# One object per element format and per scale format; the layers above ask these objects (``element_format(nb)``,
# ``scale_format(bits)``, ``block_scheme(nb, block_sizes)``) instead of testing tuples. Adding a format is one
# entry in :data:`FLOAT_ELEMENTS` (or :data:`BLOCK_SCHEMES`) plus its kernels.
def _sat_cast(v: torch.Tensor, top: float, dtype: torch.dtype) -> torch.Tensor:
    return v.float().clamp(-top, top).to(dtype).float()


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-half-to-even of float values onto E4M3 (max 448), as float32 (NaN stays NaN)."""
    return _sat_cast(v, E4M3_MAX, E4M3_DTYPE)


#: Largest finite value of float8 E5M2.
E5M2_MAX = 57344.0
#: Largest E2M1 magnitude and the 8 non-negative E2M1 values (a code's bits 0..2 index this list).
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e5m2_round(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-half-to-even onto float8 E5M2 (max 57344), as float32 (NaN stays NaN)."""
    return _sat_cast(v, E5M2_MAX, torch.float8_e5m2)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Saturating round-half-to-even onto the E2M1 grid, as float32: ``m = min(|v|, 6)``, ``step`` = 0.5 below 2,
    1 below 4, else 2; ``m = rne(m / step) * step`` (exact); ``-m`` where ``v < 0`` (NaN stays NaN)."""
    v = v.float()
    m = v.abs().clamp_(max=E2M1_MAX)
    half, one, two = (torch.tensor(c, dtype=torch.float32, device=v.device) for c in (0.5, 1.0, 2.0))
    step = torch.where(m < 2.0, half, torch.where(m < 4.0, one, two))
    m = m.div_(step).round_().mul_(step)
    return torch.where(v < 0, -m, m)


@dataclass(frozen=True)
class ElementFormat:
    """An element (code) format: its grid, rounding, containers and ONNX type.

    ``bound`` is what amax maps to with a float32 per-tensor/channel scale (``scale = amax / bound``); codes lie in
    ``[qmin, qmax]``. ``emax`` is the exponent of the largest power of two (the MX scale rule); ``max_significand``
    is ``qmax / 2**emax`` (the "rceil" MX threshold). ``round`` is the saturating round-half-to-even onto the grid
    (float in, float32 out) for floating-point formats, None for integers (``clamp(rint(v), qmin, qmax)``).
    """

    name: str
    num_bits: int | tuple[int, int]  #: the config spelling: bits for integers, ``(E, M)`` for floats
    is_float: bool
    bound: float
    qmin: float
    qmax: float
    code_dtype: torch.dtype | None  #: torch dtype of real codes (None: packed by hand, e.g. 4-bit)
    onnx_type: str | None  #: ``onnx.TensorProto`` element type name
    onnx_opset: int | None  #: first opset whose Q/DQ accept it
    emax: int | None = None
    max_significand: float | None = None
    round: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: False for formats with no float32-scaled (per-tensor/per-channel) quantization (E8M0: a scale format only)
    scaled: bool = True

    @property
    def is_e4m3(self) -> bool:
        """True for FP8 E4M3 (the per-tensor FP8 path of the quantizers and exporters)."""
        return self.name == "e4m3"

    @property
    def is_scaled_float(self) -> bool:
        """True for the floating-point formats with a float32 scale per tensor/channel (E4M3, E5M2, E2M1)."""
        return self.is_float and self.scaled

    @property
    def title(self) -> str:
        """How messages name the format: "FP8 E4M3", "FP8 E5M2", "FP4 E2M1"; the name for integers ("int8")."""
        if not self.is_float:
            return self.name
        return f"FP{sum(self.num_bits) + 1} {self.name.upper()}"  # type: ignore[arg-type]

    @property
    def float_range(self) -> FloatRange:
        """``(bound, qmin, qmax)`` as a :class:`FloatRange`."""
        return FloatRange(self.bound, self.qmin, self.qmax)

    @property
    def signed(self) -> bool:
        return self.qmin < 0


def _float_format(name, num_bits, top, dtype, onnx, opset, emax, rnd=None, lo=None) -> ElementFormat:
    return ElementFormat(name, num_bits, True, top, -top if lo is None else lo, top, dtype, onnx, opset, emax,
                         top / 2.0**emax, rnd, scaled=rnd is not None)  # fmt: skip


#: The floating-point element formats, keyed by their ``num_bits`` spelling ``(E, M)``.
FLOAT_ELEMENTS: dict[tuple[int, int], ElementFormat] = {
    (4, 3): _float_format("e4m3", (4, 3), E4M3_MAX, E4M3_DTYPE, E4M3_ONNX_TYPE, 19, 8, e4m3_round),
    (5, 2): _float_format("e5m2", (5, 2), E5M2_MAX, torch.float8_e5m2, "FLOAT8E5M2", 19, 15, e5m2_round),
    (2, 1): _float_format("e2m1", (2, 1), E2M1_MAX, None, "FLOAT4E2M1", 23, 2, e2m1_round),
    # E8M0: exponent only (2**-127..2**127, biased by 127; 0xFF is NaN): the MX scale format, never an element
    (8, 0): _float_format("e8m0", (8, 0), 2.0**127, torch.float8_e8m0fnu, "FLOAT8E8M0", 24, 127, lo=2.0**-127),
}


def register_element_format(fmt: ElementFormat) -> None:
    """Add a floating-point element format (its kernels must be registered where the quantizers dispatch)."""
    if not isinstance(fmt.num_bits, tuple) or fmt.num_bits in FLOAT_ELEMENTS:
        raise ValueError(f"element format {fmt.name!r}: num_bits {fmt.num_bits!r} is not a new (E, M) tuple")
    FLOAT_ELEMENTS[fmt.num_bits] = fmt


def element_format(num_bits, unsigned: bool = False, narrow_range: bool = False) -> ElementFormat:
    """The :class:`ElementFormat` a ``num_bits`` (int bits or ``(E, M)``) names.

    >>> element_format((4, 3)).name, element_format(8).qmin, element_format(4, unsigned=True).onnx_type
    ('e4m3', -128, 'UINT4')
    """
    if isinstance(num_bits, (tuple, list)):
        key = tuple(num_bits)
        if key not in FLOAT_ELEMENTS:
            names = ", ".join(f"{k} ({f.name.upper()})" for k, f in FLOAT_ELEMENTS.items() if f.name != "e8m0")
            raise UnsupportedFormatError(
                f"num_bits={key!r} is not a supported floating-point format; supported: {names}"
            )
        return FLOAT_ELEMENTS[key]
    if type(num_bits) is int and type(unsigned) is bool and type(narrow_range) is bool:
        return _int_element(num_bits, unsigned, narrow_range)  # (a quantizer call asks for it every time)
    return _int_element.__wrapped__(num_bits, unsigned, narrow_range)  # validated, not cached


@cache
def _int_element(num_bits: int, unsigned: bool, narrow_range: bool) -> ElementFormat:
    bound, qmin, qmax = int_range(num_bits, unsigned, narrow_range)
    c = smallest_code_type(qmin, qmax, ONNX_WEIGHT_TYPES)
    name = f"{'u' if unsigned else ''}int{num_bits}{'n' if narrow_range else ''}"
    return ElementFormat(name, int(num_bits), False, float(bound), qmin, qmax, torch_code_dtype(num_bits, unsigned),
                         c.onnx_type if c else None, c.onnx_opset if c else None)  # fmt: skip


def is_float_format(num_bits) -> bool:
    """True when ``num_bits`` is an ``(E, M)`` tuple (a floating-point element format)."""
    return isinstance(num_bits, (tuple, list))


@dataclass(frozen=True)
class ScaleFormat:
    """How block scales are stored: ``scale_bits`` (ModelOpt's spelling) -> element format and structure.

    ``global_scale``: the block scales are relative to a per-tensor float32 scale (NVFP4); ``power_of_two``: shared
    exponent-only scales (OCP MX)."""

    name: str
    scale_bits: int | tuple[int, int] | None
    element: ElementFormat | None  #: None: float32 scales
    global_scale: bool = False
    power_of_two: bool = False


FLOAT32_SCALE = ScaleFormat("float32", None, None)
E4M3_BLOCK_SCALE = ScaleFormat("e4m3", (4, 3), FLOAT_ELEMENTS[(4, 3)], global_scale=True)
E8M0_SCALE = ScaleFormat("e8m0", (8, 0), FLOAT_ELEMENTS[(8, 0)], power_of_two=True)


@dataclass(frozen=True)
class BlockScheme:
    """A block format with its own kernels (not the generic "float32 scale per block" of integer/E4M3 blocks).

    ``kind`` is "nvfp4" (E4M3 block scales under a calibrated per-tensor float32 global scale) or "mx" (E8M0
    shared scales, fully dynamic); ``blocks`` are the allowed sizes along the last axis. MXFP8 and MXFP4 round
    their E8M0 scales with "rceil" (the smallest power of two that holds the block without saturating), as
    ModelOpt's MXFP8QTensor/MXFP4QTensor and NVIDIA's MX conversion do (all-MiniLM-L6-v2 MXFP8 W8A8: cosine to
    FP32 0.9974 with "rceil", 0.9960 with the OCP "floor" rule, which saturates blocks whose amax significand
    exceeds 1.75); MXINT8 keeps the OCP "floor" rule. ``block_sizes["scale_rounding"]`` ("floor" | "rceil")
    overrides the rule of an MX scheme (:func:`block_scheme` returns the scheme with that ``rounding``)."""

    name: str
    kind: str
    element: ElementFormat
    scale: ScaleFormat
    blocks: tuple[int, ...]
    elem: str  #: the element's name in :mod:`modelopt_lite.functional.microscaling` ("e2m1", "int8", ...)
    rounding: str = "floor"  #: MX E8M0 scale rule: "floor" (OCP v1.0) or "rceil" (see microscaling)

    @property
    def calibrates_amax(self) -> bool:
        """True when the quantizer calibrates a per-tensor amax (NVFP4's global scale); MX needs none."""
        return self.scale.global_scale


#: The block schemes, keyed by ``(num_bits, scale_bits)``.
BLOCK_SCHEMES: dict[tuple, BlockScheme] = {
    (s.element.num_bits, s.scale.scale_bits): s
    for s in (
        BlockScheme("nvfp4", "nvfp4", FLOAT_ELEMENTS[(2, 1)], E4M3_BLOCK_SCALE, (16, 32), "e2m1"),
        BlockScheme("mxfp8", "mx", FLOAT_ELEMENTS[(4, 3)], E8M0_SCALE, (32,), "e4m3", "rceil"),
        BlockScheme("mxfp8_e5m2", "mx", FLOAT_ELEMENTS[(5, 2)], E8M0_SCALE, (32,), "e5m2", "rceil"),
        BlockScheme("mxfp4", "mx", FLOAT_ELEMENTS[(2, 1)], E8M0_SCALE, (32,), "e2m1", "rceil"),
        BlockScheme("mxint8", "mx", element_format(8, narrow_range=True), E8M0_SCALE, (32,), "int8"),
    )
}


#: The E8M0 scale rules of MX schemes (``block_sizes["scale_rounding"]``): "floor" is OCP MX v1.0's
#: ``floor(log2(amax)) - emax``; "rceil" the smallest power of two that holds the block without saturating.
MX_SCALE_ROUNDINGS = ("floor", "rceil")
#: The ``block_sizes`` key that picks an MX scheme's E8M0 scale rule (absent: the scheme's own ``rounding``).
SCALE_ROUNDING_KEY = "scale_rounding"


@cache
def _with_rounding(scheme: BlockScheme, rounding: str) -> BlockScheme:
    return scheme if scheme.rounding == rounding else replace(scheme, rounding=rounding)


def block_scheme(num_bits, block_sizes) -> BlockScheme | None:
    """The :class:`BlockScheme` of a ``(num_bits, block_sizes)`` pair, or None for generic block quantization.

    An MX scheme's ``rounding`` is ``block_sizes["scale_rounding"]`` when given (ValueError for a value other than
    "floor"/"rceil", or for the key on a scheme without E8M0 scales: NVFP4)."""
    if not block_sizes:
        return None
    sb = block_sizes.get("scale_bits")
    nb = tuple(num_bits) if isinstance(num_bits, (tuple, list)) else num_bits
    scheme = BLOCK_SCHEMES.get((nb, tuple(sb) if isinstance(sb, (tuple, list)) else sb))
    rounding = block_sizes.get(SCALE_ROUNDING_KEY)
    if scheme is None or rounding is None:
        return scheme
    if not scheme.scale.power_of_two:
        raise ValueError(
            f"block_sizes['scale_rounding']={rounding!r} applies to MX (E8M0, scale_bits=(8, 0)) scales only; "
            f"{scheme.name.upper()} has {scheme.scale.name.upper()} block scales"
        )
    if not isinstance(rounding, str) or rounding not in MX_SCALE_ROUNDINGS:
        raise ValueError(f"block_sizes['scale_rounding'] must be one of {MX_SCALE_ROUNDINGS}, got {rounding!r}")
    return _with_rounding(scheme, rounding)


def scaled_format(num_bits, unsigned: bool = False, narrow_range: bool = False) -> ElementFormat:
    """The element format of ``num_bits`` for float32-scaled quantization (per tensor, per channel, generic blocks):
    the integers, E4M3, E5M2 and E2M1. ValueError for a format that exists only as a block scale (E8M0)."""
    fmt = element_format(num_bits, unsigned, narrow_range)
    if fmt.is_float and not fmt.scaled:
        raise ValueError(
            f"num_bits={tuple(num_bits)!r} ({fmt.name.upper()}) has no float32-scaled (per-tensor/per-channel) "
            "quantization: it is a block scale format only (block_sizes['scale_bits'])"
        )
    return fmt


def scaled_float_format(num_bits) -> ElementFormat | None:
    """The floating-point :class:`ElementFormat` float32-scaled quantization with ``num_bits`` runs (E4M3, E5M2,
    E2M1), or None for integers (validated by their own path); ValueError (:func:`scaled_format`) for E8M0."""
    return scaled_format(num_bits) if is_float_format(num_bits) else None


def scaled_is_e4m3(num_bits) -> bool:
    """True when float32-scaled quantization with ``num_bits`` runs the E4M3 path, False for integers and the other
    float formats (see :func:`scaled_float_format`); ValueError (:func:`scaled_format`) for E8M0."""
    fmt = scaled_float_format(num_bits)
    return fmt is not None and fmt.is_e4m3


# --- float codes of any scaled float format -----------------------------------------------------------------------
def float_codes(fmt: ElementFormat, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes of ``x / scale`` (float32 true division, saturating round-half-to-even) in ``fmt``: a tensor of
    ``fmt.code_dtype`` (float8), or the float32 grid values where the format has no torch dtype (E2M1); 0 where
    ``scale == 0`` (dead)."""
    assert fmt.round is not None, fmt.name
    dead = scale == 0
    safe = torch.where(dead, torch.ones_like(scale), scale)
    v = fmt.round(x.float() / safe)
    v = torch.where(dead, torch.zeros_like(v), v)
    return v if fmt.code_dtype is None else v.to(fmt.code_dtype)


def float_levels(fmt: ElementFormat, device=None) -> torch.Tensor:
    """The non-negative finite values of a scaled float format, ascending, as float64 (E4M3: 127, E5M2: 124,
    E2M1: 8)."""
    if fmt.name == "e2m1":
        return torch.tensor(E2M1_VALUES, dtype=torch.float64, device=device)
    assert fmt.code_dtype is not None, fmt.name
    codes = torch.arange(0, 0x80, dtype=torch.uint8, device=device).view(fmt.code_dtype).to(torch.float64)
    return codes[torch.isfinite(codes)]
