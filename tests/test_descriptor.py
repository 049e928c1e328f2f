import numpy as np
import pytest

from modelopt_lite.descriptor import (
    QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL,
    QuantDescriptor,
    ScaledQuantDescriptor,
)


def test_alias_and_defaults():
    assert QuantDescriptor is ScaledQuantDescriptor
    d = QuantDescriptor()
    assert (d.num_bits, d.axis, d.unsigned, d.narrow_range, d.fake_quant, d.dynamic) == (
        8,
        None,
        False,
        False,
        True,
        False,
    )
    assert d.dict() == {}


def test_dict_round_trip_and_equality():
    d = QuantDescriptor(num_bits=4, axis=(0, -1), amax=[1.0, 2.0], learn_amax=True, unsigned=True, name="w")
    dd = d.dict()
    assert dd == {"num_bits": 4, "name": "w", "axis": (0, -1), "amax": [1.0, 2.0], "learn_amax": True, "unsigned": True}
    assert QuantDescriptor(**dd) == d and hash(QuantDescriptor(**dd)) == hash(d)
    assert QuantDescriptor(num_bits=4) != QuantDescriptor(num_bits=5)
    b = QuantDescriptor(num_bits=4, block_sizes={-1: 32, "type": "dynamic", "scale_bits": 8})
    assert QuantDescriptor(**b.dict()) == b and b.dynamic


def test_immutable_and_amax_readonly():
    d = QuantDescriptor(amax=3.0)
    with pytest.raises(AttributeError, match="immutable"):
        d.num_bits = 4
    assert d.amax.dtype == np.float32
    with pytest.raises(ValueError):
        d.amax[...] = 1.0
    assert QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL.axis == 0  # the peers report an int (issue 26)


