"""Our INT4 block weights in torch's int4 GEMM layout (``_weight_int4pack_mm`` on CUDA, ``..._for_cpu`` on CPU).

Torch's int4 GEMM dequantizes ``w[n, k] = (u[n, k] - 8) * scale[k // g, n] + zero[k // g, n]`` with unsigned 4-bit
``u`` and ``scales_and_zeros`` of shape ``(K / g, N, 2)`` in the activation dtype. Our symmetric codes ``q`` in
``[-8, 7]`` (or the narrow ``[-7, 7]``) with block scale ``s`` map to ``u = q + 8``, ``scale = s``, ``zero = 0``:
``(u - 8) * s + 0 == q * s`` exactly (``+ 0`` changes no product; a zero product is ``+0`` either way).

Exactness: torch requires ``scales_and_zeros`` in the activation's dtype. For float32 activations the dequantized
weight is the float32 ``q * s`` of the fake-quant module bit for bit (checked in the tests with an identity-matrix
GEMM). For bfloat16 / float16 activations the scale is rounded to that dtype first, so each weight may differ from
the fake-quant weight ``dtype(q * s)`` by about one unit in the 16-bit dtype's last place (2**-8 relative for
bfloat16): the outputs then agree within :func:`.fast_gemm.lowp_error_bound`, which counts that rounding.

Packing: the CPU op takes ``u`` as int32 ``(N, K)``; the CUDA op takes ``u`` packed two per byte, ``(N, K / 2)``
uint8 with element ``2j`` in the HIGH nibble (the reverse of our ONNX-order storage), plus ``innerKTiles``.
"""

from __future__ import annotations

import torch

#: block sizes torch's int4 GEMM takes (``qGroupSize``)
GROUPS = (32, 64, 128, 256)


#: activation dtypes torch's CUDA int4 GEMM takes (float16 raises there: "Expected A.dtype() == at::kBFloat16",
#: H200, torch 2.11+cu130); on the CPU, _weight_int4pack_mm_for_cpu takes float32, float16 and bfloat16
CUDA_DTYPES = (torch.bfloat16,)


def why_not(shape: tuple, group: int | None) -> str | None:
    """Why an ``(N, K)`` weight in blocks of ``group`` along K cannot use the int4 GEMM, or None."""
    n, k = shape
    if group not in GROUPS:
        return f"its block size {group} along the input dim is not one of torch's int4 group sizes {GROUPS}"
    if k % group:
        return f"in_features={k} is not a multiple of its block size {group}"
    if n % 16:
        return f"out_features={n} is not a multiple of 16 (torch's int4 packing)"
    return None


def _inner_k_tiles(k: int) -> int:
    return 8 if k % 256 == 0 else 4 if k % 128 == 0 else 2


def pack(codes: torch.Tensor, block_scale: torch.Tensor, group: int, dtype: torch.dtype):
    """``(packed, scales_and_zeros)`` for torch's int4 GEMM on ``codes.device`` with activations of ``dtype``.

    codes: int8 ``(N, K)`` in ``[-8, 7]``; block_scale: float32 ``(N, K / group)``.
    """
    u = codes.to(torch.int32) + 8
    if codes.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), _inner_k_tiles(codes.shape[1]))
    else:
        u8 = u.to(torch.uint8)
        u8 = ((u8[:, ::2] << 4) | u8[:, 1::2]).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(u8, _inner_k_tiles(codes.shape[1]))
    s = block_scale.float().t()
    sz = torch.stack([s, torch.zeros_like(s)], -1).to(dtype).contiguous()
    return packed, sz


def mm(x2d: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor) -> torch.Tensor:
    """``x2d @ dequant(w).T`` through torch's int4 GEMM (one op)."""
    if x2d.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, packed, group, sz)
    if x2d.dtype not in CUDA_DTYPES:
        raise ValueError(
            f"backend 'int4pack' on CUDA takes bfloat16 activations only (torch._weight_int4pack_mm), got {x2d.dtype}; "
            "use backend='auto' (float16 CUDA modules dequantize instead) or a bfloat16 model"
        )
    return torch.ops.aten._weight_int4pack_mm(x2d, packed, group, sz)
