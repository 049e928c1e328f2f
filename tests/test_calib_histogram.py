"""HistogramCalibrator: anchors' behaviour, exact int64 counts, split invariance, vectorized == loop references."""

import math

import pytest
import torch
from calib_loops import entropy_loop, mse_loop, percentile_loop

from modelopt_lite.calib import HistogramCalibrator
from modelopt_lite.calib.grid import E_MIN, needed_exp
from modelopt_lite.calib.quant_error import ErrorIntegral
from modelopt_lite.functional import reference

METHODS = [("percentile", {"percentile": 99.9}), ("mse", {}), ("entropy", {})]


def _hist(xs, **kw):
    cal = HistogramCalibrator(**{"num_bits": 8, **kw})
    for x in xs:
        cal.collect(x)
    return cal


# ----------------------------------------------------------------------------------------------- anchors (1e)
def test_percentile_arange():
    cal = _hist([torch.arange(100)])
    amax = cal.compute_amax("percentile", percentile=90)
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert abs(float(amax) - 89.0) < 100 / 1024
    assert float(amax) == 89.0  # values on the grid: the left-edge convention is exact
    assert float(cal.compute_amax()) == 99.0  # default percentile 99.99 -> the bin of the max


def test_percentile_unsigned_arange():
    amax = _hist([torch.arange(100)], unsigned=True).compute_amax("percentile", percentile=80)
    assert abs(float(amax) - 79.0) < 100 / 2048


def test_percentile_two_tensors():
    amax = _hist([torch.arange(100), torch.arange(0, 50, 0.5)]).compute_amax("percentile", percentile=99)
    assert abs(float(amax) - 97.0) < 100 / 1024


def test_percentile_out_of_range():
    cal = _hist([torch.arange(100)])
    for p in (-10, 0, 200, 100.0001, float("nan")):
        with pytest.raises(ValueError, match="out of range"):
            cal.compute_amax("percentile", percentile=p)
    assert float(cal.compute_amax("percentile", percentile=100)) == 99.0
    with pytest.raises(TypeError, match="percentile must be a number"):
        cal.compute_amax("percentile", percentile="99")


@pytest.mark.parametrize("unsigned", [False, True])
def test_entropy_rejects_outlier(unsigned):
    torch.manual_seed(12345)
    x = torch.rand(11, 7, 3, 3)
    x[1, 1, 1, 1] = 10.0
    amax = _hist([x], unsigned=unsigned).compute_amax("entropy")
    assert float(amax) < 1.1


def test_entropy_rejects_outlier_two_tensors():
    torch.manual_seed(7)
    x = torch.rand(11, 7, 3, 3)
    x[1, 1, 1, 1] = 10.0
    assert float(_hist([x, torch.rand(11, 7, 3, 3)]).compute_amax("entropy")) < 1.1


@pytest.mark.parametrize("bulk,outlier,unsigned", [(255.0, 256.0, False), (512.0, 513.0, True)])
def test_mse_prefers_bulk(bulk, outlier, unsigned):
    x = torch.full((11, 7, 3, 3), bulk)
    x[1, 1, 1, 1] = outlier
    amax = float(_hist([x], unsigned=unsigned).compute_amax("mse"))
    assert abs(amax - bulk) < abs(amax - outlier)
    amax2 = float(_hist([x, torch.full((11, 7, 3, 3), bulk)], unsigned=unsigned).compute_amax("mse"))
    assert abs(amax2 - bulk) < abs(amax2 - outlier)


def test_skip_zeros():
    x = torch.cat([torch.zeros(1000), torch.arange(1.0, 11.0)])
    cal = _hist([x], skip_zeros=True)
    assert cal.num_collected == 10 and int(cal.counts.sum()) == 10 and int(cal.counts[0]) == 0
    assert float(cal.compute_amax("percentile", percentile=50)) == 5.0
    assert float(_hist([x]).compute_amax("percentile", percentile=50)) == 0.0  # zeros dominate otherwise
    cal = _hist([torch.zeros(10)], skip_zeros=True)
    assert float(cal.compute_amax()) == 0.0


# -------------------------------------------------------------------------------- exact counts, invariance
def test_counts_above_2_pow_24_are_exact():
    n = 2**24 + 3
    x = torch.tensor([0.75]).expand(n)  # one bin receives more than 2**24 values in one batch
    cal = _hist([x, torch.tensor([1.0, 0.25])])
    counts = cal.counts
    assert counts.dtype == torch.int64
    width = cal.bin_width
    assert int(counts[int(0.75 / width)]) == n and int(counts.sum()) == n + 2
    cal.collect(x)
    assert int(cal.counts[int(0.75 / width)]) == 2 * n  # float32 would be stuck at 2**24 / 2**25
    assert float(cal.compute_amax("percentile", percentile=100)) == 1.0
    assert float(cal.compute_amax("percentile", percentile=99.99)) == 0.75


