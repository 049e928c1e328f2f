"""Every lane position of the vector CPU kernels against the scalar ones and the reference, for each kernel set the
CPU has (the ``impl`` fixture: AVX-512, AVX2, scalar; a set the CPU lacks is skipped by name).

The AVX-512 kernels (csrc/quant_avx512.cpp) run a row's last n % 16 elements under a lane mask and the AVX2 ones
(quant_avx2.cpp) run the last n % 8 in scalar code; the block amax of both is an integer max of |x|'s bit patterns
over 4 accumulators. So every length from 0 to 80 (the main loop, the 4-accumulator loop, the tail), a NaN, an Inf,
a -0.0 and a dead (zero) scale at every lane, and blocks whose amax sits in every position."""

from __future__ import annotations

import pytest
import torch

from modelopt_lite.functional import library_block
from modelopt_lite.functional import reference as R

NAN, INF = float("nan"), float("inf")


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    gn, wn = got.isnan(), want.isnan()
    assert torch.equal(gn, wn), f"{what}: NaN positions differ"
    gb, wb = got.view(torch.int32)[~gn], want.view(torch.int32)[~wn]
    assert torch.equal(gb, wb), f"{what}: got {got[~gn][gb != wb].tolist()} want {want[~wn][gb != wb].tolist()}"


def _row(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("n", range(0, 81))
def test_every_length(native, impl, n):
    x = _row(n, n)
    per = torch.rand(n, generator=torch.Generator().manual_seed(100 + n)) * 0.2 + 0.01
    if n:
        per[n - 1] = 0.0  # a dead lane in the last step
    for s in (torch.tensor(0.3), per):
        for lo, hi in ((-8, 7), (0, 255)):
            _same(native.fake_quant_int(x, s, lo, hi), R.fake_quant_int(x, s, lo, hi), f"int n={n}")
            _same(native.quantize_int(x, s, lo, hi), R.quantize_int(x, s, lo, hi), f"codes n={n}")
            y, m = native.fake_quant_int_min(x, s, lo, hi)
            _same(y, R.fake_quant_int(x, s, lo, hi), f"int+min n={n}")
            assert m == (x.min().item() if n else INF), (n, m)
        _same(native.fake_e4m3(x, s), R.fake_e4m3(x, s), f"e4m3 n={n}")


@pytest.mark.parametrize("n", [5, 16, 23, 64, 77])
def test_special_value_at_every_lane(native, impl, n):
    s = torch.tensor(0.25)
    for i in range(n):
        for v in (NAN, INF, -INF, -0.0, 1e30):
            x = _row(n, i)
            x[i] = v
            _same(native.fake_quant_int(x, s, -128, 127), R.fake_quant_int(x, s, -128, 127), f"int {v} at {i}/{n}")
            _same(native.fake_e4m3(x, s), R.fake_e4m3(x, s), f"e4m3 {v} at {i}/{n}")
            _, m = native.fake_quant_int_min(x, s, 0, 255)
            want = x.min().item()
            assert (m != m) if v != v else m == want, (v, i, n, m, want)
        per = torch.full((n,), 0.25)
        per[i] = 0.0
        x = _row(n, i)
        _same(native.fake_quant_int(x, per, -8, 7), R.fake_quant_int(x, per, -8, 7), f"dead lane {i}/{n}")
        _same(native.fake_e4m3(x, per), R.fake_e4m3(x, per), f"e4m3 dead lane {i}/{n}")


@pytest.mark.parametrize("block", [8, 16, 24, 32, 80, 128])
def test_block_amax_at_every_position(native, impl, block):
    """Dynamic block fake quant: the block maximum (or a NaN/Inf, which must be reported) at each position."""
    cols = 2 * block + block // 2 + 3  # two whole blocks and a partial one
    for i in range(0, cols, 3 if block > 32 else 1):
        x = _row(cols, i).reshape(1, cols)
        x[0, i] = -50.0  # the block's amax, negative
        y, s, bad = native.fake_block_last(x, None, block, 0, 7.0, -8, 7)
        ry, rs = library_block._reference(x, None, block, 0, 7.0, -8, 7)
        assert bad is False
        _same(y, ry, f"y, amax at {i}, block {block}")
        _same(s, rs, f"scales, amax at {i}, block {block}")
        for v in (NAN, INF):
            x[0, i] = v
            assert native.fake_block_last(x, None, block, 0, 7.0, -8, 7)[2] is True, (v, i, block)
