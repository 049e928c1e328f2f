"""Integer requantization: the arithmetic of a fused int8 Conv/Gemm with a quantized output (the reference).

A quantized layer ``Q_out(conv(DQ(x), DQ(w)) + b)`` in float accumulates products in float32, so its result
depends on the summation order of the kernel that runs it. ONNX Runtime's fused int8 kernels (``QLinearConv``,
``QGemm`` with an output scale; what ``DQ -> Conv/Gemm -> Q`` becomes in a ``target="onnxruntime"`` export)
compute it in integers instead, which has one exact answer:

    acc  = sum((qx - zx) * qw) + qb                 (exact integers; qw symmetric, zero point 0)
    qb   = clamp(rint(b / float32(sx * sw)), int32)  (the bias stored as int32 on the product's grid)
    m    = float32(float32(sx * sw) / sy)            (one multiplier per output channel)
    qy   = clamp(rint(float32(acc) * m) + zy, qmin, qmax)
    y    = (qy - zy) * sy

Every operation on floats above is one IEEE float32 operation (true division, round half to even), so the torch
model (``requant="integer"``, see :mod:`modelopt_lite.nn.modules._integer_requant`) and ONNX Runtime agree bit
for bit (``tests/test_integer_requant.py`` checks this against ORT on random layers and on whole models). The
integer accumulation runs in float64 here, exact while ``|acc| < 2**53`` (ORT's own int32 accumulator is the
tighter bound: about 66,000 products of full-range codes).
"""

from __future__ import annotations

import torch

from ..formats import INT32

INT32_MIN, INT32_MAX = INT32.lo, INT32.hi


def bias_scale(input_scale: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``float32(sx * sw)``: the grid of the int32 bias and of the accumulator (one value per output channel)."""
    return input_scale.float().reshape(-1)[:1] * weight_scale.float().reshape(-1)


def bias_codes(bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bias on the accumulator's grid: ``clamp(rint(b / scale), int32)`` (float64 holding integers)."""
    q = torch.round(bias.detach().float() / scale)  # float32 true division; torch.round is half to even
    return q.double().clamp(INT32_MIN, INT32_MAX)  # in float64: float32 cannot hold 2**31 - 1


def multiplier(input_scale: torch.Tensor, weight_scale: torch.Tensor, output_scale: torch.Tensor) -> torch.Tensor:
    """``float32(float32(sx * sw) / sy)`` per output channel."""
    return bias_scale(input_scale, weight_scale) / output_scale.float().reshape(())


def requantize(acc: torch.Tensor, mult: torch.Tensor, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    """Output codes ``clamp(rint(float32(acc) * mult) + zero_point, qmin, qmax)`` (float32 holding integers).

    ``acc`` holds exact integers (any float dtype); ``mult`` broadcasts against it."""
    v = acc.to(torch.float32) * mult
    return (torch.round(v) + zero_point).clamp(qmin, qmax)
