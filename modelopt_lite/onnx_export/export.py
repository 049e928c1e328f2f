"""``export_onnx``: a fake-quantized model -> a standard Q/DQ ONNX file that ONNX Runtime runs bit-exactly.

Flow: check the quantizers (:mod:`.checks`) -> ``torch.onnx.export`` with marker nodes for the fake-quant ops
(:mod:`.symbolic` for TorchScript, :mod:`.dynamo` for ``dynamo=True``) -> replace the markers with Q/DQ and
quantized initializers (:mod:`.postprocess`) -> optional ONNX Runtime layout (:mod:`.ort_layout`) -> save, run
``onnx.checker.check_model(full_check=True)`` and shape inference -> :class:`ExportReport`.

The model is left exactly as it was: its mode flags are restored and its buffers are never written.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field

import onnx
import torch
from onnx import helper
from torch import nn

from ..functional import deferred_errors, onnx_qdq
from . import checks, ort_layout, postprocess
from .graph import OpsetTooLow
from .inspect import InspectReport, inspect_onnx

log = logging.getLogger(__name__)
TARGETS = ("tensorrt", "onnxruntime")


@dataclass
class ExportReport:
    """What :func:`export_onnx` wrote: sizes, node counts, Q/DQ by dtype and granularity, and notes."""

    path: str
    opset: int
    target: str
    exporter: str
    file_size: int
    node_counts: dict[str, int]
    qdq_counts: dict[str, int]
    weights: list[dict] = field(default_factory=list)
    activations: list[dict] = field(default_factory=list)
    merged: int = 0
    notes: list[str] = field(default_factory=list)
    inspection: InspectReport | None = None

    def __str__(self) -> str:
        return self.format()

    def format(self) -> str:
        """A printable summary (the CLI prints it)."""
        lines = [
            (
                f"exported {self.path} ({self.exporter}, opset {self.opset}, target={self.target}): "
                f"{self.file_size / 1024:.1f} KiB, {len(self.weights)} quantized weight(s), "
                f"{len(self.activations)} activation Q/DQ pair(s), {self.merged} duplicate(s) merged"
            )
        ]
        if self.inspection is not None:
            lines.append(self.inspection.format())
        if self.notes:
            lines.append("notes:")
            lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def _check_args(target, opset, dynamo, fp8_custom_ops):
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or not 10 <= opset <= 24):
        raise ValueError(f"opset must be an int in 10..24 or None, got {opset!r}")
    if not isinstance(dynamo, bool):
        raise TypeError(f"dynamo must be a bool, got {dynamo!r}")
    if fp8_custom_ops and target != "tensorrt":
        raise ValueError("fp8_custom_ops=True emits TensorRT-only trt::TRT_FP8* nodes; it needs target='tensorrt'")


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """Put the model in eval mode for tracing and restore every module's training flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, training in flags:
            m.training = training


def _torch_export(model, args, path, *, opset, dynamo, input_names, output_names, dynamic_axes):
    with warnings.catch_warnings(), onnx_qdq.raw_ops():  # markers, not the plain-export Q/DQ
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*'dynamic_axes' is not recommended when dynamo=True")
        if dynamo:
            from .dynamo import translation_table

            with contextlib.redirect_stdout(io.StringIO()):
                prog = torch.onnx.export(
                    model,
                    args,
                    dynamo=True,
                    opset_version=max(opset, 18),
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,
                    custom_translation_table=translation_table(),
                    verbose=False,
                    external_data=False,
                    optimize=True,
                )
            assert prog is not None  # dynamo=True returns an ONNXProgram
            return prog.model_proto
        from .symbolic import DOMAIN, registered_symbolics

        ts_opset = min(opset, checks.TORCHSCRIPT_MAX_OPSET)
        with registered_symbolics():
            torch.onnx.export(
                model,
                args,
                path,
                dynamo=False,
                opset_version=ts_opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                do_constant_folding=True,
                custom_opsets={DOMAIN: 1},
            )
        m = onnx.load(path)
        if opset > ts_opset:
            from onnx import version_converter

            m = version_converter.convert_version(m, opset)
        return m


def _resolve(raw: onnx.ModelProto, opset: int, auto: bool, target: str, fp8_custom_ops: bool):
    """Post-process; with an automatic opset, raise it (version converter) when a quantizer needs more."""
    while True:
        work = onnx.ModelProto()
        work.CopyFrom(raw)
        try:
            proto, res = postprocess.resolve(work, opset=opset, target=target, fp8_custom_ops=fp8_custom_ops)
            return proto, res, opset
        except OpsetTooLow as e:
            if not auto or e.required <= opset:
                raise
            from onnx import version_converter

            log.info("export_onnx: raising the opset from %d to %d (%s)", opset, e.required, e)
            raw, opset = version_converter.convert_version(raw, e.required), e.required


