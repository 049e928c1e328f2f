"""Storage of real weights: int8 codes, packed int4 codes (two per byte) and their dequantization.

Packed int4 layout: codes are cut along the LAST dim into pairs; byte ``j`` holds element ``2j`` in its low nibble
and element ``2j + 1`` in its high nibble (the ONNX INT4 order); an odd last dim is padded with a zero code.
Signed codes are stored in two's complement (``q & 0xF``) and sign-extended when unpacked.
"""

from __future__ import annotations

import torch

from ..functional import blocks
from ..functional.checks import first_bad


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack integer codes in ``[-8, 15]`` (signed ``[-8, 7]`` or unsigned ``[0, 15]``) two per uint8 byte."""
    if q.dim() == 0:
        raise ValueError("pack_int4 needs at least one dimension")
    if q.is_floating_point() and q.numel():  # float codes: a NaN or a fraction would be cast to some integer silently
        bad = ~torch.isfinite(q) | (q != torch.round(q))
        if bool(bad.any()):
            raise ValueError(f"pack_int4: codes must be finite integers, got {first_bad(q, bad)!r}")
    qi = q.to(torch.int16)
    if qi.numel() and (int(qi.min()) < -8 or int(qi.max()) > 15):
        raise ValueError(f"pack_int4: codes must lie in [-8, 15], got [{int(qi.min())}, {int(qi.max())}]")
    if qi.shape[-1] % 2:
        qi = torch.nn.functional.pad(qi, (0, 1))
    nib = (qi & 0xF).to(torch.uint8)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, last_dim: int, signed: bool = True) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 codes with last dim ``last_dim``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 expects uint8 storage, got {packed.dtype}")
    if packed.shape[-1] != (last_dim + 1) // 2:
        raise ValueError(f"unpack_int4: {packed.shape[-1]} bytes cannot hold a last dim of {last_dim}")
    lo = (packed & 0xF).to(torch.int16)
    hi = (packed >> 4).to(torch.int16)
    q = torch.stack([lo, hi], -1).flatten(-2)[..., :last_dim]
    if signed:
        q = torch.where(q >= 8, q - 16, q)
    return q.to(torch.int8)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block_sizes: dict | None) -> torch.Tensor:
    """float32 ``q * scale``, exactly the product fake quantization computes.

    ``scale`` broadcasts against ``q`` (per tensor / per channel, keepdims), or, with ``block_sizes``, has the
    blocks-per-axis shape and is expanded block by block as :func:`modelopt_lite.tensor_quant.fake_block_quant` does.
    """
    if not block_sizes:
        return q.float() * scale
    sizes = blocks.normalize(block_sizes, q.shape)
    qb, pad = blocks.to_blocks(q.float(), sizes)
    return blocks.from_blocks(qb * blocks.expand_amax(scale, sizes), q.shape, pad)