def _random_split(x, rng, first_small):
    x = x.flatten()
    if first_small:  # the first batch only holds the smallest values: the range must grow a lot later
        x = x[torch.argsort(x.abs())]
        k = int(torch.randint(1, 20, (1,), generator=rng))
        head, x = x[:k], x[k:][torch.randperm(x.numel() - k, generator=rng)]
    else:
        x = x[torch.randperm(x.numel(), generator=rng)]
        head = None
    cuts = sorted(torch.randint(0, x.numel(), (int(torch.randint(1, 8, (1,), generator=rng)),), generator=rng).tolist())
    parts = [x[a:b] for a, b in zip([0, *cuts], [*cuts, x.numel()])]
    return ([head] if head is not None else []) + parts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("unsigned", [False, True])
def test_split_invariance(seed, unsigned):
    rng = torch.Generator().manual_seed(seed)
    x = torch.randn(4000, generator=rng) * torch.exp(torch.randn(4000, generator=rng))
    x[::97] = 0.0
    if unsigned:
        x = x.abs()
    whole = _hist([x], unsigned=unsigned, num_bins=512)
    ref_amax = {m: whole.compute_amax(m, **kw) for m, kw in METHODS}
    for first_small in (False, True):
        cal = _hist(_random_split(x, rng, first_small), unsigned=unsigned, num_bins=512)
        assert torch.equal(cal.counts, whole.counts)
        assert cal.bin_width == whole.bin_width
        for m, kw in METHODS:
            assert torch.equal(cal.compute_amax(m, **kw), ref_amax[m]), m


