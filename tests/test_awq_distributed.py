"""AWQ under torch.distributed: 2 gloo ranks that split the calibration data == 1 process with all of it."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from test_awq_memory import Toy
from test_awq_memory import _batches as _toy_batches
from torch import nn

pytestmark = pytest.mark.slow  # spawns two gloo ranks (several seconds)

WORLD = 2


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
    with torch.no_grad():
        m[0].weight.uniform_(0.2, 3.0)
    return m


def _batches():
    g = torch.Generator().manual_seed(5)
    col = torch.rand(64, generator=g) * 2 + 0.1
    col[7] *= 25
    return [torch.randn(3, 9, 64, generator=g) * col for _ in range(6)]


def _toy():
    return _toy_batches(n=7, seed=6)[:6]  # six batches of two sequences


def _cfg():
    return {
        "quant_cfg": {
            "default": {"enable": False},
            "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 16}, "axis": None, "enable": True},
        },
        "algorithm": {"method": "awq_full", "progress": False, "debug": True},
    }


def _run(batches, toy_batches):
    import modelopt_lite as mtq

    def loop(m):
        for x in batches:
            m(x)

    q = mtq.quantize(_model(), _cfg(), loop)
    out = {"state": {k: v.detach().clone() for k, v in q.state_dict().items()}}
    out["alpha"] = [q[i].awq_lite.best_alpha for i in (1, 3)]
    # a ModuleList of transformer blocks: the ranks replay their own recorded block inputs, block by block
    torch.manual_seed(0)
    t = mtq.quantize(Toy(), _cfg(), lambda m: [m(x) for x in toy_batches])
    out["toy"] = {k: v.detach().clone() for k, v in t.state_dict().items()}
    out["alpha"] += [getattr(t.layers[i], n).awq_lite.best_alpha for i in range(3) for n in ("q", "o", "up", "down")]
    return out


def _worker(rank, port, outdir):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        torch.set_num_threads(1)
        batches = _batches()
        toy = _toy()
        part = (batches[:2], toy[:2]) if rank == 0 else (batches[2:], toy[2:])
        torch.save(_run(*part), f"{outdir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_process(tmp_path):
    ranks = run_ranks(_worker, tmp_path, WORLD, 240, "AWQ distributed")
    ref = _run(_batches(), _toy())
    alone = _run(_batches()[:2], _toy()[:2])  # what rank 0 would get without the reduction: must differ
    assert ref["alpha"] != alone["alpha"] or any(
        not torch.equal(ref["state"][k], alone["state"][k]) for k in ref["state"]
    )
    for res in ranks:
        assert res["alpha"] == ref["alpha"]
        assert res["state"].keys() == ref["state"].keys()
        for k, v in ref["state"].items():  # float64 sums in another order: equal to float32 rounding
            torch.testing.assert_close(res["state"][k], v, rtol=1e-6, atol=1e-7, msg=k)
        for k, v in ref["toy"].items():
            torch.testing.assert_close(res["toy"][k], v, rtol=1e-6, atol=1e-6, msg=k)
