"""auto_quantize with formats whose algorithm changes the weights (SmoothQuant, AWQ, W4A8 AWQ, NVFP4 AWQ): each
layer holds exactly the state its format's standalone ``quantize`` gives it, alone or mixed with plain formats, and
the result saves and restores (see modelopt_lite/algorithms/auto_quantize_recipes.py)."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms.auto_quantize import auto_quantize
from modelopt_lite.conversion.algorithm_registry import ALGORITHMS, register_algorithm

AWQ, SQ, W4A8, NVFP4_AWQ = mtq.INT4_AWQ_CFG, mtq.INT8_SMOOTHQUANT_CFG, mtq.W4A8_AWQ_BETA_CFG, mtq.NVFP4_AWQ_LITE_CFG
INT8, FP8 = mtq.INT8_DEFAULT_CFG, mtq.FP8_DEFAULT_CFG


class _Net(nn.Module):
    """fc1 reads the data (AWQ keeps ``pre_quant_scale``), fc2 a LayerNorm with outlier channels (AWQ folds into
    it), fc3 a ReLU."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.ln, self.fc2, self.fc3 = (
            nn.Linear(128, 128),
            nn.LayerNorm(128),
            nn.Linear(128, 128),
            nn.Linear(128, 16),
        )
        with torch.no_grad():
            self.ln.weight[::11] = 20.0

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.ln(self.fc1(x)))))


class _Fork(nn.Module):
    """One LayerNorm read by two layers that need not share a format (AWQ folds one scale for both into it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.ln, self.a, self.b = nn.LayerNorm(128), nn.Linear(128, 32), nn.Linear(128, 32)
        with torch.no_grad():
            self.ln.weight[::11] = 20.0

    def forward(self, x):
        h = self.ln(x)
        return torch.cat([self.a(h), self.b(h)], -1)


def _data(width=128):
    g = torch.Generator().manual_seed(2)
    cs = torch.ones(width)
    cs[::13] = 25.0
    return [torch.randn(8, width, generator=g) * cs for _ in range(3)]


def _search(model, data, formats, bits, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the custom-format and progress-bar warnings
        return auto_quantize(
            model,
            {"effective_bits": bits},
            formats,
            data,
            lambda m, b: m(b),
            lambda out, b: out.square().sum(),
            num_calib_steps=3,
            num_score_steps=2,
            **kw,
        )


def _standalone(model, cfg, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(copy.deepcopy(model), cfg, lambda m: [m(x) for x in data])


@pytest.mark.parametrize(
    ("cfg", "other", "bits"),
    [
        (SQ, None, 8),
        (AWQ, INT8, 4),
        (W4A8, INT8, 4),
        (NVFP4_AWQ, FP8, 4),
        ({**mtq.INT4_SVDQUANT_CFG, "algorithm": {"method": "svdquant", "lowrank": 8}}, INT8, 4),
        ({**mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "algorithm": [{"method": "awq_lite"}, {"method": "gptq"}]}, INT8, 4),
    ],
    ids=["smoothquant", "int4_awq", "w4a8_awq", "nvfp4_awq", "int4_svdquant", "awq_then_gptq"],
)
def test_one_format_everywhere_equals_its_standalone_quantize(cfg, other, bits):
    net, data = _Net(), _data()
    expect = _standalone(net, cfg, data)
    q, st = _search(net, data, [cfg] + ([other] if other else []), bits)
    assert set(st["best"]["layer_recipe"].values()) == {st["quantization_formats"][0]}
    with torch.no_grad():
        for x in data:
            assert torch.equal(q(x), expect(x))
    for name in ("fc1", "ln", "fc2", "fc3"):
        for k, v in expect.get_submodule(name).state_dict().items():
            assert torch.equal(q.get_submodule(name).state_dict()[k], v), (name, k)
    if cfg is AWQ:  # the LayerNorm took AWQ's fold, fc1 kept a pre_quant_scale
        assert not torch.equal(q.ln.weight, _Net().ln.weight) and q.fc2.input_quantizer.pre_quant_scale is None
        assert q.fc1.input_quantizer.pre_quant_scale is not None


def _layers_match(q, st, standalone, x):
    """Every searched layer of ``q`` computes exactly what its format's standalone layer computes."""
    acts = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: acts.__setitem__(n, a[0])) for n, m in q.named_modules()]
    with torch.no_grad():
        q(x)
        for h in hooks:
            h.remove()
        for name, fmt in st["best"]["layer_recipe"].items():
            ref = standalone[fmt].get_submodule(name)
            assert torch.equal(q.get_submodule(name)(acts[name]), ref(acts[name])), (name, fmt)


def test_mixed_search_each_layer_is_its_formats_standalone_layer():
    net, data = _Net(), _data()
    formats = [AWQ, SQ, FP8]
    q, st = _search(net, data, formats, 6.0)
    chosen = st["best"]["layer_recipe"]
    assert len(set(chosen.values())) >= 2, chosen  # a real mix
    standalone = {n: _standalone(_Net(), c, data) for n, c in zip(st["quantization_formats"], formats)}
    standalone["NONE"] = mtq.quantize(_Net(), {"quant_cfg": {"*": {"enable": False}}, "algorithm": None})
    _layers_match(q, st, standalone, data[0])
    # the LayerNorm is AWQ's folded one exactly when fc2 (its only reader) chose AWQ
    ln = standalone["INT4_AWQ_CFG" if chosen["fc2"] == "INT4_AWQ_CFG" else "NONE"].ln
    assert torch.equal(q.ln.weight, ln.weight) and torch.equal(q.ln.bias, ln.bias)


