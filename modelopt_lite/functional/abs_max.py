"""``max |x|`` over some dims in one pass where torch can: the dynamic amax of quantizers, block amaxes, reduce_amax.

Computed as ``max(max(x), -min(x))`` in x's own dtype (exact: no rounding happens, a float16/bfloat16 input needs
no float32 copy; NaN where a reduced element is NaN). ``torch.aminmax`` reads x once for both, where ``amax`` and
``amin`` read it twice (bench: 4096x4096 float32 on a 2-core AMD EPYC, 2.0 ms instead of 3.8 ms; on a GPU one pass
instead of two). aminmax reduces all dims or one; other reductions, and traced / compiled / exported graphs (whose
exporters know amax and amin), take the two reductions. The values are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .checks import _compiling


def abs_max(x: torch.Tensor, dims: Sequence[int] | None = None, keepdim: bool = False) -> torch.Tensor:
    """max |x| over ``dims`` in x's dtype (None: every dim, a 0-d result; an empty list: every dim, as torch.amax)."""
    one_pass = not (_compiling() or torch.jit.is_tracing()) and (dims is None or len(dims) == 1)
    if one_pass:
        if dims is None:
            lo, hi = torch.aminmax(x)
        else:
            lo, hi = torch.aminmax(x, dim=dims[0], keepdim=keepdim)
    elif dims is None:
        hi, lo = torch.amax(x), torch.amin(x)
    else:
        hi, lo = torch.amax(x, dim=list(dims), keepdim=keepdim), torch.amin(x, dim=list(dims), keepdim=keepdim)
    return torch.maximum(hi, lo.neg())
