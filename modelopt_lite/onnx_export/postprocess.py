"""Replace the marker nodes of a fresh export with standard Q/DQ, fold weights, de-duplicate, clean up.

Steps (all on the ONNX graph, the torch model is never touched):

1. evaluate the constant inputs of every marker (scales, zero points, and the tensor itself for weights);
2. merge markers that quantize the same tensor with the same parameters (one Q/DQ pair feeds all consumers);
3. a marker on a constant becomes an integer/FP8 initializer + DequantizeLinear (:mod:`.weights`), a marker on a
   run-time tensor becomes Q -> DQ (:mod:`.qdq`);
4. drop what is no longer used (the float weights, the scale sub-graphs) and the private opset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from . import microscaling, qdq, scale_codes, weights
from .graph import Graph, attr
from .symbolic import DOMAIN, MARKERS, MICROSCALING_MARKERS, NVFP4_MARKER, NVFP4_STATIC_MARKER


@dataclass
class Resolution:
    """What the post-pass did: one entry per exported quantizer site, plus notes."""

    weights: list[dict] = field(default_factory=list)
    activations: list[dict] = field(default_factory=list)
    merged: int = 0
    notes: list[str] = field(default_factory=list)


def _module_path(scopes: list[str]) -> str:
    """The module path from exporter scopes: a child of a Sequential/ModuleList is scoped ``"seq.0"`` under
    ``"seq"`` (``/blocks.0/seq/seq.2/seq.2.0``), so a scope extending the one before it replaces it."""
    path: list[str] = []
    for s in scopes:
        if path and s.startswith(path[-1] + "."):
            path[-1] = s
        else:
            path.append(s)
    return ".".join(path)


def site_label(node: onnx.NodeProto) -> str:
    """A readable name for a marker: the quantizer's module path (``model.get_submodule`` finds it) when the
    exporter recorded it."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                import ast

                scopes = [s for s in ast.literal_eval(p.value) if s][:-1]  # the last one names the op itself
                if scopes:
                    return _module_path(scopes)
            except (ValueError, SyntaxError):
                pass
    parts = [p for p in node.name.split("/") if p]
    if len(parts) > 1:
        return _module_path(parts[:-1])
    return parts[0] if parts else f"{node.op_type} at {node.input[0]!r}"


def _marker_key(node, consts):
    vals = []
    for name in node.input[1:]:
        a = consts[name]
        vals.append((a.shape, a.astype(np.float32).tobytes()))
    attrs = tuple(sorted((a.name, onnx.helper.get_attribute_value(a)) for a in node.attribute))
    return (node.op_type, node.input[0], attrs, tuple(vals))


def _merge_pre_quant_muls(g: Graph, markers) -> int:
    """``Mul(x, c)`` nodes feeding markers that multiply the same ``x`` by equal constants ``c`` (the
    ``pre_quant_scale`` of layers sharing one input, e.g. q/k/v) become one, so their markers can merge too."""
    prod = g.producers()
    muls = {id(m): m for n in markers for m in [prod.get(n.input[0])] if m is not None and m.op_type == "Mul"}
    consts = g.constants([m.input[1] for m in muls.values()])
    kept: dict = {}
    merged = 0
    for m in muls.values():
        c = consts.get(m.input[1])
        if c is None:
            continue
        key = (m.input[0], c.dtype.str, c.shape, c.tobytes())
        if key in kept:
            g.nodes = [k for k in g.nodes if k is not m]
            g.rename_uses(m.output[0], kept[key].output[0])
            merged += 1
        else:
            kept[key] = m
    return merged


