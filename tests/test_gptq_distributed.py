"""GPTQ under torch.distributed: 2 gloo ranks, each with half the calibration batches, give the weights and amaxes
one process gets with all of them (the Hessians and token counts are summed over the ranks)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from test_awq_memory import Toy
from test_awq_memory import _batches as _toy_batches
from test_gptq import Attn, _batches, _cfg

import modelopt_lite as mtq

pytestmark = pytest.mark.slow  # spawns two gloo ranks (several seconds)

WORLD = 2


def _quantized(batches, desc_act):
    torch.manual_seed(0)
    model = Attn().eval()

    def loop(m):
        for b in batches:
            m(b)

    mtq.quantize(model, _cfg(desc_act=desc_act), loop)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _toy(batches):
    """Toy(skip=1) (a ModuleList of blocks; a batch of one row skips block 1): the quantized state and how many
    times the loop ran."""
    torch.manual_seed(0)
    model = Toy(skip=1).eval()
    calls: list = []

    def loop(m):
        calls.append(1)
        for b in batches:
            m(b)

    mtq.quantize(model, _cfg(), loop)
    return {k: v.clone() for k, v in model.state_dict().items()}, len(calls)


def _worker(rank, port, outdir):
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        torch.set_num_threads(1)
        shard = _batches(6)[rank::WORLD]
        res: dict = {flag: _quantized(shard, flag) for flag in (False, True)}
        res["toy"] = _toy(_toy_batches()[rank::WORLD])  # rank 0's blocks are a chain, rank 1's one-row batch breaks it
        torch.save(res, f"{outdir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gptq_dist")
    return run_ranks(_worker, out, WORLD, 300, "distributed GPTQ")


@pytest.mark.parametrize("desc_act", [False, True])
def test_two_ranks_equal_one_process(rank_results, desc_act):
    want = _quantized(_batches(6), desc_act)
    for res in rank_results:
        got = res[desc_act]
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    # and it is not just the float model: the GPTQ weights differ from one rank's data alone
    alone = _quantized(_batches(6)[0::2], desc_act)
    assert not torch.equal(alone["up.weight"], want["up.weight"])


def test_ranks_agree_on_a_chain_only_one_of_them_sees(rank_results):
    """GPTQ advances along a chain of blocks without a pass of the loop only if every rank's data keeps the chain:
    here rank 1's breaks it, so both ranks run one pass per block (the same passes: a loop may hold collectives),
    and get the same weights, those of one process on all the data (up to the float64 Hessian sums' order: this
    model's differ from one process by an ulp of a few weights, before the chain change as after)."""
    want, _ = _toy(_toy_batches())
    (got0, passes0), (got1, passes1) = (res["toy"] for res in rank_results)
    _, chained = _toy(_toy_batches()[0::2])
    assert passes0 == passes1 == 1 + 1 + 3 + 1 and chained == 1 + 1 + 1 + 1  # calibration, inp, blocks, head
    assert got0.keys() == got1.keys() == want.keys() and all(torch.equal(got0[k], got1[k]) for k in want)
    for k in want:
        torch.testing.assert_close(got0[k], want[k], rtol=0, atol=1e-6)