def _check_empty_inputs(model: nn.Module, args) -> None:
    """Quantizers return empty tensors as they are, so tracing an empty example would drop their Q/DQ silently:
    refuse, naming the empty input(s) and the quantizers that would be lost."""
    empty = [(i, tuple(a.shape)) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.numel() == 0]
    if not empty:
        return
    skipped: list[str] = []
    hooks = [
        q.register_forward_pre_hook(lambda mod, inp, name=name: skipped.append(name) if _is_empty(inp) else None)
        for name, q in checks.quantizers(model)
        if q.is_enabled and q.is_quant_enabled
    ]
    try:
        model(*args)
    finally:
        for h in hooks:
            h.remove()
    if skipped:
        where = ", ".join(f"example input {i} has shape {shape}" for i, shape in empty)
        raise ValueError(
            f"cannot export: {where} (no elements); quantizers pass empty tensors through unquantized, so "
            f"the export would lose the Q/DQ of {', '.join(dict.fromkeys(skipped))}: export with a non-empty "
            "example (and dynamic_axes for a batch that may be empty)"
        )


def _non_finite_tensors(model: nn.Module) -> list[str]:
    """Names of the floating-point buffers/parameters holding NaN or Inf (e.g. an amax given to the functional API)."""
    named = list(model.named_buffers()) + list(model.named_parameters())
    return [n for n, t in named if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]


def _is_empty(inp) -> bool:
    return bool(inp) and isinstance(inp[0], torch.Tensor) and inp[0].numel() == 0


def _default_names(args, input_names):
    if input_names is not None:
        return list(input_names)
    n = sum(1 for a in args if isinstance(a, torch.Tensor))
    return ["input"] if n == 1 else [f"input_{i}" for i in range(n)]


def min_ir_version(opset_imports) -> int:
    """The lowest IR version (at least 7) that can hold these opset imports: what :func:`export_onnx` stamps, so that
    a file loads in every ONNX Runtime that implements its opset (``onnx.helper.make_model`` stamps the newest IR
    version of the installed onnx instead, which older ONNX Runtime releases refuse)."""
    std = [o for o in opset_imports if o.domain in ("", "ai.onnx")]
    return max(7, helper.find_min_ir_version_for(std, ignore_unknown=True))


def export_onnx(
    model: nn.Module,
    args,
    path,
    *,
    opset: int | None = None,
    target: str = "tensorrt",
    dynamic_axes=None,
    dynamo: bool = False,
    input_names=None,
    output_names=None,
    fp8_custom_ops: bool = False,
    ort_weights: str = "auto",
) -> ExportReport:
    """Export a (fake-)quantized model to a standard Q/DQ ONNX file and return an :class:`ExportReport`.

    Args:
        model: an ``nn.Module``; every enabled quantizer must be calibrated (the error lists all that are not).
        args: example inputs (a tensor or a tuple of positional inputs).
        path: where to write the ``.onnx`` file.
        opset: ONNX opset; None picks the lowest that expresses every quantizer (>= 17; 19 for FP8, 21 for INT4
            blocks or 16-bit grids, 23 for NVFP4 / FP4 elements, 24 for MX: E8M0 scales). Too low an opset
            for a quantizer raises ValueError naming it.
        target: ``"tensorrt"`` (Q/DQ on inputs and weights, zero points 0, positive scales) or ``"onnxruntime"``
            (same graph, stored so that ORT's CPU provider fuses real int8 kernels; see :mod:`.ort_layout`;
            pair it with the ``INT8_ORT_CFG`` preset, which also quantizes Conv/Linear outputs and sets
            ``requant="integer"``, so the torch model computes what ORT's fused int8 kernels compute, bit for bit).
        dynamic_axes: as in ``torch.onnx.export``.
        dynamo: use the ``torch.export``-based exporter (custom translation table) instead of TorchScript.
        input_names, output_names: graph input/output names (default ``input``/``input_i`` and the exporter's).
        fp8_custom_ops: write FP8 activations as TensorRT's ``trt::TRT_FP8QuantizeLinear``/``DequantizeLinear``
            instead of opset-19 Q/DQ (TensorRT only; ONNX Runtime cannot run them).
        ort_weights: with ``target="onnxruntime"``, how weights are stored (see :mod:`.ort_layout`); the file
            never depends on the exporting machine. ``"auto"`` (default): each weight signed int8 when its codes
            lie within +-64 (7-bit weights: the ``INT8_ORT_REDUCED_RANGE_CFG`` preset), which ORT's fast u8 x s8
            kernels compute exactly on every CPU, else uint8 (u8 x u8 kernels: exact everywhere, slower).
            ``"uint8"``: every weight uint8. ``"int8"``: every weight int8, a VNNI-only layout: full-range 8-bit
            weights are exact only on CPUs with VNNI or AMX (older x86 CPUs saturate), and such an export warns.

    Weights are stored already quantized (INT8/INT4/FP8 initializers followed by DequantizeLinear only). The model
    is left exactly as it was (mode flags restored, no buffer written).
    """
    deferred_errors.check_errors()  # a sync point: pending CUDA value errors raise before exporting
    _check_args(target, opset, dynamo, fp8_custom_ops)
    ort_layout.resolve_weights(ort_weights)  # a bad value fails before the (slow) export
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args = args if isinstance(args, tuple) else (args,)
    plan = checks.plan(model, target=target, opset=opset)
    auto = opset is None
    opset = opset if opset is not None else plan.preferred_opset
    path = os.fspath(path)
    names = _default_names(args, input_names)
    with _eval_mode(model), torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        _check_empty_inputs(model, args)
        try:
            raw = _torch_export(
                model,
                args,
                os.path.join(tmp, "raw.onnx"),
                opset=opset,
                dynamo=dynamo,
                input_names=names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
            )
        except ValueError as e:
            bad = _non_finite_tensors(model)
            if not bad or "amax" not in str(e):
                raise
            raise ValueError(f"cannot export: {e} (non-finite values in {', '.join(bad)})") from e
    proto, res, opset = _resolve(raw, opset, auto, target, fp8_custom_ops)
    notes = plan.notes + res.notes
    if target == "onnxruntime":
        proto, layout_notes = ort_layout.apply(proto, weights=ort_weights)
        notes += layout_notes + _requant_notes(model)
    notes += _axis_notes(proto, target) + _runtime_notes(proto, target)
    if dynamo and opset < 18:
        notes.append(f"the dynamo exporter writes opset >= 18; exported at opset {max(opset, 18)}")
    proto.ir_version = min_ir_version(proto.opset_import)
    uses_custom = any(n.domain not in ("", "ai.onnx") for n in proto.graph.node)
    onnx.save(proto, path)
    if uses_custom:
        onnx.checker.check_model(path)
        notes.append("custom-domain nodes present: checked without full shape inference")
    else:
        onnx.checker.check_model(path, full_check=True)
        onnx.shape_inference.infer_shapes(onnx.load(path), check_type=True, strict_mode=True)
    info = inspect_onnx(path)
    return ExportReport(
        path=path,
        opset=info.opset,
        target=target,
        exporter="dynamo" if dynamo else "torchscript",
        file_size=info.file_size,
        node_counts=info.node_counts,
        qdq_counts=info.qdq,
        weights=res.weights,
        activations=res.activations,
        merged=res.merged,
        notes=notes,
        inspection=info,
    )


