"""The output pool of every native CPU kernel (csrc/output_pool.h): the memory of a released large output is reused
for the next output of the same size, never while the caller still holds it, with exact results over stale data;
the limit (0: off) and release work. Every kernel (integer, affine, E4M3/E5M2/E2M1, NVFP4, MX; forward and backward)
draws from the same pool: tests/test_output_pool_kernels.py. No timing here (bench/bench_fake_quant.py measures it)."""

from __future__ import annotations

import pytest
import torch

from modelopt_lite.functional import microscaling as mx

MIB = 1 << 20


@pytest.fixture
def pool(native):
    """The native module with a fresh pool at its default limit, restored afterwards."""
    if not hasattr(native, "output_pool_stats"):
        pytest.fail("the native CPU module has no output pool functions")
    native.set_output_pool_limit(None)
    native.release_output_pool()
    yield native
    native.set_output_pool_limit(None)
    native.release_output_pool()


def _x(seed: int, shape=(1024, 1030), dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(dtype)


def test_released_output_memory_is_reused_with_exact_results(pool):
    a, b = _x(0), _x(1)  # 1024 x 1030 float32: 4 MiB + a partial last block per row
    gs = mx.nvfp4_global_scale(b.abs().amax())
    hits0 = pool.output_pool_stats()[3]
    y = pool.fake_mx(a, "e4m3", 32, "floor")
    ptr = y.data_ptr()
    del y
    held, blocks, limit, hits, _ = pool.output_pool_stats()
    assert (blocks, limit) == (1, 512 * MIB) and held >= a.numel() * 4 and held % (2 * MIB) == 0
    y = pool.fake_mx(b, "e2m1", 32, "rceil")  # over the stale values of a's output
    assert y.data_ptr() == ptr and pool.output_pool_stats()[3] == hits0 + 1
    assert torch.equal(y, mx.fake_mx(b, "e2m1", 32, "rceil"))
    del y
    y = pool.fake_nvfp4(b, gs, 16)
    assert y.data_ptr() == ptr and torch.equal(y, mx.fake_nvfp4(b, gs, 16))


def test_an_output_still_held_is_never_reused(pool):
    a, b = _x(2, dtype=torch.bfloat16, shape=(2048, 1056)), _x(3, dtype=torch.bfloat16, shape=(2048, 1056))
    y1 = pool.fake_mx(a, "int8", 32, "floor")
    keep = y1.clone()
    y2 = pool.fake_mx(b, "int8", 32, "floor")
    assert y1.data_ptr() != y2.data_ptr()
    assert torch.equal(y1, keep) and torch.equal(y2, mx.fake_mx(b, "int8", 32, "floor"))
    assert y2.dtype == torch.bfloat16 and pool.output_pool_stats()[1] == 0  # nothing released yet


def test_limit_zero_is_off_and_small_outputs_are_not_pooled(pool):
    x = _x(4)
    pool.set_output_pool_limit(0)
    y = pool.fake_mx(x, "e4m3", 32, "floor")
    del y
    assert pool.output_pool_stats()[:3] == (0, 0, 0)
    pool.set_output_pool_limit(None)
    small = _x(5, shape=(64, 256))  # 64 KiB: torch's allocator
    y = pool.fake_mx(small, "e4m3", 32, "floor")
    del y
    assert pool.output_pool_stats()[1] == 0
    pool.set_output_pool_limit(4)  # 4 MiB: a 6 MiB block is never kept
    y = pool.fake_mx(_x(6, shape=(1024, 1536)), "e4m3", 32, "floor")
    del y
    assert pool.output_pool_stats()[:3] == (0, 0, 4 * MIB)


def test_limit_trims_the_oldest_and_release_frees(pool):
    pool.set_output_pool_limit(12)
    y4, y6, y8 = (pool.fake_mx(_x(7, shape=(1024, 1024 + 512 * i)), "e4m3", 32, "floor") for i in range(3))
    assert [y.numel() * 4 for y in (y4, y6, y8)] == [4 * MIB, 6 * MIB, 8 * MIB]
    del y4, y6  # kept: 4 + 6 MiB
    assert pool.output_pool_stats()[:2] == (10 * MIB, 2)
    del y8  # trims the oldest blocks until it fits: both
    held, blocks, *_ = pool.output_pool_stats()
    assert (held, blocks) == (8 * MIB, 1)
    pool.release_output_pool()
    assert pool.output_pool_stats()[:2] == (0, 0)
    with pytest.raises(ValueError, match="output pool limit must be >= 0 MiB"):
        pool.set_output_pool_limit(-1)
