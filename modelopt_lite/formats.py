"""Numeric formats: the integer ranges and FP8 constants every layer shares.

One place defines ``bound``, ``qmin`` and ``qmax`` for each integer format, so the reference, the kernels, the
calibrators and the exporter cannot disagree about them (see ``numerics.md`` in the project docs).
"""

from __future__ import annotations

from typing import NamedTuple

#: amax at or below this value marks a "dead" tensor/channel/block: it quantizes to exact zeros.
AMAX_EPS = 2.0**-24

#: Largest finite value of float8 E4M3FN; the FP8 "bound".
E4M3_MAX = 448.0


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
