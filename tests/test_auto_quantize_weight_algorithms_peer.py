"""auto_quantize with weight-algorithm formats (AWQ, W4A8 AWQ, SmoothQuant) against nvidia-modelopt 0.47's on the CPU
(optional: skipped where modelopt is not installed; ModelOpt's NVFP4 needs CUDA, so NVFP4_AWQ_LITE_CFG is not here).

Three parallel Linears read inputs with outlier channels, so AWQ's scaling beats the unscaled weight in every layer
(ours keeps the unscaled weight when nothing beats it, ModelOpt does not: README, differences). One calibration
batch: ModelOpt calibrates AWQ formats on a quarter of ``num_calib_steps`` (at least 1), ours on all of them.
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as mtq


def _peer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("modelopt.torch.quantization")


class _Par(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(256, 64), nn.Linear(256, 32), nn.Linear(256, 16)

    def forward(self, x):
        return torch.cat([self.a(x), 3 * self.b(x), 10 * self.c(x)], -1)


def _problem(outliers):
    model = _Par()
    g = torch.Generator().manual_seed(1)
    cs = torch.ones(256)
    cs[::17] = outliers
    data = [torch.randn(8, 256, generator=g) * cs for _ in range(3)]
    with torch.no_grad():
        target = {id(x): model(x) + torch.randn(8, 112, generator=g) for x in data}
    return model, data, lambda out, b: ((out - target[id(b)]) ** 2).sum()


@pytest.mark.parametrize(
    ("names", "bits", "outliers"),
    [
        (["INT4_AWQ_CFG", "INT8_DEFAULT_CFG"], 6, 25.0),
        (["W4A8_AWQ_BETA_CFG", "INT8_DEFAULT_CFG"], 8, 25.0),
        (["INT8_SMOOTHQUANT_CFG"], 12, 4.0),  # with ModelOpt's default alpha, 1.0 (our preset has 0.8)
    ],
)
def test_weight_algorithm_formats_match_modelopt(names, bits, outliers):
    mtq_peer = _peer()
    model, data, loss = _problem(outliers)

    def formats(lib):
        cfgs = [getattr(lib, n) for n in names]
        if names[0] == "INT8_SMOOTHQUANT_CFG":
            cfgs[0] = {**cfgs[0], "algorithm": {"method": "smoothquant", "alpha": 1.0}}
        return cfgs

    kw = dict(data_loader=data, forward_step=lambda m, b: m(b), loss_func=loss, num_calib_steps=1, num_score_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q, ours = mtq.auto_quantize(copy.deepcopy(model), {"effective_bits": bits}, formats(mtq), **kw)
        with contextlib.redirect_stdout(io.StringIO()):
            pq, peer = mtq_peer.auto_quantize(copy.deepcopy(model), {"effective_bits": bits}, formats(mtq_peer), **kw)

    for name, st in ours["candidate_stats"].items():
        ps = peer["candidate_stats"][f"{name}.quant_recipe"]
        assert [str(f).split("(")[0] for f in ps["formats"]] == st["formats"]
        assert st["scores"] == pytest.approx(ps["scores"], rel=1e-5)
        assert [c / 16 for c in st["costs"]] == pytest.approx(ps["costs"])
    peer_recipe = {k.split(".quant_recipe")[0]: str(v).split("(")[0] for k, v in peer["best"]["recipe"].items()}
    assert ours["best"]["recipe"] == peer_recipe
    assert ours["quantization_formats"][0] in peer_recipe.values()  # the weight-algorithm format is picked
    with torch.no_grad():
        for x in data:
            torch.testing.assert_close(q(x), pq(x), rtol=1e-5, atol=1e-4)
