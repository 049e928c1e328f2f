"""mx_elem.h's E4M3 / E5M2 / E2M1 element rounding (the CPU scalar kernels' and every CUDA kernel's) against an
independent integer formulation, over every 31st float32 bit pattern (415M checks, a few seconds);
``MODELOPT_LITE_EXHAUSTIVE=1`` checks all 2**32 inputs of each format (about a minute)."""

from __future__ import annotations

import os

import host_checker
import pytest


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return host_checker.build(tmp_path_factory, "minifloat_round_check.cpp")


def test_minifloat_rounding_matches_integer_formulation(checker):
    step = 1 if os.environ.get("MODELOPT_LITE_EXHAUSTIVE") == "1" else 31
    assert host_checker.run(checker, step) == 3 * ((2**32 - 1) // step + 1)
