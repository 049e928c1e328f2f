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
    assert QUANT_DESC_8BIT_CONV2D_WEIGHT_PER_CHANNEL.axis == (0,)


def test_block_helper():
    assert ScaledQuantDescriptor.get_block_quant_axes_and_sizes({-1: 16, "type": "static"}) == {-1: 16}


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        ({"bogus": 1, "other": 2}, TypeError, "bogus, other"),
        ({"num_bits": 17}, ValueError, "1..16, got 17"),
        ({"num_bits": (5, 2)}, ValueError, r"\(4, 3\)"),
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
