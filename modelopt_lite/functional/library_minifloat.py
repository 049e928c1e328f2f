"""``torch.library`` ops of the scaled FP8 E5M2 and FP4 E2M1 element formats (per tensor or per channel, as
``fake_e4m3`` of :mod:`.library`), with fake (meta) impls and straight-through gradients.

Ops (namespace ``modelopt_lite``), numerics ``elem(x / s) * s`` in float32 with the element roundings of
:mod:`.microscaling` (``e5m2_round``: saturating at 57344; ``e2m1_round``: saturating at 6), a scale of exactly 0
marking a dead slice (``+0.0`` outputs), the result cast back to x's dtype:

- ``fake_e5m2(x, scale) -> y``        - ``fake_e2m1(x, scale) -> y``

A backend whose kernel module defines a function of the same name runs it (the native CPU and CUDA kernels, tested
bit for bit against :func:`fake_e5m2_reference` / :func:`fake_e2m1_reference`); otherwise the reference runs.
Gradient: ``dy/dx = 1`` where ``-max * s <= x <= max * s`` (float32), else 0; the scale gets none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import microscaling as ms
from .backend import kernels_for


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


def _run(name: str, x: Tensor, scale: Tensor) -> Tensor:
    fn = getattr(kernels_for(x.device.type), name, None) or _REFERENCE[name]
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


def _ste(limit: float):
    def bwd(ctx, grad):
        x, scale = ctx.saved_tensors
        xf, s = x.float(), scale.float()
        keep = (xf >= -limit * s) & (xf <= limit * s)
        return torch.where(keep, grad.float(), torch.zeros_like(grad, dtype=torch.float32)).to(grad.dtype), None

    return bwd


for _op, _name in ((fake_e5m2, "fake_e5m2"), (fake_e2m1, "fake_e2m1")):
    _op.register_fake(_fake)
    _op.register_autograd(_ste(_MAX[_name]), setup_context=_setup)
