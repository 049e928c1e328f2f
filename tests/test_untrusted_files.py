"""Files we load are untrusted: mtq.restore and load_real validate every entry and never import what a file names."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.conversion.utils import named_quantizers


def _float_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _saved(tmp_path):
    torch.manual_seed(1)
    batches = [torch.randn(8, 1, 8, 8) for _ in range(2)]
    model = mtq.quantize(_float_model(), mtq.INT8_DEFAULT_CFG, lambda m: [m(b) for b in batches])
    j, s = mtq.save(model, tmp_path / "q")
    return model, j, s


def _edit_tensors(path, fn):
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def _edit_json(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _restore_fails(tmp_path, match):
    fresh = _float_model()
    types_before = [type(m) for m in fresh.modules()]
    with pytest.raises(ValueError, match=match):
        mtq.restore(fresh, tmp_path / "q")
    assert [type(m) for m in fresh.modules()] == types_before  # untouched
    return fresh


def test_valid_files_restore(tmp_path):
    model, _, _ = _saved(tmp_path)
    fresh = mtq.restore(_float_model(), tmp_path / "q")
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


@pytest.mark.parametrize(
    "key, value, match",
    [
        # a per-channel weight amax replaced by one value would silently quantize per tensor
        ("0.weight_quantizer._amax", torch.ones(()), r"0.weight_quantizer._amax: shape \(\) does not fit: axis=0"),
        ("0.weight_quantizer._amax", torch.ones(1), r"shape \(1,\) does not fit: axis=0 of a weight \(4, 1, 3, 3\)"),
        ("0.weight_quantizer._amax", torch.ones(2, 1, 1, 1), r"needs an amax of shape \(4, 1, 1, 1\)"),
        ("3.weight_quantizer._amax", torch.ones(3), None),  # the flat form of (3, 1) is the same granularity
        ("0.input_quantizer._amax", torch.ones(4), r"0.input_quantizer._amax: .*a per-tensor quantizer needs a single"),
        ("0.input_quantizer._amax", torch.tensor(float("nan")), r"0.input_quantizer._amax: must be finite, got nan"),
        ("0.input_quantizer._amax", torch.tensor(float("inf")), r"must be finite, got inf"),
        ("0.input_quantizer._amax", torch.tensor(-2.0), r"0.input_quantizer._amax: amax must be >= 0, got -2.0"),
        ("0.input_quantizer._amax", torch.tensor(2.0, dtype=torch.float16), r"must be float32, got torch.float16"),
        ("0.input_quantizer._amax", torch.tensor(2, dtype=torch.int32), r"must be float32, got torch.int32"),
    ],
)
def test_restore_validates_every_amax(tmp_path, key, value, match):
    _saved(tmp_path)
    _edit_tensors(tmp_path / "q.safetensors", lambda t: t.__setitem__(key, value))
    if match is None:
        fresh = mtq.restore(_float_model(), tmp_path / "q")
        assert torch.equal(fresh[3].weight_quantizer._amax, torch.ones(3))
        return
    _restore_fails(tmp_path, r"restore: .*q.safetensors: " + (match if match.startswith("0.") else ".*" + match))


def test_restore_missing_and_unlisted_tensors(tmp_path):
    _saved(tmp_path)
    _edit_tensors(tmp_path / "q.safetensors", lambda t: t.pop("0.weight_quantizer._amax"))
    _restore_fails(tmp_path, r"q.safetensors: 0.weight_quantizer._amax: is missing from the tensor file")
    _saved(tmp_path)
    _edit_tensors(tmp_path / "q.safetensors", lambda t: t.__setitem__("0.stowaway", torch.ones(2)))
    _restore_fails(tmp_path, r"q.safetensors: 0.stowaway: is not listed by any quantizer")


def test_restore_validates_pre_quant_scale(tmp_path):
    _saved(tmp_path)

    def add_pqs(doc):
        doc["quantizers"]["3.input_quantizer"]["tensors"].append("_pre_quant_scale")

    _edit_json(tmp_path / "q.json", add_pqs)
    for bad, match in [
        (torch.full((144,), -1.0), r"3.input_quantizer._pre_quant_scale: must be > 0, got -1.0"),
        (torch.full((144,), float("inf")), r"3.input_quantizer._pre_quant_scale: must be finite, got inf"),
        (torch.ones(7), r"3.input_quantizer._pre_quant_scale: has 7 channels, the layer has 144 inputs"),
        (torch.ones(12, 12), r"must be 1-D"),
    ]:
        _edit_tensors(
            tmp_path / "q.safetensors", lambda t, bad=bad: t.__setitem__("3.input_quantizer._pre_quant_scale", bad)
        )
        _restore_fails(tmp_path, match)


def test_restore_never_imports_a_class_the_file_names(tmp_path, monkeypatch):
    (tmp_path / "h2_evil_module.py").write_text(
        "import torch\nIMPORTED = True\nclass Evil(torch.nn.Linear):\n"
        "    @classmethod\n    def from_float(cls, m):\n        raise SystemExit('evil code ran')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _saved(tmp_path)

    def evil(doc):
        doc["modules"][1]["quant_cls"] = "h2_evil_module.Evil"

    _edit_json(tmp_path / "q.json", evil)
    _restore_fails(
        tmp_path,
        r"q.json: module '3': quant_cls 'h2_evil_module.Evil' is not the class registered for "
        r"torch.nn.modules.linear.Linear \(modelopt_lite.nn.modules.quant_linear.QuantLinear\)",
    )
    assert "h2_evil_module" not in sys.modules


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda d: d["quantizers"]["0.input_quantizer"].__setitem__("num_steps", "2"),
            r"num_steps: must be an int >= 1",
        ),
        (lambda d: d["quantizers"]["0.input_quantizer"].__setitem__("enabled", 1), r"\.enabled: must be true or false"),
        (
            lambda d: d["quantizers"]["0.input_quantizer"].__setitem__("tensors", ["weight"]),
            r"\.tensors: must be a list",
        ),
        (lambda d: d["quantizers"]["0.input_quantizer"].__setitem__("descriptor", {"num_bits": "x"}), r"descriptor: "),
        (lambda d: d["quantizers"]["0.input_quantizer"].__setitem__("descriptor", {"axis": {"__tuple__": 3}}), "tuple"),
        (lambda d: d["modules"][0].__setitem__("params", {"weight": "big"}), r"modules\[0\].params: must map"),
        (lambda d: d["modules"][0].pop("quant_cls"), r"modules\[0\].quant_cls: must be a string, got None"),
        (lambda d: d["modules"][0].__setitem__("requant", "rm -rf"), r"modules\[0\].requant: requant must be one of"),
        (lambda d: d.__setitem__("modules", {}), r"modules: must be a list, got dict"),
    ],
)
def test_restore_validates_json_entries(tmp_path, edit, match):
    _saved(tmp_path)
    _edit_json(tmp_path / "q.json", edit)
    _restore_fails(tmp_path, r"restore: .*q.json: .*" + match)


def test_restore_rejects_corrupt_files(tmp_path):
    _saved(tmp_path)
    text = (tmp_path / "q.json").read_text()
    (tmp_path / "q.json").write_text(text[: len(text) // 2])
    _restore_fails(tmp_path, r"restore: .*q.json is not valid JSON")
    (tmp_path / "q.json").write_text(text.replace('"format"', '"amax": NaN, "format"'))
    _restore_fails(tmp_path, r"restore: .*q.json is not valid JSON \(the JSON literal NaN is not allowed")
    (tmp_path / "q.json").write_text(text)
    data = (tmp_path / "q.safetensors").read_bytes()
    (tmp_path / "q.safetensors").write_bytes(data[: len(data) - 10])
    _restore_fails(tmp_path, r"restore: .*q.safetensors is not a readable safetensors file")
    (tmp_path / "q.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"q.safetensors"):
        mtq.restore(_float_model(), tmp_path / "q")


def test_include_weights_entries_are_checked(tmp_path):
    model = mtq.quantize(_float_model(), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 1, 8, 8)))
    mtq.save(model, tmp_path / "q", include_weights=True)
    _edit_tensors(tmp_path / "q.safetensors", lambda t: t.__setitem__("__model__.0.weight", torch.ones(4, 1, 2, 2)))
    _restore_fails(tmp_path, r"__model__.0.weight: is torch.float32 \(4, 1, 2, 2\), the model has torch.float32")
    mtq.save(model, tmp_path / "q", include_weights=True)
    _edit_tensors(
        tmp_path / "q.safetensors", lambda t: t.__setitem__("__model__.0.input_quantizer._amax", torch.tensor(-1.0))
    )
    _restore_fails(tmp_path, r"__model__.0.input_quantizer._amax: differs from the quantizer's own entry")
    mtq.save(model, tmp_path / "q", include_weights=True)
    fresh = mtq.restore(_float_model(), tmp_path / "q")
    assert [n for n, _ in named_quantizers(fresh)] == [n for n, _ in named_quantizers(model)]