def resolve(model: onnx.ModelProto, *, opset: int, target: str, fp8_custom_ops: bool = False):
    """Replace every marker in ``model`` (in place); returns ``(model, Resolution)``."""
    g = Graph(model)
    res = Resolution()
    markers = [n for n in g.nodes if n.domain == DOMAIN]
    unknown = sorted({n.op_type for n in markers} - set(MARKERS))
    if unknown:
        raise ValueError(f"unknown modelopt_lite marker op(s) in the export: {unknown}")
    consts = g.constants([i for n in markers for i in n.input])
    # 2. merge duplicates (first the SmoothQuant multiplies that feed them: equal Mul(x, c) become one)
    _merge_pre_quant_muls(g, markers)
    kept: dict = {}
    alive = []
    for n in markers:
        if not all(i in consts for i in n.input[1:]):  # scales computed from another marker: merged later, if ever
            alive.append(n)
            continue
        key = _marker_key(n, consts)
        if key in kept:
            g.nodes = [m for m in g.nodes if m is not n]
            g.rename_uses(n.output[0], kept[key].output[0])
            res.merged += 1
        else:
            kept[key] = n
            alive.append(n)
    # 3. replace, in rounds: a marker whose scales come from another marker (double-quantized block scales) waits
    # until that one is folded into a DequantizeLinear, whose output is then a constant
    folded: dict[str, tuple] = {}  # weight DQ output -> (FoldedWeight, report entry)
    pending = alive
    while pending:
        ready = [n for n in pending if all(i in consts for i in n.input[1:])]
        if not ready:
            raise ValueError(
                f"{site_label(pending[0])}: the quantization scale is computed at run time (dynamic "
                "quantization of an activation); ONNX export needs a calibrated, static amax"
            )
        for n in ready:
            _replace(g, n, consts, res, folded, opset=opset, target=target, fp8_custom_ops=fp8_custom_ops)
        done = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in done]
        if pending:
            consts.update(g.constants([i for n in pending for i in n.input]))
    g.prune()
    live = {o for m in g.nodes for o in m.output}
    res.weights = [w for w in res.weights if w.pop("_out") in live]  # scale DQs re-emitted elsewhere are gone
    g.tidy_names()
    model = g.commit()
    _fix_opsets(model, uses_trt=any(n.domain == qdq.TRT_DOMAIN for n in model.graph.node))
    return model, res


def _replace(g: Graph, n, consts, res: Resolution, folded: dict, *, opset, target, fp8_custom_ops) -> None:
    """Replace one marker: a constant becomes codes + DequantizeLinear, a run-time tensor Q -> DQ."""
    label = site_label(n)
    if n.op_type in MICROSCALING_MARKERS:
        _replace_microscaling(g, n, consts, res, label, opset)
        return
    x, out = n.input[0], n.output[0]
    scale = consts[n.input[1]]
    zp = consts[n.input[2]] if len(n.input) > 2 else None
    qmin, qmax = attr(n, "qmin", 0), attr(n, "qmax", 0)
    dtype = attr(n, "dtype", TensorProto.FLOAT)
    if x in consts:
        src = scale_codes.source(g, n.input[1], folded)
        extras = None if src is None else scale_codes.follow(g, n.input[1], src, folded[src][0], scale)
        fw = weights.fold(n.op_type, consts[x], scale, zp, qmin, qmax, label, extras)
        final, absorbed = weights.absorb(g, fw, out)
        dq_out = final if dtype == TensorProto.FLOAT else g.fresh(f"{final}_float")
        source = None if extras is None else scale_codes.scale_source(g, fw, folded[src][0], opset, label)
        new, info = weights.emit(g, fw, dq_out, opset, label, scale_source=source)
        if src is not None:
            res.notes.append(scale_codes.note(label, info.get("scales")))
        nodes = new + _cast(g, dq_out, final, dtype)
        gone = {id(m) for m in absorbed}
        idx = next(i for i, m in enumerate(g.nodes) if m is n)
        g.nodes[idx : idx + 1] = nodes
        g.nodes = [m for m in g.nodes if id(m) not in gone]
        entry = dict(info, site=label, absorbed=[m.op_type for m in absorbed], _out=dq_out)
        res.weights.append(entry)
        if dtype == TensorProto.FLOAT:
            folded[dq_out] = (fw, entry)
        return
    xf = x if dtype == TensorProto.FLOAT else g.fresh(f"{x}_float")
    of = out if dtype == TensorProto.FLOAT else g.fresh(f"{out}_float")
    nodes, info = qdq.emit(
        g,
        n.op_type,
        xf,
        of,
        scale,
        zp,
        qmin,
        qmax,
        opset=opset,
        target=target,
        fp8_custom_ops=fp8_custom_ops,
        label=label,
    )
    nodes = _cast(g, x, xf, TensorProto.FLOAT) + nodes + _cast(g, of, out, dtype)
    idx = next(i for i, m in enumerate(g.nodes) if m is n)
    g.nodes[idx : idx + 1] = nodes
    res.notes += info.pop("notes")
    res.activations.append(dict(info, site=label))


