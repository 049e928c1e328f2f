"""The README's promises: its first two lines are the two commands (the second is CI's), and every Python block
in it runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAIN_COMMAND = 'python3 -m pip install torch==2.13.0 -e ".[dev,demo]" && modelopt-lite demo'
TEST_COMMAND = "python3 -m pytest -q -x tests"


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)


def test_readme_opens_with_the_two_commands():
    lines = README.splitlines()
    assert lines[0] == MAIN_COMMAND
    assert lines[1] == TEST_COMMAND
    assert lines[2] == ""


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert TEST_COMMAND in [ln.strip() for ln in ci]


def test_readme_mentions_only_commands_that_exist():
    from modelopt_lite.cli import _build_parser

    sub = next(a for a in _build_parser()._actions if a.dest == "command")
    used = set(re.findall(r"modelopt-lite (\w+)", README))
    assert used <= set(sub.choices), used - set(sub.choices)
    assert {"demo", "quantize", "inspect", "precompile"} <= used


def test_python_blocks_are_found():
    blocks = python_blocks(README)
    assert len(blocks) >= 8
    assert "DEMO_OUTPUT_PLACEHOLDER" not in README


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the tour writes ONNX and checkpoint files into the working directory
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks(README)):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # noqa: BLE001  (name the block that failed)
            pytest.fail(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n---\n{block}")
    assert (tmp_path / "digits_int8.onnx").is_file()
    assert "QuantizeLinear INT8 per-tensor" in capsys.readouterr().out


def test_readme_states_the_version_floors_of_pyproject():
    """The README's supported ranges are pyproject.toml's floors (torch, numpy, onnx, onnxruntime), and .ci/run
    runs the ONNX tests with the onnx/onnxruntime floors."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    floors = dict(re.findall(r'"(torch|numpy|onnx|onnxruntime)>=([0-9.]+)"', pyproject))
    assert sorted(floors) == ["numpy", "onnx", "onnxruntime", "torch"], floors
    section = README[README.index("## Supported versions") :].split("\n## ", 1)[0]
    for name, version in floors.items():
        assert f"`{name}>={version}`" in section, (name, version)
    assert "pytest -q -n auto -m onnx tests" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
