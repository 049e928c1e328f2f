"""tests/onnx_helpers.py: hand-made models load in the installed onnxruntime (and in older releases, by its table)."""

from __future__ import annotations

import pathlib

import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
import onnx_helpers
from onnx import TensorProto, helper
from onnx_helpers import ORT_LIMITS, make_model, ort_limits
from onnx_marker import uses_onnx

from modelopt_lite.onnx_export.export import min_ir_version


def _identity():
    return helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )


def _loads(model) -> bool:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - ORT raises its own exception types (InvalidGraph, Fail, ...)
        return False
    return True


def test_helper_models_load_in_the_installed_onnxruntime():
    max_ir, max_opset = ort_limits()
    for opset in range(13, max_opset + 1):
        model = make_model(_identity(), opset)
        assert model.ir_version == min_ir_version(model.opset_import) <= max_ir, opset
        assert [(o.domain, o.version) for o in model.opset_import] == [("", opset)]
        assert _loads(model), f"onnxruntime {ort.__version__} refused a helper model of opset {opset}"


def test_the_table_row_of_the_installed_onnxruntime_is_right():
    max_ir, max_opset = ort_limits()
    at_limit = helper.make_model(_identity(), opset_imports=[helper.make_opsetid("", 13)])
    at_limit.ir_version = max_ir
    assert _loads(at_limit)
    assert _loads(make_model(_identity(), max_opset))
    major, minor = (int(v) for v in ort.__version__.split(".")[:2])
    if (major, minor) in ORT_LIMITS:  # a measured release: one IR version more is refused
        at_limit.ir_version = max_ir + 1
        assert not _loads(at_limit)


def test_an_older_onnxruntime_gets_models_it_accepts(monkeypatch):
    """onnxruntime 1.30 refuses IR 14 ("max supported IR version: 13"), which onnx 1.23's helper.make_model stamps."""
    monkeypatch.setattr(onnx_helpers, "ort_version", lambda: (1, 30))
    assert ort_limits() == (13, 26) and ort_limits((1, 24)) == (13, 25) and ort_limits((1, 20)) == (10, 21)
    for opset in (13, 17, 19, 21, 23):
        assert make_model(_identity(), opset).ir_version <= 13
    monkeypatch.setattr(onnx_helpers, "ort_version", lambda: (1, 20))
    assert make_model(_identity(), 21).ir_version == 10
    with pytest.raises(pytest.skip.Exception, match=r"loads opsets <= 21 \(IR <= 10\); this model needs opset 23"):
        make_model(_identity(), 23)
    assert make_model(_identity(), 23, ort=False).ir_version == 11  # for onnx's ReferenceEvaluator only
    with pytest.raises(ValueError, match=r"onnxruntime 1\.17 is older than every release in ORT_LIMITS"):
        ort_limits((1, 17))


def test_no_test_builds_a_model_with_onnx_helper_make_model():
    """Every hand-made model goes through onnx_helpers.make_model (helper.make_model stamps the newest IR)."""
    here = pathlib.Path(__file__).parent
    offenders = [
        f"{p.relative_to(here)}:{i}"
        for p in sorted(here.rglob("*.py"))
        if p.name not in ("onnx_helpers.py", "test_onnx_helpers.py")
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if "helper.make_model(" in line or "make_model_gen_version(" in line
    ]
    assert offenders == []


def test_the_onnx_marker_selects_the_modules_that_use_onnx():
    """.ci/run reruns ``-m onnx`` with the oldest onnx/onnxruntime: the marker must reach every such module."""
    here = pathlib.Path(__file__).parent
    for name in ("test_onnx_contract.py", "test_ort_layout.py", "test_integer_requant.py", "test_cli.py"):
        assert uses_onnx(here / name), name
    assert not uses_onnx(here / "test_descriptor.py") and not uses_onnx(here / "test_calib_max.py")
