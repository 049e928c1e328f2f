"""mx_elem.h's division of a float16 / bfloat16 element through its scale's reciprocal (``fdiv_rcp``: the CUDA
NVFP4 and fused dynamic-block kernels; ``fdiv_rcp_clamped``: the elementwise E4M3 / E5M2 / E2M1 and static-block
kernels) against true division, bit for bit, with the element formats applied (tests/cuda_host/rcp_div_check.cpp):
every 16-bit significand against every 61st divisor significand (140M checks) plus every 16-bit value across the
divisor's range, a few seconds; ``MODELOPT_LITE_EXHAUSTIVE=1`` takes every divisor significand (all 2**33 pairs,
about a minute)."""

from __future__ import annotations

import os

import host_checker
import pytest


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return host_checker.build(tmp_path_factory, "rcp_div_check.cpp")


def test_reciprocal_division_matches_true_division(checker):
    step = 1 if os.environ.get("MODELOPT_LITE_EXHAUSTIVE") == "1" else 61
    checked = host_checker.run(checker, step)
    significand_pairs = ((2**23 - 1) // step + 1) * 2**10
    # the range parts' counts are fixed by their loops: 2 x 65536 inputs x 85 exponents x 8 (4) significands, less
    # the inputs and pairs each leaves out, each checked for the quotient and 5 formats
    assert checked - significand_pairs == 6 * (45_010_030 + 41_335_812), checked