def _requant_notes(model: nn.Module) -> list[str]:
    """A note when quantized outputs of Linear/Conv layers run the float path in torch (ORT fuses them into int8
    kernels that requantize in integers, so the two may differ by one step there)."""
    from ..nn.modules._integer_requant import unfit_reason

    floats = [
        n
        for n, m in model.named_modules()
        if hasattr(m, "requant") and m.requant != "integer" and unfit_reason(m) is None
    ]
    if not floats:
        return []
    return [
        (
            f"{len(floats)} quantized Linear/Conv output(s) (first: {floats[0]!r}) use requant='float' in torch, "
            "while ORT's fused int8 kernels requantize in integers: outputs may differ by one step; "
            "modelopt_lite.set_requant(model, 'integer') (INT8_ORT_CFG sets it) makes them bit-identical"
        )
    ]


def _runtime_notes(model: onnx.ModelProto, target: str) -> list[str]:
    from . import ort_runner

    notes = []
    if ort_runner.has_fp8(model):
        notes.append(
            "ONNX Runtime (CPU) runs this FP8 graph exactly only with session.disable_quant_qdq=1 and the "
            "ReluQuantRewrite optimizer disabled (modelopt_lite.onnx_export.ort_runner.ort_session does both)"
        )
    elif target == "tensorrt" and ort_runner.has_signed_int8_weights(model):
        notes.append(
            "to check this TensorRT-style graph in ONNX Runtime on CPUs without VNNI, use "
            "session.disable_quant_qdq=1 (ort_session does): ORT's fused u8 x s8 kernels saturate on "
            "full-range int8 weights; export with target='onnxruntime' for ORT deployment"
        )
    return notes


_WEIGHT_AXIS = {"Conv": 0, "ConvTranspose": 1}


def _axis_notes(model: onnx.ModelProto, target: str) -> list[str]:
    """Per-channel weights quantized on an axis TensorRT does not use for that op (reported, not fixed)."""
    if target != "tensorrt":
        return []
    from .graph import attr

    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    notes = []
    for n in model.graph.node:
        if n.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or len(n.input) < 2:
            continue
        dq = producers.get(n.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or attr(dq, "block_size", 0):
            continue
        scale = inits.get(dq.input[1])
        if scale is None or len(scale.dims) != 1 or scale.dims[0] <= 1:
            continue
        rank = len(inits[dq.input[0]].dims) if dq.input[0] in inits else 2
        expected = _WEIGHT_AXIS.get(n.op_type)
        if n.op_type == "Gemm":
            expected = 0 if attr(n, "transB", 0) else 1
        elif n.op_type == "MatMul":
            expected = rank - 1
        axis = attr(dq, "axis", 1) % rank
        if axis != expected:
            notes.append(
                f"{n.op_type} {n.name!r}: weight quantized per channel on axis {axis}; TensorRT expects "
                f"the output-channel axis {expected}"
            )
    return notes


def node_counts(path) -> dict[str, int]:
    """``{op_type: count}`` of an ONNX file (a small helper for tests and benchmarks)."""
    return dict(Counter(n.op_type for n in onnx.load(os.fspath(path)).graph.node))
