"""The NVFP4 / MX / E5M2 / E2M1 CUDA kernels equal the CPU reference bit for bit, forward and backward.

Run on a machine with a GPU (skipped otherwise, see conftest.py); the matrix is in mx_cases.py, and the
host-emulated binding test runs the same matrix on the CPU.
"""

from __future__ import annotations

import mx_cases
import mx_error_cases
import pytest
import variant_cases
from isolated_cases import run_isolated

from modelopt_lite.functional import backend


@pytest.mark.parametrize("group", list(mx_cases.GROUPS))
def test_matrix_equals_reference(cuda_module, group):
    failures = []
    for check in mx_cases.GROUPS[group]():
        try:
            mx_cases.run_check(cuda_module, "cuda", check)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_gradients_through_the_public_ops_equal_reference(cuda_module):
    def native(check):
        with backend.use_backend("native"):
            return check.run("cuda")

    failures = mx_cases.grad_failures(native)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("function", ["error_cases", "value_error_cases"])
def test_errors_are_raised_on_the_host(cuda_module, function):
    """Bad arguments and NaN/Inf inputs raise ValueError / TypeError, each case in a child process."""
    total, failures = run_isolated("mx_error_cases", function, "cuda")
    assert total == len(getattr(mx_error_cases, function)("cpu"))
    assert not failures, f"{len(failures)} of {total} cases failed:\n" + "\n".join(failures)


def test_flagged_bindings_return_the_flag_unread(cuda_module):
    failures = mx_error_cases.flagged_failures(cuda_module, "cuda")
    assert not failures, "\n".join(failures)


def test_every_variant_equals_reference(cuda_module):
    assert cuda_module.mx_set_variant(-1) == variant_cases.DEFAULT_VARIANT
    failures = variant_cases.variant_failures(cuda_module, "cuda")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
