"""auto_quantize: method="kl_div", checkpoint, module_search_spaces and fixed_quantization_config (ModelOpt's)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms.auto_quantize import auto_quantize

INT4 = mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG
INT8 = mtq.INT8_DEFAULT_CFG
I4, I8 = "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "INT8_DEFAULT_CFG"


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16)).eval()


def _data(n=3):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 256, generator=g) for _ in range(n)]


class _Counter:
    """forward_step that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, m, b):
        self.calls += 1
        return m(b)


def _int4_blocks_by_hand(w: torch.Tensor) -> torch.Tensor:
    blocks = w.reshape(w.shape[0], -1, 128)
    scale = blocks.abs().amax(-1, keepdim=True).float() / 7.0
    return (torch.clamp(torch.round(blocks / scale), -8, 7) * scale).reshape(w.shape)


# --- kl_div --------------------------------------------------------------------------------------------------------
def test_kl_div_scores_match_hand_computation():
    torch.manual_seed(5)
    lin = nn.Linear(256, 5)
    with torch.no_grad():
        lin.weight.mul_(20)  # sharp logits
    w, bias = lin.weight.detach().clone(), lin.bias.detach().clone()
    data = [torch.randn(4, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    wq = _int4_blocks_by_hand(w)
    expect = 0.0
    for x in data:
        lp = torch.log_softmax((x @ w.T + bias).double(), -1)
        lq = torch.log_softmax((x @ wq.T + bias).double(), -1)
        expect += float((lp.exp() * (lp - lq)).sum())
    _, st = auto_quantize(
        nn.Sequential(lin), {"effective_bits": 16}, [INT4], data, lambda m, b: m(b), method="kl_div", num_calib_steps=2
    )
    raw = st["candidate_stats"]["0"]["raw_scores"]
    assert st["candidate_stats"]["0"]["formats"] == [I4, "NONE"]
    assert raw[1] == 0.0
    assert expect > 1e-3
    assert raw[0] == pytest.approx(expect, rel=1e-4)


def test_kl_div_takes_the_logits_attribute_and_refuses_other_outputs():
    class Out:
        def __init__(self, logits):
            self.logits = logits

    m, data = _mlp(), _data()
    _, st = auto_quantize(m, {"effective_bits": 6}, [INT4, INT8], data, lambda mm, b: Out(mm(b)), method="kl_div")
    _, ref = auto_quantize(_mlp(), {"effective_bits": 6}, [INT4, INT8], data, lambda mm, b: mm(b), method="kl_div")
    assert st["candidate_stats"]["0"]["raw_scores"] == ref["candidate_stats"]["0"]["raw_scores"]
    with pytest.raises(ValueError, match="kl_div' needs forward_step to return the logits.*got tuple"):
        auto_quantize(_mlp(), {"effective_bits": 6}, [INT4, INT8], data, lambda mm, b: (mm(b),), method="kl_div")


# --- checkpoint ----------------------------------------------------------------------------------------------------
def _run(path, bits=6.0, formats=(INT4, INT8), method="layer_error", count=None, **kw):
    fs = count or _Counter()
    q, st = auto_quantize(
        _mlp(), {"effective_bits": bits}, list(formats), _data(), fs, method=method, checkpoint=path, **kw
    )
    return q, st, fs.calls


def test_checkpoint_round_trip_skips_scoring(tmp_path):
    path = tmp_path / "aq.json"
    q1, st1, calls1 = _run(path, method="kl_div")
    assert path.is_file() and not st1["restored"]
    q2, st2, calls2 = _run(path, method="kl_div")
    assert st2["restored"]
    used = {f for f in st2["best"]["recipe"].values() if f != "NONE"}
    assert calls2 == 3 * len(used)  # only the calibration of the formats it picked: no scoring forward
    assert calls1 > calls2 + 3 * 3 * 2  # the first call scored (3 groups x 2 formats x 3 batches)
    assert st2["best"]["recipe"] == st1["best"]["recipe"]
    for g, s in st1["candidate_stats"].items():
        assert st2["candidate_stats"][g]["raw_scores"] == s["raw_scores"]
    x = _data()[0]
    with torch.no_grad():
        assert torch.equal(q1(x), q2(x))


def test_checkpoint_reused_under_another_budget(tmp_path):
    path = tmp_path / "aq.json"
    _run(path, bits=6.0)
    _, st5, calls = _run(path, bits=5.0)
    _, fresh, _ = _run(None, bits=5.0)
    assert st5["restored"]
    assert calls <= 3 * 2
    assert st5["best"]["recipe"] == fresh["best"]["recipe"]
    assert st5["best"]["constraints"] == fresh["best"]["constraints"]
    assert st5["best"]["constraints"]["effective_bits"] <= 5.0


def _corrupt(doc, how):
    g = doc["groups"]["0"]
    if how == "nan_score":
        return json.dumps(doc).replace(json.dumps(g["raw_scores"][0]), "NaN", 1)
    if how == "string_score":
        g["raw_scores"][0] = "1.0"
    elif how == "short_scores":
        g["raw_scores"] = g["raw_scores"][:1]
    elif how == "layer_name":
        g["module_names"] = ["9"]
    elif how == "costs":
        g["costs"][0] += 1
    elif how == "group_missing":
        del doc["groups"]["2"]
    elif how == "extra_key":
        doc["code"] = "import os"
    elif how == "method":
        doc["method"] = "gradient"
    elif how == "format_config":
        doc["formats"][I8] = "0" * 16
    elif how == "version":
        doc["version"] = 99
    elif how == "not_json":
        return "{not json"
    elif how == "list":
        return "[]"
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("nan_score", r"file: not valid JSON.*NaN is not allowed"),
        ("string_score", r"groups\['0'\]\.raw_scores\[0\]: must be a finite number, got '1.0'"),
        ("short_scores", r"groups\['0'\]\.raw_scores: must be a list of 3 numbers"),
        ("layer_name", r"groups\['0'\]\.module_names: is \['9'\], the current search has \['0'\]"),
        ("costs", r"groups\['0'\]\.costs: is"),
        ("group_missing", r"groups: lacks the group '2'"),
        ("extra_key", r"file: has keys"),
        ("method", r"method: is 'gradient', this search has 'layer_error'"),
        ("format_config", r"formats: is"),
        ("version", r"format: not a modelopt_lite.auto_quantize_search v1 file"),
        ("not_json", r"file: not valid JSON"),
        ("list", r"file: must hold a JSON object, got list"),
    ],
)
def test_corrupted_checkpoint_raises(tmp_path, how, match):
    path = tmp_path / "aq.json"
    _run(path)
    path.write_text(_corrupt(json.loads(path.read_text()), how))
    count = _Counter()
    with pytest.raises(ValueError, match=rf"checkpoint {path}: {match}"):
        _run(path, count=count)
    assert count.calls == 0  # refused before any calibration or scoring