def test_search_spaces_pin_each_layer_to_a_weight_algorithm():
    net, data = _Net(), _data()
    spaces = [
        {"module_name_patterns": "fc1", "quantization_formats": [SQ], "allow_no_quant": False},
        {"module_name_patterns": "fc2", "quantization_formats": [AWQ], "allow_no_quant": False},
        {"module_name_patterns": "fc3", "quantization_formats": [W4A8, INT8]},
    ]
    q, st = _search(net, data, [FP8], 16, module_search_spaces=spaces)
    chosen = st["best"]["layer_recipe"]
    assert chosen["fc1"] == "INT8_SMOOTHQUANT_CFG" and chosen["fc2"] == "INT4_AWQ_CFG"
    standalone = {n: _standalone(_Net(), mtq.presets.PRESETS[n], data) for n in set(chosen.values()) - {"NONE"}}
    standalone["NONE"] = mtq.quantize(_Net(), {"quant_cfg": {"*": {"enable": False}}, "algorithm": None})
    _layers_match(q, st, standalone, data[1])
    assert torch.equal(q.ln.weight, standalone["INT4_AWQ_CFG"].ln.weight)


def test_fold_split_between_formats_keeps_the_scale_as_pre_quant_scale():
    """a in AWQ, b in INT8: the LayerNorm stays float (b needs it), a keeps AWQ's 1/s as its pre_quant_scale."""
    net, data = _Fork(), _data()
    spaces = [
        {"module_name_patterns": "a", "quantization_formats": [AWQ], "allow_no_quant": False},
        {"module_name_patterns": "b", "quantization_formats": [INT8], "allow_no_quant": False},
    ]
    q, st = _search(net, data, [FP8], 16, module_search_spaces=spaces)
    awq, int8, fresh = _standalone(_Fork(), AWQ, data), _standalone(_Fork(), INT8, data), _Fork()
    assert not torch.equal(awq.ln.weight, fresh.ln.weight)  # the standalone AWQ folded into the norm
    assert torch.equal(q.ln.weight, fresh.ln.weight) and torch.equal(q.ln.bias, fresh.ln.bias)
    assert torch.equal(q.a.weight, awq.a.weight) and awq.a.input_quantizer.pre_quant_scale is None
    pqs = q.a.input_quantizer.pre_quant_scale
    assert pqs is not None and pqs.shape == (128,)
    with torch.no_grad():
        x = data[0]
        assert torch.equal(q.b(q.ln(x)), int8.b(int8.ln(x)))
        torch.testing.assert_close(q.a(q.ln(x)), awq.a(awq.ln(x)), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pqs * q.ln(x), awq.ln(x), rtol=1e-5, atol=1e-5)


def test_saved_and_restored_result_keeps_each_layers_algorithm_state(tmp_path):
    net, data = _Net(), _data()
    q, st = _search(copy.deepcopy(net), data, [AWQ, SQ, FP8], 6.0)
    buf = io.BytesIO()
    mtq.opt.save(q, buf)
    buf.seek(0)
    restored = mtq.opt.restore(_Net(), buf)
    mtq.save(q, tmp_path / "aq", include_weights=True)
    restored2 = mtq.restore(_Net(), tmp_path / "aq")
    with torch.no_grad():
        for x in data:
            assert torch.equal(restored(x), q(x)) and torch.equal(restored2(x), q(x))
    # the JSON checkpoint of the scores: a restored search calibrates the picked formats again, the same state
    path = tmp_path / "scores.json"
    q1, _ = _search(copy.deepcopy(net), data, [AWQ, SQ, FP8], 6.0, checkpoint=str(path))
    q2, st2 = _search(copy.deepcopy(net), data, [AWQ, SQ, FP8], 6.0, checkpoint=str(path))
    assert st2["restored"]
    with torch.no_grad():
        assert torch.equal(q1(data[0]), q2(data[0])) and torch.equal(q1(data[0]), q(data[0]))


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(128, 128), nn.Linear(128, 16)
        with torch.no_grad():
            self.fc1.weight[::11] *= 30.0  # outlier output channels: AWQ scales fc2 and folds into fc1's rows

    def forward(self, x):
        return self.fc2(self.fc1(x))


