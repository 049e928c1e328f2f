"""``compare_with_onnxruntime``: where an exported graph and its torch model start to disagree, quantizer by quantizer.

The model runs once in torch (hooks record every quantizer's input and fake-quantized output) and once in ONNX
Runtime with every ``QuantizeLinear`` named ``<quantizer>.Q`` exposed: its integer codes (or, for FP8, the float
output of the ``DequantizeLinear`` that reads them) and, where that cannot change ORT's fusions, its float input.
Each row says, for one quantizer in graph order, how far ORT's input is from torch's and how many quantized values
differ (in steps of the quantizer's scale). A row whose values differ while its input does not would be a Q/DQ
numerics bug; a row whose input already differs by float32 rounding shows where float kernels (Gemm, Conv, Erf,
LayerNorm, ...) computed in another order pushed a value across a rounding boundary.

The quantizer's input is not exposed when the ``QuantizeLinear`` follows a Conv/Gemm/MatMul (ORT may fuse the
three into one int8 kernel, and an exposed float tensor would stop that) or when the quantizer has a
``pre_quant_scale`` (the exported Mul sits in front of the Q, so the inputs are not comparable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import helper

from .graph import Graph, attr
from .ort_runner import ort_session

_FUSABLE = ("Conv", "Gemm", "MatMul")


@dataclass
class QuantizerDiff:
    """One quantizer: ORT vs torch."""

    name: str
    elements: int
    input_max_diff: float | None  # max |ORT input - torch input| (None: not exposed, see the module docstring)
    differing: int  # quantized values that differ
    max_steps: float  # max |difference| / scale (quantization steps for integer formats)

    @property
    def agrees(self) -> bool:
        return self.differing == 0


@dataclass
class DivergenceReport:
    """Rows in graph order, the network outputs' max |ORT - torch|, and the quantizers that could not be compared."""

    rows: list[QuantizerDiff] = field(default_factory=list)
    output_max_diff: list[float] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def first_divergence(self) -> QuantizerDiff | None:
        return next((r for r in self.rows if not r.agrees), None)

    def __str__(self) -> str:
        return self.format()

    def format(self) -> str:
        w = max([len("quantizer")] + [len(r.name) for r in self.rows]) + 2
        lines = [
            (
                f"{'quantizer':<{w}}{'elements':>10}{'input max|diff|':>17}{'values differing':>18}"
                f"{'max |diff|/scale':>18}"
            )
        ]
        for r in self.rows:
            inp = "-" if r.input_max_diff is None else f"{r.input_max_diff:.3g}"
            lines.append(f"{r.name:<{w}}{r.elements:>10}{inp:>17}{r.differing:>18}{r.max_steps:>18.3g}")
        lines.append("outputs max |ORT - torch|: " + ", ".join(f"{d:.3g}" for d in self.output_max_diff))
        lines += [f"not compared: {k} ({v})" for k, v in self.skipped.items()]
        return "\n".join(lines)


