"""The activation side and the epilogue of the real W8A8 GEMMs as ``torch.library`` ops: on CUDA one fused kernel
each (``csrc/real_kernels.cu``), elsewhere (and as their definition) the pure-torch chains they equal bit for bit.

Ops (namespace ``modelopt_lite``; ``x`` 2-D ``(rows, cols)`` float32/float16/bfloat16, divisors float32 ``(1,)``):

- ``real_fp8_static(x, divisor) -> codes``: ``e4m3(clamp(x / divisor, -448, 448))`` (:func:`fp8_static_reference`)
- ``real_fp8_dynamic(x, per_row) -> (codes, scale)``: scale ``(rows, 1)`` or ``(1, 1)`` from the row / tensor amax,
  ``scale_from_amax(amax, 448)``; codes ``e4m3(nan_to_num(x / scale, 0, 0, 0))`` (:func:`fp8_dynamic_reference`)
- ``real_int8_codes(x, divisor, qmin, qmax, shift, rows_out) -> codes``: int8 ``clamp(rint(x / divisor), qmin,
  qmax) - shift``, zero rows appended up to ``rows_out`` (:func:`int8_codes_reference`)
- ``real_int_mm_epilogue(acc, scale_row, bias, rows, dtype) -> y``: the first ``rows`` rows of
  ``addcmul(bias, acc, scale_row)`` (``acc * scale_row`` without a bias) rounded into ``dtype``
  (:func:`int_mm_epilogue_reference`)

Exactness: the CUDA kernels run the float32 operations of these chains in their order (true division, one fused
multiply-add where ``addcmul`` is one), so the codes, scales and outputs are equal bit for bit; tested on the CPU
with the kernels built for the host (``tests/test_real_kernels_host.py``) and on a GPU (``tests/gpu``). Where the
chains' results are unspecified, the kernels define them: a NaN input gives the NaN code (static FP8; its sign is
the division's), code 0 (dynamic FP8, the row's scale NaN; an Inf row: codes 0, scale Inf) or ``0 - shift``
(INT8; torch's float-to-int8 cast of NaN is undefined). Nothing reads a value back to the host: the real modules'
``validate=True`` is the NaN/Inf opt-in.

:func:`kernel_ops` says whether the kernels serve a tensor (the CUDA extension loaded, CUDA tensors only; the
host-emulated tests route CPU tensors to the emulated build); :mod:`modelopt_lite.real.fast_gemm` calls the ops
only then and keeps the chains (several aten ops) otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..formats import AMAX_EPS, E4M3_DTYPE, E4M3_MAX
from .backend import is_native_cuda, kernels_for
from .scales import scale_from_amax

#: Device types whose tensors the fused kernels serve (the host-emulated tests add "cpu").
KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
#: The dispatcher namespace ``csrc/real_cuda_binding.cpp`` registers its ops under when the CUDA extension loads.
NAMESPACE = "modelopt_lite_cuda"


def kernel_ops(x: Tensor):
    """The namespace of the fused kernels (``torch.ops.modelopt_lite_cuda``) when they serve ``x``, else None
    (host metadata only)."""
    if x.device.type not in KERNEL_DEVICE_TYPES:
        return None
    if not is_native_cuda(kernels_for(x.device.type)):
        return None
    ns = getattr(torch.ops, NAMESPACE)
    return ns if hasattr(ns, "real_fp8_static") else None


def available(x: Tensor) -> bool:
    """Whether the fused kernels serve ``x`` (its device type, the CUDA extension loaded with these ops)."""
    return kernel_ops(x) is not None


# --- the definitions (pure torch) -------------------------------------------------------------------------------------
def fp8_static_reference(x: Tensor, divisor: Tensor) -> Tensor:
    """E4M3 codes of ``x / divisor`` (float32 ``(1,)``: true division by a tensor), saturated to +-448.
    Ops: ``div``, ``clamp_``, ``_to_copy``."""
    return (x / divisor).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE)


def fp8_dynamic_reference(x2d: Tensor, per_row: bool, bound: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(codes, scale)`` of a dynamic E4M3 quantization of ``(M, K)`` rows: scale ``(M, 1)`` per row, ``(1, 1)``
    per tensor; float32 ``scale = amax / 448`` (0 for a dead amax <= 2**-24, whose codes are +0).

    Ops (bf16/fp16 inputs): ``linalg_vector_norm`` (amax, exact), ``threshold`` (dead -> 0), ``div`` (the scale),
    ``div`` (x / scale), ``nan_to_num`` (a dead row's 0/0, +-x/0 -> +0), ``_to_copy`` (E4M3). The dynamic chain has
    no clamp: ``|x| / fl(amax / 448) <= 448 (1 + 2**-23) < 464`` always rounds to a finite code."""
    b = torch.full((1,), E4M3_MAX, dtype=torch.float32, device=x2d.device) if bound is None else bound
    dims = -1 if per_row else (0, 1)
    amax = torch.linalg.vector_norm(x2d, float("inf"), dim=dims, keepdim=True)
    if x2d.dtype == torch.float32:  # float32 amax can reach float32's top: the guarded formula of scale_from_amax
        scale = scale_from_amax(amax, E4M3_MAX)
    else:  # |x| <= 65504 (fp16) or 3.39e38 (bf16): amax / 448 * 448 never overflows float32
        scale = torch.threshold(amax, AMAX_EPS, 0.0) / b
    v = torch.nan_to_num(x2d / scale, nan=0.0, posinf=0.0, neginf=0.0)
    return v.to(E4M3_DTYPE), scale