def test_fold_into_a_searched_layer_is_recalibrated_without_linear_folds():
    """AWQ folds fc2's scale into fc1's rows when fc1 is a plain Linear; in a search fc1's weight must not hold fc2's
    scale, so the format is calibrated as with fold_linear=False (fc2 keeps a pre_quant_scale)."""
    data = _data()
    unfolded = {**AWQ, "algorithm": {**AWQ["algorithm"], "fold_linear": False}}
    folded, expect = _standalone(_Chain(), AWQ, data), _standalone(_Chain(), unfolded, data)
    assert not torch.equal(folded.fc1.weight, expect.fc1.weight)  # the standalone folds into fc1
    assert folded.fc2.input_quantizer.pre_quant_scale is None and expect.fc2.input_quantizer.pre_quant_scale is not None
    with pytest.raises(ValueError, match="awq: fold_linear must be True or False, got 'no'"):
        mtq.quantize(_Chain(), {**AWQ, "algorithm": {"method": "awq_lite", "fold_linear": "no"}}, lambda m: None)
    q, st = _search(_Chain(), data, [AWQ, INT8], 4.0)
    assert set(st["best"]["layer_recipe"].values()) == {"INT4_AWQ_CFG"}
    with torch.no_grad():
        assert torch.equal(q(data[0]), expect(data[0]))
    # left out of the search, the producer is float in the result and fc2 keeps the scale as pre_quant_scale
    q, st = _search(_Chain(), data, [AWQ, INT8], 4.0, disabled_layers="fc1")
    assert st["best"]["layer_recipe"] == {"fc2": "INT4_AWQ_CFG"}
    assert torch.equal(q.fc1.weight, _Chain().fc1.weight) and q.fc2.input_quantizer.pre_quant_scale is not None


def _touch_norm(model, forward_loop, calibrate):
    with torch.no_grad():
        model.ln.bias.add_(1.0)
    calibrate()


def _add_buffer(model, forward_loop, calibrate):
    model.fc1.register_buffer("extra", torch.zeros(1))
    calibrate()


@pytest.mark.parametrize(
    ("run", "match"),
    [
        (_touch_norm, r"format 'CUSTOM_0': its algorithm changed 'ln' \(LayerNorm\), which is not a searched layer"),
        (_add_buffer, r"format 'CUSTOM_0': its algorithm changed the tensors of the layer 'fc1'"),
    ],
)
def test_an_algorithm_changing_what_cannot_be_switched_is_refused(run, match):
    name = "test_aq_" + run.__name__
    register_algorithm(name)(run)
    try:
        cfg = {**INT8, "algorithm": {"method": name}}
        with pytest.raises(ValueError, match=match):
            _search(_Net(), _data(), [cfg], 8.0)
    finally:
        del ALGORITHMS[name]


def test_fixed_config_with_a_weight_algorithm():
    """INT4 AWQ as the fixed baseline (fc1, fc2, with the LayerNorm fold), fc3 searched in INT8 or float."""
    net, data = _Net(), _data()
    spaces = [{"module_name_patterns": "fc3", "quantization_formats": [INT8]}]
    q, st = _search(net, data, None, 5.0, module_search_spaces=spaces, fixed_quantization_config=AWQ)
    chosen = st["best"]["layer_recipe"]
    assert chosen["fc1"] == chosen["fc2"] == "INT4_AWQ_CFG" and chosen["fc3"] in ("INT8_DEFAULT_CFG", "NONE")
    standalone = {"INT4_AWQ_CFG": _standalone(_Net(), AWQ, data), "INT8_DEFAULT_CFG": _standalone(_Net(), INT8, data)}
    standalone["NONE"] = mtq.quantize(_Net(), {"quant_cfg": {"*": {"enable": False}}, "algorithm": None})
    _layers_match(q, st, standalone, data[2])
    assert torch.equal(q.ln.weight, standalone["INT4_AWQ_CFG"].ln.weight)


class _QKV(nn.Module):
    """A LayerNorm read by q/k/v (one group under QUANT_GROUPING_RULES: AWQ folds one scale for all three)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.ln = nn.LayerNorm(128)
        self.attn = nn.Module()
        self.attn.q_proj, self.attn.k_proj, self.attn.v_proj = (nn.Linear(128, 32) for _ in range(3))
        self.out = nn.Linear(96, 16)
        with torch.no_grad():
            self.ln.weight[::9] = 15.0

    def forward(self, x):
        h = self.ln(x)
        a = self.attn
        return self.out(torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], -1))


def test_a_group_sharing_one_fold_keeps_it_exact():
    data = _data()
    spaces = [
        {"module_name_patterns": "*_proj", "quantization_formats": [AWQ, INT8], "allow_no_quant": False},
        {"module_name_patterns": "out", "quantization_formats": [INT8], "allow_no_quant": False},
    ]
    q, st = _search(_QKV(), data, [FP8], 5.0, module_search_spaces=spaces)
    assert list(st["candidate_stats"]) == ["attn.*", "out"] and st["best"]["recipe"]["attn.*"] == "INT4_AWQ_CFG"
    awq = _standalone(_QKV(), AWQ, data)
    assert not torch.equal(awq.ln.weight, _QKV().ln.weight)  # folded once for q, k and v
    assert torch.equal(q.ln.weight, awq.ln.weight) and torch.equal(q.ln.bias, awq.ln.bias)
    standalone = {"INT4_AWQ_CFG": awq, "INT8_DEFAULT_CFG": _standalone(_QKV(), INT8, data)}
    _layers_match(q, st, standalone, data[0])
