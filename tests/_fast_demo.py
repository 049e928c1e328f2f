"""One fast digits-demo run per test process, shared by test_demo.py and test_cli.py (the run is the slow part)."""

from __future__ import annotations

from pathlib import Path

# bound at import: test_cli.py monkeypatches modelopt_lite.demo.digits.run
from modelopt_lite.demo.digits import run as _run_digits

_CACHE: dict = {}


def fast_digits_result(base: Path):
    """``modelopt_lite.demo.digits.run(fast=True)`` under ``base`` (run once, then cached for the process)."""
    if "result" not in _CACHE:
        _CACHE["result"] = _run_digits(base / "out", fast=True, plots=False, progress=False, cache_dir=base / "cache")
    return _CACHE["result"]
