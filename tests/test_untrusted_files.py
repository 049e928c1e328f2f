"""Files we load are untrusted: mtq.restore and load_real validate every entry and never import what a file names."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from state_files import edit_saved_tensors
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
    edit_saved_tensors(tmp_path / "q.safetensors", lambda t: t.__setitem__(key, value))
    if match is None:
        fresh = mtq.restore(_float_model(), tmp_path / "q")
        assert torch.equal(fresh[3].weight_quantizer._amax, torch.ones(3))
        return
    _restore_fails(tmp_path, r"restore: .*q.safetensors: " + (match if match.startswith("0.") else ".*" + match))


def test_restore_missing_and_unlisted_tensors(tmp_path):
    _saved(tmp_path)
    edit_saved_tensors(tmp_path / "q.safetensors", lambda t: t.pop("0.weight_quantizer._amax"))
    _restore_fails(tmp_path, r"q.safetensors: 0.weight_quantizer._amax: is missing from the tensor file")
    _saved(tmp_path)
    edit_saved_tensors(tmp_path / "q.safetensors", lambda t: t.__setitem__("0.stowaway", torch.ones(2)))
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
        edit_saved_tensors(
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
        # a key save does not write (a newer version's file, or a corrupted key: "bias" with one bit flipped)
        (lambda d: d["quantizers"]["0.input_quantizer"].__setitem__("bhas", None), r"has unknown key\(s\) \['bhas'\]"),
        (lambda d: d["modules"][0].__setitem__("extra", 1), r"modules\[0\]: has unknown key\(s\) \['extra'\]"),
        (lambda d: d.__setitem__("quantizer", {}), r"document: has unknown key\(s\) \['quantizer'\]"),
        (lambda d: d.__setitem__("tensors_sha256", "ABC"), r"tensors_sha256: must be 64 lowercase hex digits"),
        (lambda d: d.__setitem__("torch", 2), r"torch: must be a string, got 2"),
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
    _restore_fails(tmp_path, r"restore: .*q.safetensors is not the tensor file its JSON file was saved with")
    _edit_json(tmp_path / "q.json", lambda d: d.pop("tensors_sha256"))  # as files written before the record
    _restore_fails(tmp_path, r"restore: .*q.safetensors is not a readable safetensors file")
    (tmp_path / "q.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"q.safetensors"):
        mtq.restore(_float_model(), tmp_path / "q")


def test_restore_refuses_a_tensor_file_of_another_save_or_a_changed_one(tmp_path):
    """The JSON file records its tensor file's SHA-256: a pair mixed from two saves of the same model (same names,
    shapes and valid values, other amaxes) and a flipped bit in an amax are refused; a file from before the
    record restores."""
    _saved(tmp_path / "a")
    other = mtq.quantize(_float_model(), mtq.INT8_DEFAULT_CFG, lambda m: [m(torch.randn(4, 1, 8, 8) * 3)])
    mtq.save(other, tmp_path / "b" / "q")
    (tmp_path / "q.json").write_bytes((tmp_path / "a" / "q.json").read_bytes())
    good = (tmp_path / "a" / "q.safetensors").read_bytes()
    (tmp_path / "q.safetensors").write_bytes((tmp_path / "b" / "q.safetensors").read_bytes())
    _restore_fails(
        tmp_path, r"q.safetensors is not the tensor file its JSON file was saved with \(SHA-256 [0-9a-f]{64}"
    )
    flipped = bytearray(good)
    flipped[-3] ^= 0x01  # a low bit of the last amax's mantissa: still finite and positive
    (tmp_path / "q.safetensors").write_bytes(bytes(flipped))
    _restore_fails(tmp_path, r"a tensor file of another save, or a corrupted one")
    (tmp_path / "q.safetensors").write_bytes(good)
    _edit_json(tmp_path / "q.json", lambda d: d.pop("tensors_sha256"))
    assert mtq.restore(_float_model(), tmp_path / "q") is not None


def test_restore_refuses_a_tensor_file_of_another_format(tmp_path):
    _saved(tmp_path)
    tensors = load_file(str(tmp_path / "q.safetensors"))
    save_file(tensors, str(tmp_path / "q.safetensors"), metadata={"format": "pt", "version": "1"})
    _edit_json(tmp_path / "q.json", lambda d: d.pop("tensors_sha256"))
    _restore_fails(tmp_path, r"q.safetensors is not a modelopt_lite.quant_state v1 tensor file \(its metadata: ")


def test_include_weights_entries_are_checked(tmp_path):
    model = mtq.quantize(_float_model(), mtq.INT8_DEFAULT_CFG, lambda m: m(torch.randn(4, 1, 8, 8)))
    mtq.save(model, tmp_path / "q", include_weights=True)
    edit_saved_tensors(
        tmp_path / "q.safetensors", lambda t: t.__setitem__("__model__.0.weight", torch.ones(4, 1, 2, 2))
    )
    _restore_fails(tmp_path, r"__model__.0.weight: is torch.float32 \(4, 1, 2, 2\), the model has torch.float32")
    mtq.save(model, tmp_path / "q", include_weights=True)
    edit_saved_tensors(
        tmp_path / "q.safetensors", lambda t: t.__setitem__("__model__.0.input_quantizer._amax", torch.tensor(-1.0))
    )
    _restore_fails(tmp_path, r"__model__.0.input_quantizer._amax: differs from the quantizer's own entry")
    mtq.save(model, tmp_path / "q", include_weights=True)
    fresh = mtq.restore(_float_model(), tmp_path / "q")
    assert [n for n, _ in named_quantizers(fresh)] == [n for n, _ in named_quantizers(model)]


# --- real checkpoints (load_real) ------------------------------------------------------------------------------------
def _real_checkpoint(tmp_path):
    from modelopt_lite.real import fake2real

    torch.manual_seed(1)
    batches = [torch.randn(8, 1, 8, 8) for _ in range(2)]
    model = mtq.quantize(_float_model(), mtq.INT8_DEFAULT_CFG, lambda m: [m(b) for b in batches])
    return fake2real(model, tmp_path)


def _edit_checkpoint(tmp_path, edit_cfg=None, edit_tensors=None):
    from modelopt_lite.real import read_checkpoint

    cfg, tensors = read_checkpoint(tmp_path)
    if edit_cfg:
        edit_cfg(cfg)
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(tmp_path / "model_int8.safetensors"), metadata={"modelopt_lite": json.dumps(cfg)})
    (tmp_path / "model_int8.json").unlink(missing_ok=True)


def _load_fails(tmp_path, match):
    from modelopt_lite.real import load_real

    fresh = _float_model()
    types_before = [type(m) for m in fresh.modules()]
    with pytest.raises(ValueError, match=r"load_real: .*model_int8.safetensors: (modules\[.0.\]\.)?" + match):
        load_real(fresh, tmp_path)
    assert [type(m) for m in fresh.modules()] == types_before  # untouched


def test_load_real_valid_checkpoint(tmp_path):
    from modelopt_lite.real import load_real

    real = _real_checkpoint(tmp_path)
    _edit_checkpoint(tmp_path)  # rewritten unchanged: still loads
    loaded = load_real(_float_model(), tmp_path)
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(real(x), loaded(x))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("0.weight_scale", float("nan"), r"0.weight_scale: weight scales must be finite and > 0, got nan"),
        ("0.weight_scale", -0.5, r"0.weight_scale: weight scales must be finite and > 0, got -0.5"),
        ("0.weight_scale", 0.0, r"0.weight_scale: weight scales must be finite and > 0, got 0.0"),
        ("3.weight_scale", float("inf"), r"3.weight_scale: weight scales must be finite and > 0, got inf"),
        ("3.input_scale", float("inf"), r"3.input_scale: input scales must be finite and >= 0, got inf"),
        ("0.input_scale", -1.0, r"0.input_scale: input scales must be finite and >= 0, got -1.0"),
    ],
)
def test_load_real_rejects_bad_scales(tmp_path, key, value, match):
    _real_checkpoint(tmp_path)
    _edit_checkpoint(tmp_path, edit_tensors=lambda t: t[key].view(-1)[0].fill_(value))
    _load_fails(tmp_path, match)


def test_load_real_rejects_out_of_range_codes_and_wrong_dtypes(tmp_path):
    _real_checkpoint(tmp_path)

    def four_bits(cfg):
        cfg["modules"]["0"]["weight"]["num_bits"] = 4

    _edit_checkpoint(tmp_path, edit_cfg=four_bits)
    _load_fails(tmp_path, r"0.weight: weight codes must lie in \[-8, 7\], got -?\d+")
    _real_checkpoint(tmp_path)
    _edit_checkpoint(tmp_path, edit_tensors=lambda t: t.__setitem__("0.weight", t["0.weight"].to(torch.int16)))
    _load_fails(tmp_path, r"tensor '0.weight': checkpoint has torch.int16 \(4, 1, 3, 3\), the model expects torch.int8")
    _real_checkpoint(tmp_path)
    _edit_checkpoint(tmp_path, edit_tensors=lambda t: t.__setitem__("0.weight", t["0.weight"][:2].clone()))
    _load_fails(tmp_path, r"tensor '0.weight': checkpoint has torch.int8 \(2, 1, 3, 3\)")


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda c: c["modules"]["0"].__setitem__("type", "os.system"),
            r"modules\['0'\].type: unknown real module type",
        ),
        (lambda c: c["modules"]["3"].__setitem__("type", "QuantizedConv2d"), r"modules\['3'\]: is missing key\(s\)"),
        (lambda c: c["modules"]["0"].__setitem__("extra", 1), r"modules\['0'\]: has unknown key\(s\) \['extra'\]"),
        (lambda c: c["modules"]["0"]["weight"].__setitem__("layout", "diag"), r"weight.layout: must be 'tensor'"),
        (lambda c: c["modules"]["0"]["weight"].__setitem__("axis", [7]), r"modules\['0'\].weight: axis=\(7,\)"),
        (lambda c: c["modules"]["0"]["weight"].__setitem__("dtype", "object"), r"weight.dtype: must be one of"),
        (lambda c: c["modules"]["0"]["input"].__setitem__("num_steps", 10**12), r"0.input_scale: has shape \(1,\)"),
        (lambda c: c["modules"]["0"]["input"].__setitem__("num_bits", 99), r"input.num_bits: must be an int in 2..8"),
        (lambda c: c["modules"]["0"]["conv"].__setitem__("groups", 0), r"conv.groups: must be an int >= 1"),
        (lambda c: c["modules"]["0"]["conv"].__setitem__("stride", [2, 2]), r"modules\['0'\].conv: is .*Conv2d has"),
        (lambda c: c["modules"]["3"].__setitem__("bias", "int8"), r"modules\['3'\].bias: must be null or one of"),
        (lambda c: c.__setitem__("modules", []), r"modules: must be an object"),
    ],
)
def test_load_real_validates_every_spec_entry(tmp_path, edit, match):
    _real_checkpoint(tmp_path)
    _edit_checkpoint(tmp_path, edit_cfg=edit)
    _load_fails(tmp_path, match)


def test_load_real_refuses_changed_tensors(tmp_path):
    """save_real records its tensors' SHA-256: a code changed within its range (a flipped bit no value check can
    see) is refused; a checkpoint without the record (written before it existed) loads."""
    from safetensors import safe_open

    from modelopt_lite.real import load_real, read_checkpoint
    from modelopt_lite.real.checkpoint import DIGEST_KEY

    _real_checkpoint(tmp_path)
    path = tmp_path / "model_int8.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert len(meta[DIGEST_KEY]) == 64
    _, tensors = read_checkpoint(tmp_path)
    tensors["0.weight"].view(-1)[0] ^= 1  # int8 codes: still in [-128, 127]
    save_file(tensors, str(path), metadata=meta)
    _load_fails(tmp_path, r"its tensors do not have the SHA-256 recorded when it was saved")
    save_file(tensors, str(path), metadata={"modelopt_lite": meta["modelopt_lite"]})
    assert load_real(_float_model(), tmp_path) is not None


def test_load_real_rejects_corrupt_files(tmp_path):
    from modelopt_lite.real import load_real

    _real_checkpoint(tmp_path)
    path = tmp_path / "model_int8.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"load_real: .*model_int8.safetensors is not a readable safetensors file"):
        load_real(_float_model(), tmp_path)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model_int8.safetensors is not a readable safetensors file"):
        load_real(_float_model(), tmp_path)
    _real_checkpoint(tmp_path)
    from modelopt_lite.real import read_checkpoint

    _, tensors = read_checkpoint(tmp_path)
    save_file(tensors, str(path), metadata={"modelopt_lite": '{"format": "modelopt_lite.real", "version": 1, "mod'})
    with pytest.raises(ValueError, match=r"model_int8.safetensors: the config is not valid JSON"):
        load_real(_float_model(), tmp_path)
    save_file(tensors, str(path), metadata={"modelopt_lite": '{"format": "modelopt_lite.real", "version": NaN}'})
    with pytest.raises(ValueError, match=r"the config is not valid JSON \(the JSON literal NaN is not allowed"):
        load_real(_float_model(), tmp_path)
