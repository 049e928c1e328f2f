"""The ``model_calib`` entry points against nvidia-modelopt 0.47's in the same process, on the same model and data
(skipped where nvidia-modelopt is not importable; run it with ``/tmp/venv-peer/bin/python -m pytest``).

Both sides search the same candidates ``amax_max * m``; they differ only in the fake quantization inside the
search (ours divides by ``scale = amax / bound``, ModelOpt multiplies by ``bound / amax``), which can flip a near
tie. So the chosen amaxes must agree on at least 90% of the entries, and the resulting error (squared weight error
for ``mse``, the block-Hessian loss for ``local_hessian``, measured with our quantizer) within 1%.
"""

from __future__ import annotations

import copy

import pytest
import torch

import modelopt_lite as ours
from modelopt_lite import model_calib

mtq = pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed (the pinned peer)")
pytestmark = pytest.mark.slow

W4 = {"num_bits": 4, "axis": 0}
B4 = {"num_bits": 4, "block_sizes": {-1: 16, "type": "static"}}


def _model() -> torch.nn.Module:
    torch.manual_seed(11)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    with torch.no_grad():
        for lin in (m[0], m[2]):
            lin.weight.copy_(torch.randn_like(lin.weight) ** 3 * 0.05)
    return m


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(12)
    return torch.randn(256, 64, generator=g) * torch.linspace(0.2, 2.0, 64) + 0.3 * torch.randn(256, 1, generator=g)


def _peer_cfg(weight: dict, algorithm: dict) -> dict:
    return {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": weight, "enable": True},
        ],
        "algorithm": algorithm,
    }


def _our_cfg(weight: dict) -> dict:
    return {"quant_cfg": {"*": {"enable": False}, "*weight_quantizer": {**weight, "enable": True}}}


def _peer_amax(lin) -> torch.Tensor:
    return lin.weight_quantizer.amax.detach().float()


def _weight_error(model, i) -> float:
    lin = model[i]
    w = lin.weight.detach()
    return float(((lin.weight_quantizer(w) - w) ** 2).sum())


@pytest.mark.parametrize("weight", [W4, B4], ids=["int4-per-channel", "int4-block16"])
def test_mse_calibrate_matches_modelopt(weight):
    x = _data()
    peer = _model()
    mtq.quantize(peer, _peer_cfg(weight, {"method": "mse"}), lambda m: m(x))
    mine = _model()
    ours.quantize(mine, _our_cfg(weight), lambda m: m(x))
    model_calib.mse_calibrate(mine, lambda m: m(x))
    for i in (0, 2):
        a, b = mine[i].weight_quantizer.amax, _peer_amax(peer[i]).reshape(mine[i].weight_quantizer.amax.shape)
        agree = float((a == b).float().mean())
        assert agree >= 0.9, agree
    # error of each side's amax, measured with our quantizer
    twin = _model()
    ours.quantize(twin, _our_cfg(weight), lambda m: m(x))
    for i in (0, 2):
        twin[i].weight_quantizer.amax = _peer_amax(peer[i]).reshape(mine[i].weight_quantizer.amax.shape)
        assert _weight_error(mine, i) <= _weight_error(twin, i) * 1.01


def test_local_hessian_matches_modelopt():
    x = _data()
    alg = {"method": "local_hessian", "fp8_scale_sweep": False, "block_size": 16}
    peer = _model()
    mtq.quantize(peer, _peer_cfg(W4, alg), lambda m: m(x))
    mine = _model()
    ours.quantize(mine, _our_cfg(W4), lambda m: m(x))
    model_calib.local_hessian_calibrate(mine, lambda m: m(x), fp8_scale_sweep=False, block_size=16, debug=True)
    for i in (0, 2):
        a, b = mine[i].weight_quantizer.amax, _peer_amax(peer[i]).reshape(mine[i].weight_quantizer.amax.shape)
        assert float((a == b).float().mean()) >= 0.9
    # the Hessian loss of each side's amax with our quantizer and our Hessian
    for i in (0, 2):
        acc = mine._local_hessian_accumulators[str(i)]
        fn = acc.error_fn()
        w = mine[i].weight.detach()
        ours_loss = float(fn(w, mine[i].weight_quantizer(w)).sum())
        twin = copy.deepcopy(mine[i].weight_quantizer)
        twin.amax = _peer_amax(peer[i]).reshape(twin.amax.shape)
        peer_loss = float(fn(w, twin(w)).sum())
        assert ours_loss <= peer_loss * 1.01