def test_checkpoint_of_another_search_raises(tmp_path):
    path = tmp_path / "aq.json"
    _run(path)
    with pytest.raises(ValueError, match=r"checkpoint .*: formats: is .* this search has"):
        _run(path, formats=(INT4,))
    with pytest.raises(ValueError, match=r"groups\['4'\]\.formats: is"):
        _run(path, module_search_spaces=[{"module_name_patterns": "4", "quantization_formats": [INT8]}])
    with pytest.raises(ValueError, match="checkpoint must be a file path"):
        _run(tmp_path)


# --- module_search_spaces ------------------------------------------------------------------------------------------
def _uniform(cfg, data):
    return mtq.quantize(_mlp(), cfg, lambda mm: [mm(x) for x in data])


def test_search_space_with_one_format_and_no_float_is_fixed_and_active_while_scoring():
    data = _data()
    space = {"module_name_patterns": ["0"], "quantization_formats": [INT8], "allow_no_quant": False}
    q, st = auto_quantize(
        _mlp(), {"effective_bits": 16}, [INT4, INT8], data, lambda m, b: m(b), method="layer_error",
        module_search_spaces=[space],
    )  # fmt: skip
    s0 = st["candidate_stats"]["0"]
    assert (s0["formats"], s0["fixed"], s0["search_space"], s0["raw_scores"]) == ([I8], True, 0, [0.0])
    assert st["candidate_stats"]["2"]["formats"] == [I4, I8, "NONE"]
    assert st["best"]["recipe"] == {"0": I8, "2": "NONE", "4": "NONE"}
    assert st["best"]["constraints"]["effective_bits"] == pytest.approx((256 * 128 * 8 + 144 * 128 * 16) / 400 / 128)
    u8, u4 = _uniform(INT8, data), _uniform(INT4, data)
    assert q[0].weight_quantizer.is_enabled and torch.equal(q[0].weight_quantizer.amax, u8[0].weight_quantizer.amax)
    assert not q[2].weight_quantizer.is_enabled
    expect = 0.0  # layer 2's INT4 error on its input with layer 0 INT8 (the fixed layer stays quantized)
    with torch.no_grad():
        for x in data:
            h = torch.relu(u8[0](x))
            expect += float(((u4[2](h) - _mlp()[2](h)) ** 2).sum())
    assert st["candidate_stats"]["2"]["raw_scores"][0] == pytest.approx(expect, rel=1e-5)


def test_search_space_without_float_choice_and_per_layer_candidates():
    space = {"module_name_patterns": "4", "quantization_formats": [INT4, None, INT8], "allow_no_quant": False}
    _, st = auto_quantize(
        _mlp(), {"effective_bits": 16}, [INT4], _data(), lambda m, b: m(b), method="layer_error",
        module_search_spaces=[space],
    )  # fmt: skip
    s4 = st["candidate_stats"]["4"]
    assert (s4["formats"], s4["fixed"], s4["allow_no_quant"]) == ([I4, I8], False, False)
    assert st["candidate_stats"]["0"]["formats"] == [I4, "NONE"]
    assert st["best"]["recipe"] == {"0": "NONE", "2": "NONE", "4": I8}  # float not allowed: the best is INT8
    assert st["quantization_formats"] == [I4, I8]


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(128, 64), nn.Linear(128, 64), nn.Linear(128, 64)

    def forward(self, x):
        return self.q_proj(x) * self.k_proj(x) + self.v_proj(x)


