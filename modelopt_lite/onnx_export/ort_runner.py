"""Running exported files with ONNX Runtime (CPU): session options that keep results exact and timings honest.

- FP8 Q/DQ graphs hit two ONNX Runtime (1.31) CPU optimizer bugs: the QDQ fusion turns FP8 ``DQ -> Gemm`` into
  QGemm, which rejects float8 inputs (the model fails to load), and the ``ReluQuantRewrite`` rule deletes a Relu in
  front of an FP8 QuantizeLinear as if its zero point 0 were the lowest code (negative values then survive: wrong
  results). For graphs holding FLOAT8 tensors :func:`ort_session` sets ``session.disable_quant_qdq=1`` and disables
  ``ReluQuantRewrite``; the results are then exact. INT8 graphs keep every optimization.
- TensorRT-style graphs (signed INT8 weights, zero point 0): on x86 CPUs without VNNI, ORT fuses ``DQ -> MatMul``
  into ``MatMulIntegerToFloat``/``QGemm`` whose u8 x s8 kernel (``vpmaddubsw``) saturates int16 pair sums, which
  visibly changes results (MiniLM: max |diff| 0.17 on embeddings of norm ~1). With ``exact=True`` (the default)
  such graphs get ``session.disable_quant_qdq=1`` so the Q/DQ run as written. Graphs exported with
  ``target="onnxruntime"`` keep every fusion where they are exact: uint8 weights (u8 x u8 kernels) everywhere, int8
  weights (u8 x s8 kernels) on CPUs with VNNI or AMX (measured: MiniLM outputs identical to the uint8 layout).
- Blocked weights (``DequantizeLinear`` with ``block_size``, e.g. ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``): ORT (1.32)
  fuses ``DQ -> MatMul`` into ``MatMulNBits`` (rule ``DQMatMulToMatMulNBits`` inside the QDQ selector/action
  transformer, which cannot be disabled alone), whose default ``session.qdq_matmulnbits_accuracy_level=4`` quantizes
  the *activations* to int8 per block: results move by ~1e-2 (measured on a 256 -> 64 Linear), a quantization the
  graph does not contain. With ``exact=True`` such graphs get ``session.disable_quant_qdq=1``: ORT then folds the
  weight DQ into a float32 initializer once (the same bits DequantizeLinear gives) and runs its float MatMul/Gemm,
  at about the fused kernel's speed on this CPU (AVX2). ``exact=False`` keeps the MatMulNBits fusion.
- FLOAT4E2M1 (FP4 E2M1 weights, zero points): no ORT 1.32 CPU kernels; :func:`ort_session` says so
  (ValueError) instead of failing inside ORT.
- ``spinning=False`` sets ``session.intra_op.allow_spinning=0`` (fair latency measurements on shared CPUs).
"""

from __future__ import annotations

import os

import onnx
from onnx import TensorProto

from .ort_layout import host_has_vnni, wide_int8_weights

_FP8 = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ}


def has_fp8(model: onnx.ModelProto) -> bool:
    """True when an initializer of the model is a float8 tensor (FP8 weights or zero points)."""
    return any(t.data_type in _FP8 for t in model.graph.initializer)


#: element types ONNX Runtime's (1.32) CPU provider has no Q/DQ kernels for (run such graphs with onnx's
#: ``ReferenceEvaluator``)
NO_ORT_KERNELS = {TensorProto.FLOAT4E2M1: "FLOAT4E2M1"}


def check_ort_types(model: onnx.ModelProto) -> None:
    """ValueError when an initializer of ``model`` has an element type ORT's CPU provider cannot run (FP4 E2M1
    codes or zero points), naming it, instead of ORT's "Could not find an implementation" at session creation."""
    bad = sorted({NO_ORT_KERNELS[t.data_type] for t in model.graph.initializer if t.data_type in NO_ORT_KERNELS})
    if bad:
        raise ValueError(
            f"ONNX Runtime's CPU provider has no QuantizeLinear/DequantizeLinear kernels for {', '.join(bad)} "
            "(opset 23 types): run this model with onnx.reference.ReferenceEvaluator"
        )


def has_signed_int8_weights(model: onnx.ModelProto) -> bool:
    """True when a DequantizeLinear reads a signed INT8 initializer (a TensorRT-style weight)."""
    int8 = {t.name for t in model.graph.initializer if t.data_type == TensorProto.INT8}
    return any(n.op_type == "DequantizeLinear" and n.input[0] in int8 for n in model.graph.node)


def has_blocked_weights(model: onnx.ModelProto) -> bool:
    """True when a DequantizeLinear has a ``block_size`` (blocked weights, which ORT fuses into MatMulNBits)."""
    return any(
        n.op_type == "DequantizeLinear" and any(a.name == "block_size" and a.i for a in n.attribute)
        for n in model.graph.node
    )


def has_uint8_activations(model: onnx.ModelProto) -> bool:
    """True when a QuantizeLinear writes uint8 (the ``target="onnxruntime"`` layout, or an unsigned quantizer)."""
    u8 = {t.name for t in model.graph.initializer if t.data_type == TensorProto.UINT8}
    return any(n.op_type == "QuantizeLinear" and len(n.input) > 2 and n.input[2] in u8 for n in model.graph.node)


def ort_session(
    path_or_model,
    *,
    threads: int | None = None,
    spinning: bool = True,
    optimize: bool = True,
    exact: bool = True,
    optimized_model_path: str | None = None,
):
    """An ``onnxruntime.InferenceSession`` on the CPU provider with the options above.

    Args:
        path_or_model: an ONNX file path or ModelProto.
        threads: intra-op threads (None: ORT's default).
        spinning: allow intra-op thread spinning (ORT's default True).
        optimize: False disables every graph optimization (the plain reference semantics of each node).
        exact: turn off the QDQ fusions that saturate on signed INT8 weights or quantize the activations of
            blocked-weight MatMuls (see above).
        optimized_model_path: write ORT's optimized graph there (to check which fusions happened).
    """
    import onnxruntime as ort

    model = path_or_model if isinstance(path_or_model, onnx.ModelProto) else onnx.load(os.fspath(path_or_model))
    check_ort_types(model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads is not None:
        so.intra_op_num_threads = threads
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    disabled = []
    if has_fp8(model):
        so.add_session_config_entry("session.disable_quant_qdq", "1")
        disabled.append("ReluQuantRewrite")
    elif exact and has_blocked_weights(model):
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    elif (
        exact
        and has_signed_int8_weights(model)
        and not (has_uint8_activations(model) and (host_has_vnni() or not wide_int8_weights(model)))
    ):
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    if optimized_model_path is not None:
        so.optimized_model_filepath = os.fspath(optimized_model_path)
    return ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"], disabled_optimizers=disabled or None
    )