def int8_codes_reference(
    x2d: Tensor, divisor: Tensor, qmin: int, qmax: int, shift: int, rows_out: int | None = None
) -> Tensor:
    """int8 ``clamp(rint(x / s), qmin, qmax) - shift`` (div, round_, clamp_, [sub_,] _to_copy; ``shift`` 128 for
    unsigned codes), zero rows appended up to ``rows_out`` (one ``constant_pad_nd``)."""
    v = (x2d / divisor).round_().clamp_(qmin, qmax)
    a = (v.sub_(shift) if shift else v).to(torch.int8)
    pad = 0 if rows_out is None else rows_out - x2d.shape[0]
    return F.pad(a, (0, 0, 0, pad)) if pad > 0 else a


def int_mm_epilogue_reference(
    acc: Tensor, scale_row: Tensor, bias: Tensor | None, rows: int, dtype: torch.dtype
) -> Tensor:
    """``addcmul(bias, acc, scale_row)`` (one fused multiply-add in float32 on CPU and CUDA; ``acc * scale_row``
    without a bias) written straight into ``dtype``, its first ``rows`` rows. Ops: ``empty``, ``addcmul``/``mul``."""
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    if bias is None:
        torch.mul(acc, scale_row, out=out)
    else:
        torch.addcmul(bias, acc, scale_row, out=out)
    return out[:rows] if rows < acc.shape[0] else out


# --- the ops ----------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_lite::real_fp8_static", mutates_args=())
def real_fp8_static(x: Tensor, divisor: Tensor) -> Tensor:
    k = kernel_ops(x)
    return fp8_static_reference(x, divisor) if k is None else k.real_fp8_static(x, divisor)


@real_fp8_static.register_fake
def _(x, divisor):
    return torch.empty(x.shape, dtype=E4M3_DTYPE, device=x.device)


@torch.library.custom_op("modelopt_lite::real_fp8_dynamic", mutates_args=())
def real_fp8_dynamic(x: Tensor, per_row: bool) -> tuple[Tensor, Tensor]:
    k = kernel_ops(x)
    return fp8_dynamic_reference(x, per_row) if k is None else k.real_fp8_dynamic(x, per_row)


@real_fp8_dynamic.register_fake
def _(x, per_row):
    rows = x.shape[0] if per_row else 1
    return (
        torch.empty(x.shape, dtype=E4M3_DTYPE, device=x.device),
        torch.empty((rows, 1), dtype=torch.float32, device=x.device),
    )


@torch.library.custom_op("modelopt_lite::real_int8_codes", mutates_args=())
def real_int8_codes(x: Tensor, divisor: Tensor, qmin: int, qmax: int, shift: int, rows_out: int) -> Tensor:
    k = kernel_ops(x)
    if k is None:
        return int8_codes_reference(x, divisor, qmin, qmax, shift, rows_out)
    return k.real_int8_codes(x, divisor, qmin, qmax, shift, rows_out)


@real_int8_codes.register_fake
def _(x, divisor, qmin, qmax, shift, rows_out):
    return torch.empty((rows_out, x.shape[1]), dtype=torch.int8, device=x.device)


@torch.library.custom_op("modelopt_lite::real_int_mm_epilogue", mutates_args=())
def real_int_mm_epilogue(
    acc: Tensor,
    scale_row: Tensor,
    bias: Tensor | None,
    rows: int,
    dtype: torch.dtype,
) -> Tensor:
    k = kernel_ops(acc)
    if k is None:
        return int_mm_epilogue_reference(acc, scale_row, bias, rows, dtype)
    return k.real_int_mm_epilogue(acc, scale_row, bias, rows, dtype)


@real_int_mm_epilogue.register_fake
def _(acc, scale_row, bias, rows, dtype):
    return torch.empty((rows, acc.shape[1]), dtype=dtype, device=acc.device)