def _record(model: torch.nn.Module, args: tuple) -> tuple[dict, list]:
    from ..conversion.utils import named_quantizers

    seen: dict[str, tuple[torch.Tensor, torch.Tensor, torch.nn.Module]] = {}
    handles = []
    for name, q in named_quantizers(model):

        def hook(m, inp, out, name=name):
            if inp and isinstance(inp[0], torch.Tensor) and isinstance(out, torch.Tensor):
                seen[name] = (inp[0].detach().clone(), out.detach().clone(), m)

        handles.append(q.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(*args)
    finally:
        for h in handles:
            h.remove()
    if isinstance(out, torch.Tensor):
        return seen, [out]
    values = out.values() if isinstance(out, Mapping) else out
    outs = [o for o in values if isinstance(o, torch.Tensor)]
    return seen, outs


def compare_with_onnxruntime(model: torch.nn.Module, onnx_path, args, **session_kw) -> DivergenceReport:
    """Run ``model(*args)`` in torch and the exported ``onnx_path`` in ONNX Runtime (:func:`ort_session` with
    ``session_kw``) on the same inputs; compare every quantizer that has a ``<name>.Q`` node (module docstring)."""
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    model_proto = onnx.load(os.fspath(onnx_path))
    inits = {t.name for t in model_proto.graph.initializer}
    inputs = [i.name for i in model_proto.graph.input if i.name not in inits]
    if len(inputs) != len(args):
        raise ValueError(
            f"compare_with_onnxruntime: {os.fspath(onnx_path)} takes {len(inputs)} input(s) {inputs}, "
            f"got {len(args)} argument(s)"
        )
    g = Graph(model_proto)
    prod, cons = g.producers(), g.consumers()
    seen, torch_outs = _record(model, args)
    report = DivergenceReport()
    plan = []  # (name, value tensor, input tensor or None, scale, zero point, axis, kind)
    for n in g.nodes:
        if n.op_type != "QuantizeLinear" or not n.name.endswith(".Q"):
            continue
        name = n.name[:-2]
        if name not in seen:
            report.skipped[name] = "no quantizer of that name ran in torch"
            continue
        scale, zp = g.array(n.input[1]), g.array(n.input[2]) if len(n.input) > 2 else np.zeros((), np.uint8)
        if scale is None or zp is None:
            report.skipped[name] = "scale or zero point is not a constant"
            continue
        source = prod.get(n.input[0])
        expose_input = (source is None or source.op_type not in _FUSABLE) and getattr(
            seen[name][2], "pre_quant_scale", None
        ) is None
        if zp.dtype in (np.int8, np.uint8):
            value, kind = n.output[0], "codes"
        else:  # FP8 codes: compare what the DequantizeLinear reading them computes
            dqs = [c for c in cons.get(n.output[0], []) if c.op_type == "DequantizeLinear"]
            if not dqs:
                report.skipped[name] = "FP8 codes with no DequantizeLinear reading them"
                continue
            value, kind = dqs[0].output[0], "values"
        plan.append((name, value, n.input[0] if expose_input else None, scale, zp, attr(n, "axis", 1), kind))
    graph_outputs = [o.name for o in model_proto.graph.output]
    have = set(graph_outputs)
    for _, value, inp, *_ in plan:
        for t in (value, inp):
            if t is not None and t not in have:
                model_proto.graph.output.append(helper.make_empty_tensor_value_info(t))
                have.add(t)
    sess = ort_session(model_proto, **session_kw)
    feeds = {name: a.detach().cpu().numpy() for name, a in zip(inputs, args)}
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(names, feeds)))
    for name, value, inp, scale, zp, axis, kind in plan:
        t_in, t_out, _ = seen[name]
        v = got[value]
        if tuple(v.shape) != tuple(t_out.shape):
            report.skipped[name] = f"ORT shape {tuple(v.shape)} vs torch {tuple(t_out.shape)} (layout rewritten)"
            continue
        want = t_out.double().numpy()
        if kind == "codes":  # what the DequantizeLinear computes: float32((q - z)) * scale, in float32
            shifted = (v.astype(np.int32) - _bcast(zp.astype(np.int32), v.ndim, axis)).astype(np.float32)
            ort_values = (shifted * _bcast(scale.astype(np.float32), v.ndim, axis)).astype(np.float64)
        else:
            ort_values = v.astype(np.float64)
        diff = np.abs(ort_values - want)
        in_diff = None
        if inp is not None and tuple(got[inp].shape) == tuple(t_in.shape):
            in_diff = float(np.abs(got[inp].astype(np.float64) - t_in.double().numpy()).max(initial=0.0))
        steps = diff / _bcast(scale.astype(np.float64), diff.ndim, axis)
        report.rows.append(
            QuantizerDiff(name, int(v.size), in_diff, int((diff > 0).sum()), float(steps.max(initial=0.0)))
        )
    for o, t in zip(graph_outputs, torch_outs):
        report.output_max_diff.append(float(np.abs(got[o].astype(np.float64) - t.double().numpy()).max(initial=0.0)))
    return report


def _bcast(a: np.ndarray, ndim: int, axis: int) -> np.ndarray:
    """A per-tensor (scalar) or per-channel (1-D, along ``axis``) scale or zero point shaped to broadcast."""
    if a.size == 1:
        return a.reshape(())
    shape = [1] * ndim
    shape[axis % ndim] = -1
    return a.reshape(shape)
