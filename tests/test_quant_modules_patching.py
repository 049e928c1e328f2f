"""quant_modules.initialize / deactivate / enable always restore torch.nn (no accumulated state)."""

import pytest
import torch
from torch import nn

from modelopt_lite import quant_modules, quant_nn

ORIG = {name: getattr(nn, name) for _, name, _ in quant_modules.DEFAULT_QUANT_MAP}


@pytest.fixture(autouse=True)
def _always_restore():
    yield
    quant_modules.deactivate()
    for name, cls in ORIG.items():
        setattr(nn, name, cls)


def _all_original():
    return all(getattr(nn, n) is c for n, c in ORIG.items())


def test_initialize_and_deactivate():
    quant_modules.initialize()
    assert nn.Linear is quant_nn.QuantLinear and nn.Conv2d is quant_nn.QuantConv2d and nn.LSTM is quant_nn.QuantLSTM
    m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 2))
    assert isinstance(m[0], quant_nn.QuantConv2d) and isinstance(m[3], quant_nn.QuantLinear)
    assert "MaxPool2d" not in quant_modules.active() and nn.MaxPool2d.__module__.startswith("torch")
    assert len(quant_modules.active()) == 15
    quant_modules.deactivate()
    assert _all_original() and quant_modules.active() == {}
    quant_modules.deactivate()  # no-op
    assert _all_original()


def test_initialize_twice_then_deactivate_once_restores_originals():
    quant_modules.initialize()
    quant_modules.initialize(float_module_list=["LSTM"])
    assert nn.LSTM is ORIG["LSTM"] and nn.Linear is quant_nn.QuantLinear
    quant_modules.deactivate()
    assert _all_original()


def test_deny_list_and_custom_map():
    class MyQuantLinear(quant_nn.QuantLinear):
        pass

    quant_modules.initialize(
        float_module_list=[nn.Linear, "Conv2d"], custom_quant_modules=[(torch.nn, "Linear", MyQuantLinear)]
    )
    assert nn.Linear is MyQuantLinear  # the custom map overrides the deny list
    assert nn.Conv2d is ORIG["Conv2d"] and nn.Conv1d is quant_nn.QuantConv1d
    quant_modules.deactivate()
    assert _all_original()
    with pytest.raises(TypeError, match="custom_quant_modules"):
        quant_modules.initialize(custom_quant_modules=[(torch.nn, "NoSuchLayer", MyQuantLinear)])
    assert _all_original()  # validated before anything is patched
    with pytest.raises(TypeError, match="float_module_list"):
        quant_modules.initialize(float_module_list=[3])


def test_enable_restores_on_exception_and_nesting():
    with pytest.raises(RuntimeError, match="boom"), quant_modules.enable():
        assert nn.Linear is quant_nn.QuantLinear
        raise RuntimeError("boom")
    assert _all_original()
    quant_modules.initialize(float_module_list=["Conv2d"])
    with quant_modules.enable():
        assert nn.Conv2d is quant_nn.QuantConv2d
        with quant_modules.enable(float_module_list=["Linear"]):
            assert nn.Linear is ORIG["Linear"]
        assert nn.Linear is quant_nn.QuantLinear and nn.Conv2d is quant_nn.QuantConv2d
    assert nn.Conv2d is ORIG["Conv2d"] and nn.Linear is quant_nn.QuantLinear  # the outer initialize() again
    quant_modules.deactivate()
    assert _all_original()
    for _ in range(3):
        with quant_modules.enable():
            pass
    assert _all_original()