def test_block_helper():
    assert ScaledQuantDescriptor.get_block_quant_axes_and_sizes({-1: 16, "type": "static"}) == {-1: 16}


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        ({"bogus": 1, "other": 2}, TypeError, "bogus, other"),
        ({"num_bits": 17}, ValueError, "1..16, got 17"),
        ({"num_bits": (3, 4)}, ValueError, r"\(4, 3\)"),
        ({"num_bits": (8, 0)}, ValueError, "E8M0"),
        ({"num_bits": 1}, ValueError, "unsigned"),
        ({"axis": 0, "block_sizes": {-1: 16}}, ValueError, "mutually exclusive"),
        ({"amax": -1.0}, ValueError, "-1.0"),
        ({"amax": float("nan")}, ValueError, "nan"),
        ({"learn_amax": True, "dynamic": True}, ValueError, "dynamic"),
        ({"num_bits": (4, 3), "unsigned": True}, ValueError, "E4M3"),
        ({"calib_method": "entropy"}, ValueError, "calib_method"),
        ({"block_sizes": {-1: 0}}, ValueError, "positive"),
        ({"block_sizes": {-1: 8, "type": "weird"}}, ValueError, "static"),
        ({"axis": (1, 1)}, ValueError, "repeated"),
        ({"scale_amax": 0.0}, ValueError, "scale_amax"),
        ({"fake_quant": 1}, TypeError, "fake_quant"),
    ],
)
def test_errors(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        QuantDescriptor(**kwargs)


# --- peer compatibility (issue 14) and a read-only block_sizes (issue 13) ----------------------------------------------
def test_enable_field_and_axis_kept_as_given():
    d = QuantDescriptor(enable=False, num_bits=4)
    assert d.enable is False and QuantDescriptor().enable is True
    assert d.dict() == {"num_bits": 4, "enable": False} and QuantDescriptor(**d.dict()) == d
    assert d != QuantDescriptor(num_bits=4)
    with pytest.raises(TypeError, match="enable must be a bool"):
        QuantDescriptor(enable=0)
    assert QuantDescriptor(axis=0).axis == 0 and isinstance(QuantDescriptor(axis=0).axis, int)
    assert QuantDescriptor(axis=(0,)).axis == (0,)
    assert QuantDescriptor(axis=(1, -1)).axis == (1, -1)
    assert QuantDescriptor(axis=[1, 2]).axis == (1, 2)  # a list becomes a tuple (hashable)


def test_quantizer_built_from_a_disabled_descriptor_starts_disabled():
    import torch

    from modelopt_lite.nn import TensorQuantizer

    q = TensorQuantizer(QuantDescriptor(enable=False))
    x = torch.tensor([0.3, -1.0])
    assert not q.is_enabled and q(x) is x
    q.set_from_attribute_config({"enable": True})
    assert q.is_enabled and q.quant_desc.enable is True
    q.set_from_attribute_config({"enable": False})
    assert not q.is_enabled and q.quant_desc.enable is False


@pytest.mark.parametrize(
    "field", ["num_bits", "name", "fake_quant", "axis", "block_sizes", "amax", "learn_amax", "scale_amax", "enable"]
)
def test_every_field_is_read_only(field):
    d = QuantDescriptor(num_bits=4, axis=0, name="w")
    before = hash(d)
    with pytest.raises(AttributeError, match="immutable"):
        setattr(d, field, None)
    with pytest.raises(AttributeError, match="immutable"):
        delattr(d, f"_{field}")
    assert hash(d) == before and d.num_bits == 4 and d.axis == 0


def test_block_sizes_cannot_be_mutated_from_outside():
    spec = {-1: 16, "type": "static", "scale_bits": 8, "scale_block_sizes": {-1: 4}}
    d = QuantDescriptor(num_bits=4, block_sizes=spec)
    h, key = hash(d), d.dict()
    spec[-1] = 32  # the caller's dict was copied
    spec["scale_block_sizes"][-1] = 2
    bs = d.block_sizes
    assert bs == {-1: 16, "type": "static", "scale_bits": 8, "scale_block_sizes": {-1: 4}} and isinstance(bs, dict)
    for mutate in (
        lambda: bs.__setitem__(-1, 32),
        lambda: bs.__delitem__("type"),
        lambda: bs.update({-1: 8}),
        lambda: bs.pop(-1),
        lambda: bs.setdefault(0, 4),
        lambda: bs.clear(),
        lambda: bs.popitem(),
        lambda: bs["scale_block_sizes"].__setitem__(-1, 99),  # the nested dict too
    ):
        with pytest.raises(TypeError, match="read-only"):
            mutate()
    with pytest.raises(TypeError, match="read-only"):
        bs |= {0: 2}
    assert hash(d) == h and d.dict() == key and d.block_sizes[-1] == 16
    assert d == QuantDescriptor(
        num_bits=4, block_sizes={-1: 16, "scale_bits": 8, "scale_block_sizes": {-1: 4}, "type": "static"}
    )
    # what dict() returns is a plain, mutable copy
    out = d.dict()["block_sizes"]
    out[-1] = 1
    out["scale_block_sizes"][-1] = 1
    assert type(out) is dict and d.block_sizes[-1] == 16 and d.block_sizes["scale_block_sizes"] == {-1: 4}
    copy_ = dict(d.block_sizes)
    copy_[-1] = 64
    assert QuantDescriptor(num_bits=4, block_sizes=copy_).block_sizes[-1] == 64


def test_descriptor_copies_pickles_and_dumps():
    import copy
    import json
    import pickle

    d = QuantDescriptor(num_bits=4, block_sizes={-1: 8, "scale_bits": (4, 3)}, amax=None, name="w")
    assert copy.deepcopy(d) == d and copy.copy(d) == d
    back = pickle.loads(pickle.dumps(d))
    assert back == d and hash(back) == hash(d) and back.block_sizes == {-1: 8, "scale_bits": (4, 3)}
    assert json.loads(json.dumps(d.block_sizes)) == {"-1": 8, "scale_bits": [4, 3]}
    assert pickle.loads(pickle.dumps(d.block_sizes)) == d.block_sizes


@pytest.mark.parametrize(
    "desc",
    [
        QuantDescriptor(),
        QuantDescriptor(num_bits=4, axis=(0, -1), amax=[1.0, 2.5], learn_amax=True, unsigned=True, name="w"),
        QuantDescriptor(num_bits=(4, 3), axis=1, enable=False, scale_amax=0.5, calib_method="histogram"),
        QuantDescriptor(num_bits=4, block_sizes={-1: 32, "type": "dynamic", "scale_bits": (4, 3)}),
        QuantDescriptor(num_bits=4, block_sizes={-1: 16, "scale_bits": 8, "scale_block_sizes": {-1: 4}}),
        QuantDescriptor(dynamic=True, narrow_range=True, fake_quant=False),
    ],
)
def test_yaml_round_trip(desc):
    text = desc.to_yaml()
    assert "!!python" not in text  # plain YAML, loadable by safe_load anywhere
    back = QuantDescriptor.from_yaml(text)
    assert back == desc and hash(back) == hash(desc) and back.dict() == desc.dict()
    assert type(back.axis) is type(desc.axis)


def test_yaml_values_and_errors():
    d = QuantDescriptor.from_yaml("num_bits: 4\naxis: 0\nenable: false\nblock_sizes: null\n")
    assert (d.num_bits, d.axis, d.enable) == (4, 0, False)
    assert QuantDescriptor.from_yaml("") == QuantDescriptor()
    assert QuantDescriptor(num_bits=(4, 3)).to_yaml() == "num_bits:\n- 4\n- 3\n"
    with pytest.raises(TypeError, match="mapping of descriptor fields, got list"):
        QuantDescriptor.from_yaml("- 1\n- 2\n")
    with pytest.raises(TypeError, match="unknown keyword argument.*bogus"):
        QuantDescriptor.from_yaml("bogus: 1\n")
    with pytest.raises(ValueError, match="1..16, got 99"):
        QuantDescriptor.from_yaml("num_bits: 99\n")
    with pytest.raises(ValueError, match="not valid YAML"):  # no Python objects from untrusted text
        QuantDescriptor.from_yaml("num_bits: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(TypeError, match="as a str"):
        QuantDescriptor.from_yaml(b"num_bits: 4")


def test_yaml_missing_gives_an_install_hint(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(ImportError, match="pip install pyyaml"):
        QuantDescriptor().to_yaml()
    with pytest.raises(ImportError, match="pip install pyyaml"):
        QuantDescriptor.from_yaml("num_bits: 4\n")


def test_convtranspose_per_channel_constants_mean_the_output_channel_axis():
    """ConvTranspose weights are (in, out/groups, *k): the per-channel constants and the modules' default are axis 1."""
    from torch import nn

    from modelopt_lite import quant_nn
    from modelopt_lite.descriptor import (
        QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL,
        QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL,
        QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL,
    )

    for desc in (
        QUANT_DESC_8BIT_CONVTRANSPOSE1D_WEIGHT_PER_CHANNEL,
        QUANT_DESC_8BIT_CONVTRANSPOSE2D_WEIGHT_PER_CHANNEL,
        QUANT_DESC_8BIT_CONVTRANSPOSE3D_WEIGHT_PER_CHANNEL,
    ):
        assert desc.axis == 1
    m = quant_nn.QuantConvTranspose2d(3, 5, 2)
    m.weight_quantizer(m.weight)  # uncalibrated: the input's own max per output channel
    w = m.weight.detach()
    assert m.weight_quantizer.axis == 1
    assert tuple(w.shape) == (3, 5, 2, 2)
    assert isinstance(m, nn.ConvTranspose2d)


def test_presets_leave_embeddings_float():
    import torch
    from torch import nn

    import modelopt_lite as mtq

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    ids = torch.tensor([[1, 2, 3]])
    ref = model(ids)
    q = mtq.quantize(model, mtq.INT8_DEFAULT_CFG, lambda m: m(ids))
    assert not q[0].weight_quantizer.is_enabled
    assert torch.equal(q[0](ids), nn.functional.embedding(ids, model[0].weight))
    assert q[1].weight_quantizer.is_enabled and ref.shape == q(ids).shape
