"""Distributed calibration: 2 gloo ranks with different shards == 1 process with all shards, bit for bit."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks

from modelopt_lite.calib import HistogramCalibrator, MaxCalibrator

pytestmark = pytest.mark.slow  # the module fixture spawns two gloo ranks (several seconds)

WORLD = 2
HIST_METHODS = [("percentile", {"percentile": 99.9}), ("mse", {}), ("entropy", {}), ("entropy", {"stride": 3})]


def _shards():
    """Per-rank lists of batches; the ranks see very different ranges (rank 0 starts tiny)."""
    g = torch.Generator().manual_seed(123)
    r0 = [torch.randn(64, 8, generator=g) * 0.01, torch.randn(300, 8, generator=g), torch.zeros(5, 8)]
    r1 = [torch.randn(200, 8, generator=g) * 4.0, torch.rand(100, 8, generator=g) * 30.0]
    return [r0, r1]


def _calibrators():
    """name -> (factory, compute_amax calls); factories are called once per process."""
    cals = {
        "max": (lambda: MaxCalibrator(8), [("max", {})]),
        "max_axis": (lambda: MaxCalibrator(8, axis=1), [("max", {})]),
        "hist": (lambda: HistogramCalibrator(8, num_bins=512), HIST_METHODS),
        "hist_unsigned4": (lambda: HistogramCalibrator(4, unsigned=True, num_bins=256), HIST_METHODS),
        "hist_axis": (lambda: HistogramCalibrator(8, axis=-1, num_bins=256), HIST_METHODS),
    }
    return cals


def _run(cal, batches, calls):
    for b in batches:
        cal.collect(b.abs() if cal.unsigned else b)
    return [cal.compute_amax(m, **kw) for m, kw in calls]


def _worker(rank, port, outdir):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        torch.set_num_threads(1)
        shard = _shards()[rank]
        res = {}
        for name, (make, calls) in _calibrators().items():
            cal = make()
            res[name] = _run(cal, shard, calls)
            res[name + "_again"] = [cal.compute_amax(m, **kw) for m, kw in calls]  # no double counting
            empty = make()  # rank 1 collects nothing: neutral contribution
            res[name + "_rank0_only"] = _run(empty, shard if rank == 0 else [], calls)
        res["nobody"] = HistogramCalibrator(8).compute_amax()
        bad = HistogramCalibrator(8, axis=0)
        bad.collect(torch.ones(3 + rank, 2))
        try:
            bad.compute_amax()
            res["mismatch"] = None
        except ValueError as e:
            res["mismatch"] = str(e)
        torch.save(res, f"{outdir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    return run_ranks(_worker, out, WORLD, 180, "distributed calibration")


def _reference(name, shards):
    make, calls = _calibrators()[name]
    return _run(make(), [b for s in shards for b in s], calls)


@pytest.mark.parametrize("name", list(_calibrators()))
def test_ranks_match_single_process(rank_results, name):
    shards = _shards()
    ref = _reference(name, shards)
    ref0 = _reference(name, shards[:1])
    for res in rank_results:
        for key, want in ((name, ref), (name + "_again", ref), (name + "_rank0_only", ref0)):
            got = res[key]
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.dtype == torch.float32 and g.shape == w.shape
                assert torch.equal(g, w), (key, g, w)


def test_split_across_ranks_changes_nothing_but_is_not_trivial(rank_results):
    # a rank alone gets a different answer than the merged one (so the reduction really happened)
    shards = _shards()
    alone = _reference("hist", shards[1:])
    assert not all(torch.equal(a, b) for a, b in zip(alone, rank_results[1]["hist"]))


def test_nobody_collected_and_layout_mismatch(rank_results):
    for res in rank_results:
        assert res["nobody"] is None
        assert "ranks collected statistics of different layouts" in res["mismatch"]