@pytest.mark.parametrize("rho", [16384.0, 100.0])
def test_nvfp4_act_headroom_matches_modelopt_exactly(rho):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    x = torch.randn(128, 64) * torch.logspace(-3, 1, 64)
    peer = copy.deepcopy(base)
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    cfg["algorithm"] = {"method": "nvfp4_act_headroom", "rho": rho}
    mtq.quantize(peer, cfg, lambda m: m(x))
    mine = copy.deepcopy(base)
    ours.quantize(mine, ours.NVFP4_DEFAULT_CFG, lambda m: m(x))
    model_calib.nvfp4_act_headroom_calibrate(mine, lambda m: m(x), rho=rho)
    for i in (0, 2):
        assert torch.equal(mine[i].input_quantizer.amax, peer[i].input_quantizer.amax.float())
        assert torch.equal(mine[i].weight_quantizer.amax, peer[i].weight_quantizer.amax.float())


@pytest.mark.parametrize("qdq", [False, True], ids=["fp-inputs", "qdq-inputs"])
def test_layerwise_max_matches_modelopt_on_tiny_llama(qdq):
    """fp-inputs: every amax bit-identical. qdq-inputs: layer 1 sees layer 0's fake-quantized output, where ModelOpt
    multiplies by bound / amax and we divide by amax / bound (a few codes one step apart), so within 0.5%; ours is
    checked exactly against a plain forward of the model. ``use_cache=False`` on both sides: with a KV cache,
    ModelOpt's replay of layer 0 attends to the keys its own calibration replay left in the cache object (layer 1's
    q_proj input amax 3.8618 against 3.9119 without a cache), where ours replays on a copy of the cache as recorded."""
    H = pytest.importorskip("hf_helpers")
    alg = {"method": "max", "layerwise": {"enable": True, "get_qdq_activations_from_prev_layer": qdq}}
    peer = H.tiny_llama()
    peer.config.use_cache = False
    mtq.quantize(peer, {**copy.deepcopy(mtq.INT8_DEFAULT_CFG), "algorithm": alg}, H.forward_loop)
    mine = H.tiny_llama()
    mine.config.use_cache = False
    ours.quantize(mine, {**copy.deepcopy(ours.INT8_DEFAULT_CFG), "algorithm": alg}, H.forward_loop)
    theirs = {
        n: q.amax.float()
        for n, q in peer.named_modules()
        if n.startswith("model.layers.") and n.endswith("_quantizer") and getattr(q, "amax", None) is not None
    }
    got = {n: q.amax for n, q in mine.named_modules() if n in theirs}
    assert len(theirs) >= 28 and set(got) == set(theirs)
    for n, t in theirs.items():
        a = got[n].reshape(t.shape)
        if qdq and n.startswith("model.layers.1."):
            assert torch.allclose(a, t, rtol=5e-3, atol=0), n
        else:
            assert torch.equal(a, t), n
    if qdq:  # ours: layer 1's inputs are exactly what the model computes with layer 0 quantized
        layer1 = mine.model.layers[1]
        for n, q in layer1.named_modules():
            if n.endswith("_quantizer"):
                q.disable()
        seen: list = []
        layer1.self_attn.q_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0].abs().amax()))
        H.forward_loop(mine)
        assert torch.equal(torch.stack(seen).amax(), got["model.layers.1.self_attn.q_proj.input_quantizer"])


def test_lsq_on_int4_weights_matches_modelopt():
    """ModelOpt's lsq converts only static NVFP4 weights: on INT4 weights both sides are its mse calibration."""
    x = _data()
    peer = _model()
    mtq.quantize(peer, _peer_cfg(W4, {"method": "lsq"}), lambda m: m(x))
    mine = _model()
    ours.quantize(mine, _our_cfg(W4), lambda m: m(x))
    with pytest.warns(UserWarning, match="LSQ mode"):
        model_calib.lsq(mine, lambda m: m(x))
    for i in (0, 2):
        a = mine[i].weight_quantizer.amax
        assert torch.equal(a, _peer_amax(peer[i]).reshape(a.shape))
