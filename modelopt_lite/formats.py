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
    """True when ``num_bits`` names FP8 E4M3, written ``(4, 3)``."""
    return isinstance(num_bits, tuple) and tuple(num_bits) == (4, 3)


class FloatRange(NamedTuple):
    """The FP8 "grid": ``scale = amax / bound``, ``x / scale`` saturates to ``[qmin, qmax]``."""

    bound: float
    qmin: float
    qmax: float


#: E4M3's range as a grid: bound 448, values saturate to [-448, 448].
E4M3_RANGE = FloatRange(E4M3_MAX, -E4M3_MAX, E4M3_MAX)


def format_range(num_bits, unsigned: bool = False, narrow_range: bool = False) -> IntRange | FloatRange:
    """``(bound, qmin, qmax)`` of any format: :data:`E4M3_RANGE` for ``(4, 3)``, else :func:`int_range`.

    >>> format_range((4, 3))
    FloatRange(bound=448.0, qmin=-448.0, qmax=448.0)
    """
    if is_e4m3(num_bits):
        return E4M3_RANGE
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
