"""The fused block kernel (csrc/block_kernels.cu) equals the reference bit for bit on the GPU, forward and backward,
dynamic and with a static block amax, and the public fake_block_quant / block quantizers run it for CUDA tensors.

Skipped without a GPU (conftest.py); the matrix is block_cases.py, which the host-emulated test runs on the CPU.
"""

from __future__ import annotations

import math

import block_cases
import pytest
import torch

from modelopt_lite import tensor_quant as tq
from modelopt_lite.functional import backend, deferred_errors, library_block_cuda


@pytest.mark.parametrize("group", list(block_cases.GROUPS))
def test_matrix_equals_reference(cuda_module, group):
    failures = []
    for check in block_cases.GROUPS[group]():
        try:
            block_cases.run_check(cuda_module, "cuda", check)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_scale_from_amax_equals_reference(cuda_module):
    failures = block_cases.scale_failures(cuda_module, "cuda")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_every_variant_equals_reference(cuda_module):
    failures = block_cases.variant_failures(cuda_module, "cuda")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


def test_flags(cuda_module):
    failures = block_cases.flag_failures(cuda_module, "cuda")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_api_routes_to_the_fused_kernel(cuda_module, dtype):
    x0 = block_cases._data((64, 1024), dtype, 2)
    assert library_block_cuda.fused_dynamic_args(x0.cuda(), {-1: 128}, None, 4, False, False) is not None
    x = x0.cuda().requires_grad_()
    with backend.use_backend("native"):
        y = tq.fake_block_quant(x, {-1: 128}, None, 4)
        y.backward(block_cases._grad(y.detach().cpu()).cuda())
    xr = x0.clone().requires_grad_()
    with backend.use_backend("reference"):
        yr = tq.fake_block_quant(xr, {-1: 128}, None, 4)
        yr.backward(block_cases._grad(yr.detach()))
    assert torch.equal(y.cpu(), yr) and torch.equal(x.grad.cpu(), xr.grad)
    bad = x0.cuda().clone()
    bad[3, 700] = math.nan
    with backend.use_backend("native"):
        with deferred_errors.error_checks("sync"), pytest.raises(ValueError, match=r"NaN or Inf.*block \(3, 5\)"):
            tq.fake_block_quant(bad, {-1: 128}, None, 4)  # sync: raised at the call, naming the block
        with deferred_errors.error_checks("deferred"):
            tq.fake_block_quant(bad, {-1: 128}, None, 4)  # deferred: the flag is read asynchronously
            with pytest.raises(
                deferred_errors.DeferredValueError, match=r"NaN or Inf.*fake_block_dynamic on a 64x1024"
            ):
                deferred_errors.check_errors()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_public_api_routes_static_amax_to_the_fused_kernel(cuda_module, dtype):
    x0 = block_cases._data((64, 1024), dtype, 3)
    amax = block_cases.static_amax(x0, 128)
    assert library_block_cuda.fused_static_args(x0.cuda(), {-1: 128}, amax.cuda(), 4, False, False) is not None
    x = x0.cuda().requires_grad_()
    with backend.use_backend("native"):
        y = tq.fake_block_quant(x, {-1: 128}, amax.cuda(), 4)
        y.backward(block_cases._grad(y.detach().cpu()).cuda())
    xr = x0.clone().requires_grad_()
    with backend.use_backend("reference"):
        yr = tq.fake_block_quant(xr, {-1: 128}, amax, 4)
        yr.backward(block_cases._grad(yr.detach()))
    assert torch.equal(y.detach().cpu(), yr.detach()) and torch.equal(x.grad.cpu(), xr.grad)
    bad = amax.cuda()
    bad[5, 3] = -1.0
    with backend.use_backend("native"):
        with deferred_errors.error_checks("sync"), pytest.raises(ValueError, match=r"block amax must be .* got -1.0$"):
            tq.fake_block_quant(x0.cuda(), {-1: 128}, bad, 4)
        with deferred_errors.error_checks("deferred"):
            tq.fake_block_quant(x0.cuda(), {-1: 128}, bad, 4)
            with pytest.raises(
                deferred_errors.DeferredValueError, match=r"block amax must be finite.*block amax check"
            ):
                deferred_errors.check_errors()