def _replace_microscaling(g: Graph, n, consts, res: Resolution, label: str, opset: int) -> None:
    """NVFP4/MX markers: weights become FP4/FP8/INT8 codes + block scales, activations a run-time sub-graph (see
    :mod:`.microscaling`); computed in float32 with casts around them for float16/bfloat16 models."""
    x, out = n.input[0], n.output[0]
    dtype = attr(n, "dtype", TensorProto.FLOAT)
    block = attr(n, "block")
    nv = n.op_type in (NVFP4_MARKER, NVFP4_STATIC_MARKER)
    block_amax = None
    if n.op_type == NVFP4_STATIC_MARKER:  # static NVFP4: the stored block amaxes (weights only)
        if x not in consts or n.input[2] not in consts:
            raise ValueError(f"{label}: static NVFP4 (stored block amaxes) exports weights only, not run-time inputs")
        block_amax = torch.from_numpy(np.ascontiguousarray(consts[n.input[2]].astype(np.float32)))
    if nv:
        gs = consts[n.input[1]].astype(np.float32)
        if gs.size != 1:
            raise ValueError(f"{label}: the NVFP4 global scale must be a single value, got shape {gs.shape}")
        gs = float(gs.reshape(()))
    else:
        elem, rounding = attr(n, "elem"), attr(n, "rounding")
    of = out if dtype == TensorProto.FLOAT else g.fresh(f"{out}_float")
    if x in consts:
        w = torch.from_numpy(np.ascontiguousarray(consts[x].astype(np.float32)))
        if nv:
            nodes, info = microscaling.nvfp4_weight(g, w, gs, block, of, opset, label, block_amax)
        else:
            nodes, info = microscaling.mx_weight(g, w, elem, block, rounding, of, opset, label)
        res.weights.append(dict(info, site=label, absorbed=[], _out=of))
        nodes = nodes + _cast(g, of, out, dtype)
    else:
        xf = x if dtype == TensorProto.FLOAT else g.fresh(f"{x}_float")
        if nv:
            nodes, info = microscaling.nvfp4_activation(g, xf, of, gs, block, opset, label)
        else:
            nodes, info = microscaling.mx_activation(g, xf, of, elem, block, rounding, opset, label)
        res.activations.append(dict(info, site=label))
        nodes = _cast(g, x, xf, TensorProto.FLOAT) + nodes + _cast(g, of, out, dtype)
    idx = next(i for i, m in enumerate(g.nodes) if m is n)
    g.nodes[idx : idx + 1] = nodes


def _cast(g: Graph, src: str, dst: str, to: int) -> list[onnx.NodeProto]:
    """``dst = Cast(src, to)``, or nothing when src is dst (float32 models need no casts)."""
    if src == dst:
        return []
    return [helper.make_node("Cast", [src], [dst], to=to, name=g.fresh(f"{dst}_Cast"))]


def _fix_opsets(model: onnx.ModelProto, uses_trt: bool) -> None:
    keep = [o for o in model.opset_import if o.domain not in (DOMAIN, qdq.TRT_DOMAIN)]
    if uses_trt:
        keep.append(helper.make_opsetid(qdq.TRT_DOMAIN, 1))
    del model.opset_import[:]
    model.opset_import.extend(keep)
