"""ModelOpt's layerwise calibration: ``model_calib.layerwise_calibrate`` and ``"layerwise": {"enable": True}``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite import model_calib
from modelopt_lite.conversion.config import QuantConfigError, normalize_algorithm


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, h, mask=None):
        return h + self.down(torch.relu(self.up(h * mask)))


class Decoder(nn.Module):
    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        mask = (torch.arange(h.shape[-1]) % 5 != 0).to(h.dtype)  # parent code between the layers' calls
        for layer in self.layers:
            h = layer(h, mask=mask)
        return self.head(h)


def _cfg(algorithm="max") -> dict:
    """INT8 with the embedding unquantized (ModelOpt's decoders have an nn.Embedding there, never quantized)."""
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["embed.*"] = {"enable": False}
    cfg["algorithm"] = algorithm
    return cfg


def _model() -> Decoder:
    torch.manual_seed(0)
    return Decoder()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(3)]


def _loop(m):
    for b in _batches():
        m(b)


def _amaxes(model, prefix="layers."):
    return {
        n: q.amax.clone()
        for n, q in model.named_modules()
        if n.startswith(prefix) and hasattr(q, "amax") and isinstance(getattr(q, "amax", None), torch.Tensor)
    }


def test_layerwise_max_equals_max_calibration_of_the_layers():
    ref = _model()
    mtq.quantize(ref, _cfg(), _loop)
    model = _model()
    mtq.quantize(model, _cfg(), None)
    for _, q in model.named_modules():
        if hasattr(q, "reset_amax"):
            q.reset_amax()
    passes = []

    def loop(m):
        passes.append(1)
        _loop(m)

    out = model_calib.layerwise_calibrate(model, loop, model_calib.max_calibrate)
    assert out is model
    assert len(passes) == 1  # the layers chain: one recording pass, then each layer replays its inputs
    want, got = _amaxes(ref), _amaxes(model)
    assert len(want) == 12 and set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert model.head.input_quantizer.amax is None  # outside the decoder layers: left as it was
    assert "forward" not in model.__dict__ and all("forward" not in b.__dict__ for b in model.layers)
    x = _batches()[0]
    assert model(x).shape == (4, 4)


def test_layerwise_qdq_from_prev_feeds_quantized_outputs():
    model = _model()
    mtq.quantize(model, _cfg(), None)
    model_calib.layerwise_calibrate(model, _loop, model_calib.max_calibrate, get_qdq_activations_from_prev_layer=True)
    # by hand: layer 1's up input is layer 0's quantized output (times the mask)
    mask = (torch.arange(16) % 5 != 0).float()
    with torch.no_grad():
        hs = [model.layers[0](model.embed(b), mask=mask) for b in _batches()]
    want = torch.stack([(h * mask).abs().amax() for h in hs]).amax()
    assert torch.equal(model.layers[1].up.input_quantizer.amax, want)
    plain = _model()
    mtq.quantize(plain, _cfg(), _loop)
    assert not torch.equal(plain.layers[1].up.input_quantizer.amax, want)


def test_layerwise_config_form_with_mse():
    a = _model()
    cfg = _cfg({"method": "mse", "step_size": 0.2, "layerwise": {"enable": True}})
    mtq.quantize(a, cfg, _loop)
    b = _model()
    mtq.quantize(b, _cfg(None), None)
    model_calib.layerwise_calibrate(b, _loop, model_calib.mse_calibrate, step_size=0.2)
    c = _model()
    mtq.quantize(c, _cfg({"method": "mse", "step_size": 0.2}), _loop)
    ga, gb, gc = _amaxes(a), _amaxes(b), _amaxes(c)
    assert len(ga) == 12
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n
        assert torch.equal(ga[n], gc[n]), n  # FP inputs: the same as the whole-model run
    assert normalize_algorithm({"method": "max", "layerwise": {"enable": False}}) == ("max", {})


def test_layerwise_errors():
    with pytest.raises(QuantConfigError, match="checkpoint_dir .* is not supported"):
        normalize_algorithm({"method": "max", "layerwise": {"enable": True, "checkpoint_dir": "/tmp/x"}})
    with pytest.raises(QuantConfigError, match="'layerwise' must be a dict"):
        normalize_algorithm({"method": "max", "layerwise": True})
    flat = nn.Sequential(nn.Linear(8, 4))
    mtq.quantize(flat, _cfg(), None)
    with pytest.raises(ValueError, match="no decoder layers found"):
        model_calib.layerwise_calibrate(flat, lambda m: m(torch.randn(2, 8)), model_calib.max_calibrate)
    model = _model()
    mtq.quantize(model, _cfg(), None)
    before = _amaxes(model)

    def boom(layer, loop, **kw):
        model_calib.max_calibrate(layer, loop)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model_calib.layerwise_calibrate(model, _loop, boom)
    after = _amaxes(model)
    assert set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)
    assert "forward" not in model.__dict__


class Unchained(Decoder):
    """The parent computes on the hidden state between layers: no chain, one pass of the loop per layer."""

    def forward(self, x):
        h = self.embed(x)
        mask = (torch.arange(h.shape[-1]) % 5 != 0).to(h.dtype)
        for layer in self.layers:
            h = 0.5 * layer(h, mask=mask)
        return self.head(h)


def test_layerwise_without_a_chain_runs_one_pass_per_layer_with_real_outputs():
    def make():
        torch.manual_seed(0)
        return Unchained()

    ref = make()
    mtq.quantize(ref, _cfg(), _loop)
    passes, outs = [], []

    def loop(m):
        passes.append(1)
        for b in _batches():
            y = m(b)
            assert isinstance(y, torch.Tensor) and y.shape == (4, 4) and bool(torch.isfinite(y).all())
            outs.append(y)

    model = make()
    mtq.quantize(model, _cfg({"method": "max", "layerwise": {"enable": True}}), loop)
    assert len(passes) == 1 + 2  # the recording pass, then one per later layer
    want, got = _amaxes(ref), _amaxes(model)
    assert len(want) == 12
    for n in want:
        assert torch.equal(got[n], want[n]), n
    # with quantized inputs, layer 1 sees 0.5 * (quantized layer 0 output), as the model computes it
    q = make()
    mtq.quantize(q, _cfg(None), None)
    model_calib.layerwise_calibrate(q, _loop, model_calib.max_calibrate, get_qdq_activations_from_prev_layer=True)
    mask = (torch.arange(16) % 5 != 0).float()
    with torch.no_grad():
        hs = [0.5 * q.layers[0](q.embed(b), mask=mask) for b in _batches()]
    assert torch.equal(q.layers[1].up.input_quantizer.amax, torch.stack([(h * mask).abs().amax() for h in hs]).amax())
