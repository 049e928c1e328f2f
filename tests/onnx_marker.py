"""Which test modules use onnx or onnxruntime: tests/conftest.py marks their tests ``onnx`` (``pytest -m onnx``),
and .ci/run runs them again with the oldest supported onnx and onnxruntime. No onnx import here."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ONNX_MODULES = ("onnx", "onnxruntime", "onnx_helpers", "modelopt_lite.onnx_export")
ONNX_CALLS = {"export_onnx", "inspect_onnx", "compare_with_onnxruntime", "ort_session"}


@functools.cache
def uses_onnx(path: Path) -> bool:
    """True when a test module imports onnx, onnxruntime or the ONNX export (anywhere in it, importorskip
    included) or calls the export by attribute (``mtq.export_onnx``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args:
            names += [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.Attribute) and node.attr in ONNX_CALLS:
            return True
    return any(n == m or n.startswith(m + ".") for n in names for m in ONNX_MODULES)
