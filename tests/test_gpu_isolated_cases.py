"""tests/gpu/isolated_cases.py: a case that crashes its process is reported as that case's failure (with the
signal), and the cases after it still run; wrong or missing exceptions are failures too. No GPU needed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASES = """
import ctypes


def cases(device):
    assert device == "none"

    def ok(mod):
        raise ValueError("modelopt_lite CUDA kernels, f: qmin must be <= qmax, got qmin=8, qmax=7")

    def crash(mod):
        ctypes.string_at(0)  # SIGSEGV, as the first GPU run's error cases did

    def wrong_type(mod):
        raise RuntimeError("qmin must be <= qmax")

    def silent(mod):
        return None

    return [
        (ok, ValueError, "qmin must be <= qmax"),
        (crash, ValueError, "does not broadcast"),
        (wrong_type, ValueError, "qmin must be <= qmax"),
        (silent, ValueError, "cap must be >= 1"),
        (ok, ValueError, "wrong text"),
        (crash, ValueError, "does not match"),
    ]
"""


def _runner():
    spec = importlib.util.spec_from_file_location("isolated_cases", HERE / "gpu" / "isolated_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_crash_is_one_cases_failure_and_the_rest_still_run(tmp_path):
    path = tmp_path / "toy_cases.py"
    path.write_text(CASES)
    total, failures = _runner().run_isolated(str(path), "cases", "none", timeout_s=60)
    assert total == 6
    assert len(failures) == 5, failures
    f1, f2, f3, f4, f5 = failures
    assert f1.startswith("toy_cases.cases[1]: killed by SIGSEGV"), f1
    assert "Fatal Python error: Segmentation fault" in f1  # the child's faulthandler stack comes along
    assert f2.startswith("toy_cases.cases[2]: RuntimeError instead of ValueError"), f2
    assert f3 == "toy_cases.cases[3]: no exception raised", f3
    assert f4.startswith("toy_cases.cases[4]: ValueError without 'wrong text'"), f4
    assert f5.startswith("toy_cases.cases[5]: killed by SIGSEGV"), f5


def test_a_child_that_cannot_start_is_one_failure(tmp_path):
    path = tmp_path / "broken_cases.py"
    path.write_text("raise ImportError('no such kernels')\n")
    total, failures = _runner().run_isolated(str(path), "cases", "none", timeout_s=60)
    assert total == 0
    assert len(failures) == 1 and "before running a case" in failures[0] and "no such kernels" in failures[0]
    assert sys.executable  # the children run this interpreter
