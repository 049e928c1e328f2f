"""``torch.library`` ops of the scaled FP8 E5M2 and FP4 E2M1 element formats (per tensor or per channel, as
``fake_e4m3`` of :mod:`.library`), with fake (meta) impls and straight-through gradients.

Ops (namespace ``modelopt_lite``), numerics ``elem(x / s) * s`` in float32 with the element roundings of
:mod:`.microscaling` (``e5m2_round``: saturating at 57344; ``e2m1_round``: saturating at 6), a scale of exactly 0
marking a dead slice (``+0.0`` outputs), the result cast back to x's dtype:

- ``fake_e5m2(x, scale) -> y``        - ``fake_e2m1(x, scale) -> y``

A backend whose kernel module defines a function of the same name runs it (the native CPU and CUDA kernels, tested
bit for bit against :func:`fake_e5m2_reference` / :func:`fake_e2m1_reference`); otherwise the reference runs.
Gradient: ``dy/dx = 1`` where ``-max * s <= x <= max * s`` (float32), else 0; a scale that requires grad (learned
amax) gets E4M3's LSQ gradient ``round(x/s) - x/s`` inside the grid, ``-max`` below, ``+max`` above (0 where dead).

During a plain ``torch.onnx.export`` the ops write standard Q/DQ (:mod:`.onnx_qdq`): FLOAT8E5M2 at opset 19;
E2M1 (FLOAT4E2M1, opset 23) only through :func:`modelopt_lite.export_onnx`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cuda_args, eager, onnx_qdq
from . import microscaling as ms
from .backend import is_native_cuda, kernels_for
from .devices import device_type


def _scaled_reference(x: Tensor, scale: Tensor, rnd) -> Tensor:
    s = scale.float()
    dead = s == 0
    safe = torch.where(dead, torch.ones_like(s), s)
    y = rnd(x.float() / safe) * safe
    return y.masked_fill_(dead.expand_as(y), 0.0).to(x.dtype)


def fake_e5m2_reference(x: Tensor, scale: Tensor) -> Tensor:
    """``e5m2_round(x / s) * s`` in float32 (0 where ``s == 0``), in x's dtype."""
    return _scaled_reference(x, scale, ms.e5m2_round)


def fake_e2m1_reference(x: Tensor, scale: Tensor) -> Tensor:
    """``e2m1_round(x / s) * s`` in float32 (0 where ``s == 0``), in x's dtype."""
    return _scaled_reference(x, scale, ms.e2m1_round)


_REFERENCE = {"fake_e5m2": fake_e5m2_reference, "fake_e2m1": fake_e2m1_reference}
_MAX = {"fake_e5m2": ms.E5M2_MAX, "fake_e2m1": ms.E2M1_MAX}
_ROUND = {"fake_e5m2": ms.e5m2_round, "fake_e2m1": ms.e2m1_round}


def _run(name: str, x: Tensor, scale: Tensor) -> Tensor:
    mod = kernels_for(device_type(x))
    fn = getattr(mod, name, None)
    if fn is None:
        return _REFERENCE[name](x, scale)
    if is_native_cuda(mod):  # the CUDA extension's checks, in Python first (see .cuda_args)
        cuda_args.check_minifloat(name, x, scale)
    return fn(x, scale)


@torch.library.custom_op("modelopt_lite::fake_e5m2", mutates_args=())
def fake_e5m2(x: Tensor, scale: Tensor) -> Tensor:
    return _run("fake_e5m2", x, scale)


@torch.library.custom_op("modelopt_lite::fake_e2m1", mutates_args=())
def fake_e2m1(x: Tensor, scale: Tensor) -> Tensor:
    return _run("fake_e2m1", x, scale)


def _fake(x, scale):
    return torch.empty(torch.broadcast_shapes(x.shape, scale.shape), dtype=x.dtype, device=x.device)


def _setup(ctx, inputs, output):
    x, scale = inputs
    ctx.save_for_backward(x, scale)


def _ste(name: str):
    limit, rnd = _MAX[name], _ROUND[name]

    def bwd(ctx, grad):
        x, scale = ctx.saved_tensors
        xf, s, g = x.float(), scale.float(), grad.float()
        keep = (xf >= -limit * s) & (xf <= limit * s)
        gx = torch.where(keep, g, torch.zeros_like(g)).to(grad.dtype)
        if not ctx.needs_input_grad[1]:
            return gx, None
        # LSQ: dy/ds = round(v) - v inside the grid, -max below it, +max above it (0 in dead slices), as E4M3's
        dead = s == 0
        v = xf / torch.where(dead, torch.ones_like(s), s)
        top = torch.full_like(v, limit)
        term = torch.where(v < -limit, -top, torch.where(v > limit, top, rnd(v) - v))
        gs = torch.where(dead, torch.zeros_like(term), term * g)
        return gx, gs.sum_to_size(scale.shape).to(scale.dtype)

    return bwd


for _op, _name in ((fake_e5m2, "fake_e5m2"), (fake_e2m1, "fake_e2m1")):
    _op.register_fake(_fake)
    eager.register_autograd(_op, _ste(_name), _setup)

# plain torch.onnx.export: standard Q/DQ instead of the opaque ops (see .onnx_qdq)
fake_e5m2 = onnx_qdq.export_aware(fake_e5m2, onnx_qdq.fake_e5m2)
fake_e2m1 = onnx_qdq.export_aware(fake_e2m1, onnx_qdq.fake_e2m1)