def test_growth_from_tiny_first_batch():
    x = torch.linspace(-3.0, 5.0, 1001)
    cal = _hist([torch.zeros(3), torch.tensor([1e-30]), x[:10], x[10:]], num_bins=256)
    ref = _hist([x, torch.zeros(3), torch.tensor([1e-30])], num_bins=256)
    assert torch.equal(cal.counts, ref.counts)
    assert cal.bin_width == 2.0**-5  # 256 * 2**-5 = 8 > 5 >= 4
    for m, kw in METHODS:
        assert torch.equal(cal.compute_amax(m, **kw), ref.compute_amax(m, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_collect_never_mutates_input(dtype):
    torch.manual_seed(4)
    x = torch.randn(16, 33).to(dtype)
    x[3, 4] = float("nan")
    keep = x.clone()
    for axis in (None, 0, (0, 1)):
        cal = HistogramCalibrator(8, axis=axis, skip_zeros=True, skip_nonfinite=True)
        cal.collect(x)
        cal.collect(x.t().contiguous().t())  # a non-contiguous tensor of the same shape
        assert torch.equal(x.isnan(), keep.isnan()) and torch.equal(x.nan_to_num(), keep.nan_to_num())
        assert cal.num_nonfinite == 2


def test_needed_exp_is_minimal():
    cap = 2048
    vals = torch.tensor([0.0, 1e-45, 1e-38, 2.0**-30, 1.0, 2048.0, 2047.9, 99.0, 3.4e38], dtype=torch.float64)
    e = needed_exp(vals, cap)
    for v, ev in zip(vals.tolist(), e.tolist()):
        if v == 0:
            assert ev == E_MIN
            continue
        assert cap * 2.0**ev > v and (ev == E_MIN or cap * 2.0 ** (ev - 1) <= v)
    assert needed_exp(torch.tensor([2048.0]), 2048).item() == 1  # strict: 2048 * 2**0 is not > 2048


def test_fp16_input_same_histogram_as_fp32():
    x = torch.randn(1000).half()
    a, b = _hist([x]), _hist([x.float()])
    assert torch.equal(a.counts, b.counts) and a.bin_width == b.bin_width


def test_nonfinite_skipped():
    torch.manual_seed(0)
    x = torch.randn(6, 50)
    y = x.clone()
    y[0, 3], y[2, 7], y[5, 0] = float("nan"), float("inf"), -float("inf")
    for axis in (None, 0):
        cal = _hist([y], axis=axis, skip_nonfinite=True)
        keep = torch.isfinite(y)
        assert cal.num_nonfinite == 3
        if axis is None:
            ref = _hist([y[keep]])
            assert torch.equal(cal.counts, ref.counts)
        else:
            for c in range(6):
                ref = _hist([y[c][keep[c]]])
                assert torch.equal(cal.counts[c], ref.counts)
    with pytest.raises(ValueError, match="1 NaN and 2 Inf"):
        _hist([y])


def test_unsigned_rejects_negative_and_e4m3_entropy():
    with pytest.raises(ValueError, match="negative values"):
        _hist([torch.tensor([-1.0, 2.0])], unsigned=True)
    cal = _hist([torch.randn(500)], num_bits=(4, 3))
    assert cal.compute_amax("mse").shape == ()
    with pytest.raises(ValueError, match=r"not defined for num_bits=\(4, 3\)"):
        cal.compute_amax("entropy")


def test_compute_amax_signature_errors():
    cal = _hist([torch.randn(100)], name="enc.input_quantizer")
    # the peers' signature: every method takes stride/start_bin/percentile and ignores those it does not use
    assert torch.equal(cal.compute_amax(start_bin=3), cal.compute_amax("percentile"))
    assert torch.equal(cal.compute_amax("mse", percentile=99.0), cal.compute_amax("mse"))
    with pytest.raises(TypeError, match=r"'enc.input_quantizer'.*method='entropy'.*foo.*stride, start_bin"):
        cal.compute_amax("entropy", foo=1)
    for exc in (ValueError, TypeError):  # ours raise ValueError, the peers TypeError: it is both
        with pytest.raises(exc, match="unknown method 'max'"):
            cal.compute_amax("max")
    with pytest.raises(ValueError, match="stride must be >= 1"):
        cal.compute_amax("mse", stride=0)
    with pytest.raises(TypeError, match="start_bin must be an int"):
        cal.compute_amax("mse", start_bin=1.5)
    with pytest.raises(ValueError, match="start_bin must be >= 1 for entropy"):
        cal.compute_amax("entropy", start_bin=0)
    with pytest.raises(ValueError, match="start_bin=200 leaves no candidate"):
        _hist([torch.randn(100)], num_bins=128).compute_amax("mse", start_bin=200)
    with pytest.raises(ValueError, match="grow_method='grow'"):
        HistogramCalibrator(8, grow_method="grow")
    with pytest.raises(TypeError, match="torch_hist must be a bool"):
        HistogramCalibrator(8, torch_hist=1)
    with pytest.raises(ValueError, match="num_bins must be >= 2"):
        HistogramCalibrator(8, num_bins=1)
    assert HistogramCalibrator(8).compute_amax("entropy") is None


def test_compute_amax_does_not_change_state_and_reset():
    torch.manual_seed(3)
    cal = _hist([torch.randn(2000)])
    before = cal.counts
    a = [cal.compute_amax(m, **kw) for m, kw in METHODS]
    b = [cal.compute_amax(m, **kw) for m, kw in METHODS]
    assert torch.equal(cal.counts, before) and all(torch.equal(u, v) for u, v in zip(a, b))
    cal.reset()
    assert cal.counts is None and cal.compute_amax() is None and cal.num_collected == 0


def test_repr():
    cal = HistogramCalibrator(8, name="q")
    assert repr(cal) == (
        "HistogramCalibrator(name='q', num_bits=8, axis=None, unsigned=False, num_bins=2048, "
        "skip_zeros=False, skip_nonfinite=False, collected=0)"
    )
    cal.collect(torch.arange(100.0))
    assert repr(cal).endswith("collected=100, bin_width=2**-4)")


# ------------------------------------------------------------------------------------------- per channel
@pytest.mark.parametrize("axis", [0, (0, 2), -1])
def test_per_channel_equals_channel_by_channel(axis):
    torch.manual_seed(11)
    w = torch.randn(6, 3, 5, 5) * torch.rand(6, 1, 1, 1) * 3
    w[2] = 0.0  # a dead channel
    w[4, 0, 0, 0] = 40.0  # an outlier
    cal = _hist([w], axis=axis, num_bins=256)
    keep = (axis,) if isinstance(axis, int) else axis
    keep = tuple(sorted(k % 4 for k in keep))
    rest = [d for d in range(4) if d not in keep]
    rows = w.permute(*keep, *rest).reshape(-1, math.prod(w.shape[d] for d in rest))
    shape = tuple(w.shape[d] if d in keep else 1 for d in range(4))
    for m, kw in METHODS:
        amax = cal.compute_amax(m, **kw)
        assert amax.shape == shape and amax.dtype == torch.float32
        ref = torch.stack([_hist([r], num_bins=256).compute_amax(m, **kw) for r in rows])
        assert torch.equal(amax.flatten(), ref), m
    if axis == 0:
        assert torch.all(cal.compute_amax("mse")[2] == 0)


# -------------------------------------------------------------------------------- vectorized == loops
def _datasets():
    g = torch.Generator().manual_seed(5)
    yield "normal", torch.randn(20000, generator=g), {}
    yield "laplace-ish", torch.randn(20000, generator=g) * torch.rand(20000, generator=g) ** 3, {}
    u = torch.rand(3000, generator=g)
    u[:3] = torch.tensor([9.0, 12.0, 30.0])
    yield "uniform+outliers", u, {}
    yield "sparse", torch.randint(0, 40, (500,), generator=g).float() ** 1.5, {}
    yield "relu-unsigned", torch.relu(torch.randn(20000, generator=g)), {"unsigned": True}
    yield "4-bit", torch.randn(5000, generator=g), {"num_bits": 4}
    yield "6-bit-unsigned", torch.rand(5000, generator=g) ** 2, {"num_bits": 6, "unsigned": True}


@pytest.mark.parametrize("name,x,kw", list(_datasets()), ids=[d[0] for d in _datasets()])
@pytest.mark.parametrize("start_bin,stride", [(128, 1), (50, 3)])
def test_vectorized_equals_loops(name, x, kw, start_bin, stride):
    cal = _hist([x], num_bins=512, **kw)
    counts, width = cal.counts, cal.bin_width
    nb, uns = kw.get("num_bits", 8), kw.get("unsigned", False)
    got = float(cal.compute_amax("mse", start_bin=start_bin, stride=stride))
    assert got == mse_loop(counts, width, start_bin, stride, nb, uns)
    got = float(cal.compute_amax("entropy", start_bin=start_bin, stride=stride))
    assert got == entropy_loop(counts, width, start_bin, stride, nb, uns)
    for p in (50.0, 99.0, 99.99, 100.0):
        assert float(cal.compute_amax("percentile", percentile=p)) == percentile_loop(counts, width, p)


def test_vectorized_equals_loop_e4m3_mse():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(10000, generator=g) * 3
    cal = _hist([x], num_bits=(4, 3), num_bins=512)
    assert float(cal.compute_amax("mse")) == mse_loop(cal.counts, cal.bin_width, 128, 1, (4, 3), False)


@pytest.mark.parametrize("num_bits,unsigned", [(8, False), (4, False), (4, True), ((4, 3), False)])
def test_error_integral_is_the_fake_quant_error(num_bits, unsigned):
    """The closed-form bin error == the mean of (fq(x) - x)**2 over many points of the bin (reference numerics)."""
    g = ErrorIntegral(num_bits, unsigned)
    bound = 448.0 if num_bits == (4, 3) else float(2 ** (num_bits - 1 + unsigned) - 1)
    pts = 4096
    for amax in (1.0, 3.3, 0.07):
        scale = torch.tensor(amax, dtype=torch.float32) / torch.tensor(bound, dtype=torch.float32)
        for lo, w in (
            (0.0, 0.02),
            (0.013, 0.004),
            (0.5 * amax, 0.01 * amax),
            (0.97 * amax, 0.2 * amax),
            (1.5 * amax, 0.05),
        ):
            x = (lo + (torch.arange(pts, dtype=torch.float64) + 0.5) * w / pts).float()
            if num_bits == (4, 3):
                fq = reference.fake_e4m3(x, scale)
            else:
                _, qmin, qmax = (0, 0, int(bound)) if unsigned else (0, -int(bound) - 1, int(bound))
                fq = reference.fake_quant_int(x, scale, qmin, qmax)
            sampled = float(((fq.double() - x.double()) ** 2).mean())
            s = float(scale)
            exact = float(
                (g(torch.tensor((lo + w) / s, dtype=torch.float64)) - g(torch.tensor(lo / s, dtype=torch.float64)))
                * s**3
                / w
            )
            assert exact == pytest.approx(sampled, rel=2e-3, abs=1e-12), (amax, lo, w)


def test_mse_has_no_center_aliasing():
    """N(0,1): bins of 2**-8 make the step amax/127 a multiple of the width near the optimum; fake-quantizing
    bin centers dips there (amax 3.967, +0.7% error). The integral follows the raw-data MSE optimum (~3.88)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500_000, generator=g)
    amax = float(_hist([x]).compute_amax("mse"))  # bin centers would give 3.967 here
    cands = torch.linspace(3.75, 4.05, 11)

    def raw(a):
        s = torch.tensor(a, dtype=torch.float32) / 127
        return float(((reference.fake_quant_int(x, s, -128, 127) - x) ** 2).double().mean())

    errs = [raw(float(a)) for a in cands]
    best = float(cands[min(range(len(errs)), key=errs.__getitem__)])
    assert abs(amax - best) < 0.03
    assert raw(amax) <= min(errs) * 1.0005


def test_percentile_vs_true_quantile():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100000, generator=g)
    cal = _hist([x])
    a = x.abs().sort().values
    for p in (90.0, 99.0, 99.9):
        q = float(a[math.ceil(p * a.numel() / 100) - 1])  # inverted-CDF quantile
        amax = float(cal.compute_amax("percentile", percentile=p))
        assert amax <= q < amax + cal.bin_width
