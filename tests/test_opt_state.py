"""``modelopt_lite.opt`` (ModelOpt's ``modelopt.torch.opt`` for quantized models): the state layout, round trips,
the per-quantizer state API, ``export_amax``, and untrusted checkpoints refused with clear errors."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
import modelopt_lite.opt as mto
from modelopt_lite.descriptor import QuantDescriptor as QD
from modelopt_lite.nn import SequentialQuantizer, TensorQuantizer


def _mlp(hidden=16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _x() -> torch.Tensor:
    return torch.randn(32, 256, generator=torch.Generator().manual_seed(1))


def _quantized(cfg=None) -> nn.Module:
    x = _x()
    return mtq.quantize(_mlp(), cfg or mtq.INT8_DEFAULT_CFG, lambda m: m(x))


def test_modelopt_state_layout():
    state = mto.modelopt_state(_quantized())
    assert sorted(state) == ["modelopt_state_dict", "modelopt_version"] and state["modelopt_version"] == "0.47.0"
    ((mode, body),) = state["modelopt_state_dict"]
    assert mode == "quantize" and sorted(body) == ["config", "metadata"]
    qs = body["metadata"]["quantizer_state"]
    assert sorted(qs) == [f"{i}.{k}_quantizer" for i in (0, 2) for k in ("input", "output", "weight")]
    w = qs["0.weight_quantizer"]
    assert w["_num_bits"] == 8 and w["_axis"] == 0 and w["_block_sizes"] is None and w["_disabled"] is False
    assert w["_pytorch_state_metadata"] == {
        "params": {},
        "buffers": {"_amax": {"shape": torch.Size([16, 1]), "dtype": torch.float32}},
    }
    assert qs["0.output_quantizer"]["_disabled"] is True
    assert mto.modelopt_state(_mlp())["modelopt_state_dict"] == []


@pytest.mark.parametrize("cfg", ["INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "W4A8_CFG"])
def test_save_restore_round_trip_is_exact(cfg, tmp_path):
    model = _quantized(getattr(mtq, cfg))
    mto.save(model, tmp_path / "m.pth")
    torch.load(tmp_path / "m.pth", weights_only=True)  # loadable without unpickling any class
    back = mto.restore(_mlp(), tmp_path / "m.pth")
    x = _x()
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    assert str(back) == str(model)
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b) and a.dtype == b.dtype


def test_restore_from_state_then_load_state_dict_takes_the_flat_block_layout():
    model = _quantized(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    fresh = mto.restore_from_modelopt_state(_mlp(), mto.modelopt_state(model))
    wq = fresh[0].weight_quantizer
    assert tuple(wq._amax.shape) == (16, 2) and float(wq._amax.abs().sum()) == 0.0
    sd = dict(model.state_dict())
    sd["0.weight_quantizer._amax"] = sd["0.weight_quantizer._amax"].reshape(32, 1)  # ModelOpt's layout
    fresh.load_state_dict(sd)
    assert torch.equal(fresh[0].weight_quantizer.amax, model[0].weight_quantizer.amax)
    x = _x()
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_sequential_quantizer_round_trips(tmp_path):
    model = _quantized()
    seq = SequentialQuantizer(TensorQuantizer(QD(num_bits=4, block_sizes={-1: 128})), TensorQuantizer(QD((4, 3))))
    model[0].weight_quantizer = seq
    with mtq.calibrate(model):
        model(_x())
    st = mto.modelopt_state(model)["modelopt_state_dict"][0][1]["metadata"]["quantizer_state"]
    assert st["0.weight_quantizer"] == {"num_quantizers": 2, "is_sequential_quantizer": True}
    mto.save(model, tmp_path / "s.pth")
    back = mto.restore(_mlp(), tmp_path / "s.pth")
    assert isinstance(back[0].weight_quantizer, SequentialQuantizer) and len(back[0].weight_quantizer) == 2
    with torch.no_grad():
        assert torch.equal(back(_x()), model(_x()))


def test_quantizer_state_api_and_export_amax():
    q = TensorQuantizer(QD(num_bits=4, axis=0, unsigned=True, calib_method="histogram"), amax=[1.0, 0.0, 2.0])
    st = q.get_modelopt_state()
    assert st["_num_bits"] == 4 and st["_unsigned"] is True and st["_axis"] == 0
    assert st["_modelopt_lite"]["calib_method"] == "histogram"
    assert "_pytorch_state_metadata" not in q.get_modelopt_state(properties_only=True)
    other = TensorQuantizer()
    other.set_from_modelopt_state(st)
    assert other.quant_desc == q.quant_desc and tuple(other._amax.shape) == (3,)
    with pytest.warns(RuntimeWarning, match="1/3 amax entries are zero"):
        e = q.export_amax()
    assert torch.equal(e, torch.tensor([1.0, 15.0, 2.0])) and torch.equal(q.amax, torch.tensor([1.0, 0.0, 2.0]))
    assert torch.equal(TensorQuantizer(amax=3.0).export_amax(), torch.tensor([3.0]))
    assert TensorQuantizer().export_amax() is None
    with pytest.raises(ValueError, match=r"unknown modelopt quantizer state key\(s\) \['_evil'\]"):
        other.set_from_modelopt_state({**st, "_evil": 1})
    with pytest.raises(ValueError, match="_rotate"):
        other.set_from_modelopt_state({**st, "_rotate": True})
    with pytest.raises(ValueError, match="num_bits"):
        other.set_from_modelopt_state({**st, "_num_bits": 99})
    assert other.quant_desc == q.quant_desc  # unchanged by the refused states


# --- untrusted checkpoints ---------------------------------------------------------------------------------------------
def _ckpt(tmp_path):
    model = _quantized()
    path = tmp_path / "m.pth"
    mto.save(model, path)
    return path, torch.load(path, weights_only=True)


def _refused(tmp_path, ckpt, match, model=None):
    bad = tmp_path / "bad.pth"
    torch.save(ckpt, bad)
    target = model if model is not None else _mlp()
    before = str(target)
    with pytest.raises(ValueError, match=match):
        mto.restore(target, bad)
    assert str(target) == before  # left unchanged


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled!",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_corrupt_or_unsafe_files_are_refused(tmp_path):
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"\x00not a torch file at all")
    with pytest.raises(ValueError, match=r"does not load with torch.load\(weights_only=True\)"):
        mto.restore(_mlp(), junk)
    evil = tmp_path / "evil.pth"
    with open(evil, "wb") as fh:
        pickle.dump({"modelopt_state": _Payload(), "model_state_dict": {}}, fh)
    with pytest.raises(ValueError, match="weights_only"):
        mto.restore(_mlp(), evil)
    path, _ = _ckpt(tmp_path)
    data = path.read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="does not load"):
        mto.restore(_mlp(), tmp_path / "cut.pth")
    with pytest.raises(FileNotFoundError):
        mto.restore(_mlp(), tmp_path / "nope.pth")


def test_bad_states_are_refused(tmp_path):
    _, ck = _ckpt(tmp_path)
    st = ck["modelopt_state"]
    qs = st["modelopt_state_dict"][0][1]["metadata"]["quantizer_state"]

    def variant(**changes):
        q2 = {**qs, **changes}
        return {
            **ck,
            "modelopt_state": {
                **st,
                "modelopt_state_dict": [("quantize", {"config": {}, "metadata": {"quantizer_state": q2}})],
            },
        }

    _refused(
        tmp_path,
        {**ck, "modelopt_state": {**st, "modelopt_state_dict": [("sparsegpt", {"metadata": {}})]}},
        "mode 'sparsegpt' is not supported",
    )
    _refused(tmp_path, {**ck, "modelopt_state": {"modelopt_state_dict": []}}, "modelopt_version")
    _refused(tmp_path, {"model_state_dict": {}}, "modelopt_state.*is missing")
    _refused(
        tmp_path,
        variant(**{"0.weight_quantizer": {**qs["0.weight_quantizer"], "_num_bits": "8"}}),
        "0.weight_quantizer",
    )
    _refused(tmp_path, variant(**{"0.weight_quantizer": {**qs["0.weight_quantizer"], "_axis": 5}}), "axis")
    _refused(tmp_path, variant(**{"0.weight_quantizer": {**qs["0.weight_quantizer"], "_disabled": "no"}}), "_disabled")
    extra = {**qs, "1.input_quantizer": qs["0.input_quantizer"]}
    _refused(tmp_path, variant(**extra), "ReLU.*has no registered quantized class")
    fewer = {k: v for k, v in qs.items() if k != "2.output_quantizer"}
    q_only = {
        **ck,
        "modelopt_state": {**st, "modelopt_state_dict": [("quantize", {"metadata": {"quantizer_state": fewer}})]},
    }
    _refused(tmp_path, q_only, "the model has quantizer '2.output_quantizer', which the state does not list")


def test_bad_tensors_are_refused(tmp_path):
    _, ck = _ckpt(tmp_path)
    sd = ck["model_state_dict"]
    key = "0.weight_quantizer._amax"
    for value, match in [
        (-sd[key], "amax must be >= 0"),
        (torch.full_like(sd[key], float("nan")), "must be finite"),
        (sd[key].double(), "must be float32"),
        (sd[key][:8], "does not fit"),
    ]:
        _refused(tmp_path, {**ck, "model_state_dict": {**sd, key: value}}, match)
    _refused(
        tmp_path,
        {**ck, "model_state_dict": {k: v for k, v in sd.items() if k != key}},
        "is missing from the checkpoint",
    )
    _refused(
        tmp_path, {**ck, "model_state_dict": {**sd, "0.weight": sd["0.weight"].half()}}, "0.weight: is torch.float16"
    )
    _refused(tmp_path, {**ck, "model_state_dict": {**sd, "9.weight": sd["0.weight"]}}, "9.weight: has no place")
    _refused(tmp_path, {**ck, "model_state_dict": collections.OrderedDict(sd, x=1)}, "must be a tensor")
    _refused(tmp_path, ck, r"axis=0 of a weight \(8, 256\) needs an amax of shape \(8, 1\)", _mlp(8))
