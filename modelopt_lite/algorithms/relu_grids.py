"""One grid across a ReLU: the consumer's input quantizer takes the amax of the producer's output quantizer.

Where a quantized op's output quantizer feeds a ReLU whose result is re-quantized by the next op's input quantizer
(``Conv -> output_quantizer -> ReLU -> input_quantizer -> Conv``), giving both quantizers the same grid makes the
second one an exact identity (the ReLU output already lies on that grid), so the exported
``DequantizeLinear -> Relu -> QuantizeLinear`` chain runs in ONNX Runtime as one uint8 ``Clip`` between its int8
kernels (see :mod:`modelopt_lite.onnx_export.ort_layout`). The price: the consumer's grid spans ``max|y|`` instead
of ``max(relu(y))``. Use it after calibrating with ``INT8_ORT_CFG`` and before exporting with
``target="onnxruntime"``.

The pairs are found by running the model once with hooks: an output quantizer's result, passed through an
``nn.ReLU`` module (in place or not), reaching an input quantizer. A functional ``F.relu`` between them is not seen.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..conversion.utils import named_quantizers

log = logging.getLogger(__name__)
_SAME = ("num_bits", "unsigned", "narrow_range")


def _per_tensor_static(q) -> bool:
    return (
        q.is_enabled
        and not q.dynamic
        and q.block_sizes is None
        and q._num_steps == 1
        and q.has_amax
        and q.amax.numel() == 1
    )


def find_relu_pairs(model: nn.Module, forward_loop) -> list[tuple[str, str]]:
    """``(output quantizer, input quantizer)`` names joined by only an ``nn.ReLU``, seen while ``forward_loop(model)``
    runs (in ``torch.no_grad()``); each pair once, in the order first seen."""
    quantizers = dict(named_quantizers(model))
    produced: dict[int, str] = {}  # id(tensor) -> output quantizer name, within one forward of the model
    alive: list[torch.Tensor] = []  # keeps those ids unique until the next forward starts
    pairs: dict[tuple[str, str], None] = {}

    def new_forward(_m, _inp):
        produced.clear()
        alive.clear()

    def out_hook(name):
        def hook(_m, _inp, out):
            if isinstance(out, torch.Tensor):
                produced[id(out)] = name
                alive.append(out)

        return hook

    def relu_hook(_m, inp, out):
        src = produced.get(id(inp[0])) if inp else None
        if src is not None and isinstance(out, torch.Tensor):
            produced[id(out)] = src
            alive.append(out)

    def in_hook(name):
        def hook(_m, inp):
            src = produced.get(id(inp[0])) if inp else None
            if src is not None:
                pairs[(src, name)] = None

        return hook

    handles = [model.register_forward_pre_hook(new_forward)]
    try:
        for name, q in quantizers.items():
            if name.endswith("output_quantizer"):
                handles.append(q.register_forward_hook(out_hook(name)))
            elif name.endswith("input_quantizer"):
                handles.append(q.register_forward_pre_hook(in_hook(name)))
        for m in model.modules():
            if type(m) is nn.ReLU:
                handles.append(m.register_forward_hook(relu_hook))
        with torch.no_grad():
            forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    return list(pairs)


def share_relu_grids(model: nn.Module, forward_loop) -> list[tuple[str, str]]:
    """Give each producer/consumer pair of :func:`find_relu_pairs` one grid (the consumer takes the producer's
    amax) and return the pairs changed. Only enabled, calibrated, per-tensor, static quantizers with the same
    num_bits/unsigned/narrow_range are paired; others are left alone (logged at INFO)."""
    quantizers = dict(named_quantizers(model))
    changed = []
    for src, dst in find_relu_pairs(model, forward_loop):
        a, b = quantizers[src], quantizers[dst]
        if not (_per_tensor_static(a) and _per_tensor_static(b)) or any(getattr(a, k) != getattr(b, k) for k in _SAME):
            log.info("share_relu_grids: %s -> ReLU -> %s left alone (not two matching per-tensor quantizers)", src, dst)
            continue
        with torch.no_grad():
            src_amax, dst_amax = a.amax, b.amax
            assert isinstance(src_amax, torch.Tensor) and isinstance(dst_amax, torch.Tensor)  # both per-tensor static
            b.amax = src_amax.detach().clone().reshape(dst_amax.shape)
        changed.append((src, dst))
    return changed
