"""Hand-built ONNX models for the tests, stamped so that the installed onnxruntime loads them.

``onnx.helper.make_model`` stamps the newest IR version of the installed onnx (IR 14 with onnx 1.23), which older
onnxruntime releases refuse ("Unsupported model IR version: 14, max supported IR version: 13" with 1.30).
:func:`make_model` stamps the lowest IR version that holds the model's opset instead, the exporter's own rule
(:func:`modelopt_lite.onnx_export.export.min_ir_version`), and, for a model meant for onnxruntime, skips with a reason
naming both versions when the installed release cannot load that opset. Every hand-made model of the suite is built
here (``tests/test_onnx_helpers.py`` checks that no test calls ``helper.make_model`` itself).
"""

from __future__ import annotations

import pytest
from onnx import helper

from modelopt_lite.onnx_export.export import min_ir_version

#: onnxruntime release -> (newest IR version, newest ai.onnx opset) its CPU session loads, measured by loading a
#: one-node model stamped with each IR version and opset in each release (1.18.1 ... 1.32.0); a release between two
#: rows is given the older row (support only grows). test_onnx_helpers.py checks the row against the installed one.
ORT_LIMITS: dict[tuple[int, int], tuple[int, int]] = {
    (1, 18): (10, 21),  # 1.18 - 1.20
    (1, 21): (10, 22),  # 1.21 - 1.22
    (1, 23): (11, 23),
    (1, 24): (13, 25),
    (1, 25): (13, 26),  # 1.25 - 1.31
    (1, 32): (14, 28),
}


def ort_version() -> tuple[int, int]:
    """(major, minor) of the installed onnxruntime."""
    import onnxruntime

    major, minor = onnxruntime.__version__.split(".")[:2]
    return int(major), int(minor)


def ort_limits(version: tuple[int, int] | None = None) -> tuple[int, int]:
    """(newest IR version, newest opset) that onnxruntime ``version`` (default: the installed one) loads."""
    version = ort_version() if version is None else version
    known = [v for v in ORT_LIMITS if v <= version]
    if not known:
        raise ValueError(f"onnxruntime {version[0]}.{version[1]} is older than every release in ORT_LIMITS")
    return ORT_LIMITS[max(known)]


def make_model(graph, opset: int, *, ort: bool = True, **kwargs):
    """``onnx.helper.make_model`` with one ai.onnx opset import and the lowest IR version that holds it.

    ``ort=True`` (a model the test runs in onnxruntime): skip, naming the versions, when the installed onnxruntime
    cannot load that opset. ``ort=False``: a model only for onnx itself (checker, ReferenceEvaluator, graph code).
    """
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kwargs)
    model.ir_version = min_ir_version(model.opset_import)
    if ort:
        max_ir, max_opset = ort_limits()
        if opset > max_opset or model.ir_version > max_ir:
            import onnxruntime

            pytest.skip(
                f"onnxruntime {onnxruntime.__version__} loads opsets <= {max_opset} (IR <= {max_ir}); "
                f"this model needs opset {opset} (IR {model.ir_version})"
            )
    return model


def gemm_weight(m):
    """``(gemm, w_name, producers)`` of an exported one-layer model: its first Gemm/MatMul node, the name of the
    tensor its weight input comes from once Transposes are skipped, and ``{output name: producing node}``."""
    gemm = next(n for n in m.graph.node if n.op_type in ("Gemm", "MatMul"))
    prod = {o: n for n in m.graph.node for o in n.output}
    w_name = gemm.input[1]
    while prod[w_name].op_type == "Transpose":
        w_name = prod[w_name].input[0]
    return gemm, w_name, prod