@pytest.mark.parametrize(
    ("spaces", "err", "match"),
    [
        ([{"module_name_patterns": "0.q_proj", "quantization_formats": [INT8]}], ValueError, "only part of the group"),
        (
            [
                {"module_name_patterns": "*", "quantization_formats": [INT8]},
                {"module_name_patterns": "*_proj", "quantization_formats": [INT4]},
            ],
            ValueError,
            r"entries \[0, 1\] all match the group '0\.\*'",
        ),
        (["*"], TypeError, r"module_search_spaces\[0\] must be a dict, got str"),
        ({"module_name_patterns": "*"}, TypeError, "must be a list of dicts, got dict"),
        ([{"module_name_patterns": "*", "quantization_formats": [INT8], "x": 1}], ValueError, r"key\(s\) \['x'\]"),
        ([{"module_name_patterns": [], "quantization_formats": [INT8]}], ValueError, "non-empty list of strings"),
        ([{"module_name_patterns": "*", "quantization_formats": INT8}], TypeError, "must be a list, got dict"),
        ([{"module_name_patterns": "*", "quantization_formats": []}], ValueError, "must be a non-empty list"),
        ([{"module_name_patterns": "*", "quantization_formats": [None]}], ValueError, "must contain a non-None"),
        ([{"module_name_patterns": "*", "quantization_formats": [INT8], "allow_no_quant": 0}], TypeError, "a bool"),
    ],
)
def test_bad_search_spaces(spaces, err, match):
    count = _Counter()
    with pytest.raises(err, match=match):
        auto_quantize(
            nn.Sequential(_Attn()), {"effective_bits": 8}, [INT4], [torch.randn(2, 128)], count,
            method="layer_error", module_search_spaces=spaces,
        )  # fmt: skip
    assert count.calls == 0


# --- fixed_quantization_config -------------------------------------------------------------------------------------
def test_fixed_config_for_the_unmatched_layers():
    data = _data()
    space = {"module_name_patterns": ["4"], "quantization_formats": [INT4]}
    kw = dict(method="layer_error", module_search_spaces=[space], fixed_quantization_config=INT8)
    q16, st16 = auto_quantize(_mlp(), {"effective_bits": 16}, None, data, lambda m, b: m(b), **kw)
    for g in ("0", "2"):
        s = st16["candidate_stats"][g]
        assert (s["formats"], s["fixed"], s["costs"]) == ([I8], True, [float(s["params"] * 8)])
    assert st16["candidate_stats"]["4"]["formats"] == [I4, "NONE"]
    assert st16["best"]["recipe"] == {"0": I8, "2": I8, "4": "NONE"}
    assert st16["fixed_quantization_config"] == I8
    n0, n2, n4 = 256 * 128, 128 * 128, 128 * 16
    assert st16["best"]["constraints"]["effective_bits"] == pytest.approx((8 * (n0 + n2) + 16 * n4) / (n0 + n2 + n4))
    _, st7 = auto_quantize(_mlp(), {"effective_bits": 8.1}, None, data, lambda m, b: m(b), **kw)
    assert st7["best"]["recipe"] == {"0": I8, "2": I8, "4": I4}
    u8, u4 = _uniform(INT8, data), _uniform(INT4, data)
    for i in (0, 2):  # the fixed layers: exactly uniform INT8 (calibrated with its own algorithm)
        for name in ("weight_quantizer", "input_quantizer"):
            assert torch.equal(getattr(q16[i], name).amax, getattr(u8[i], name).amax)
    assert not q16[4].weight_quantizer.is_enabled
    expect = 0.0  # layer 4's INT4 error on its input from the INT8 baseline (active while scoring)
    with torch.no_grad():
        for x in data:
            h = torch.relu(u8[2](torch.relu(u8[0](x))))
            expect += float(((u4[4](h) - _mlp()[4](h)) ** 2).sum())
    assert st16["candidate_stats"]["4"]["raw_scores"][0] == pytest.approx(expect, rel=1e-5)
    with torch.no_grad():
        x = data[0]
        assert torch.equal(q16(x), _mlp()[4](u8[3](u8[2](u8[1](u8[0](x))))))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quantization_formats": [INT4]}, "cannot be combined with global quantization_formats"),
        ({"module_search_spaces": None}, "requires at least one module_search_spaces entry"),
        ({"constraints": {"effective_bits": 7}}, "below the least reachable, 7.8"),
    ],
)
def test_bad_fixed_config(kwargs, match):
    args = dict(
        constraints={"effective_bits": 16},
        quantization_formats=None,
        module_search_spaces=[{"module_name_patterns": ["4"], "quantization_formats": [INT4]}],
        fixed_quantization_config=INT8,
    )
    args.update(kwargs)
    count = _Counter()
    with pytest.raises(ValueError, match=match):
        auto_quantize(_mlp(), data_loader=_data(), forward_step=count, method="layer_error", **args)
    assert count.calls == 0
