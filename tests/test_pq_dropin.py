"""pytorch-quantization drop-in names (issue 26): ``utils.reduce_amax``, ``optim.helper``,
``quant_modules.QuantModuleReplacementHelper``."""

import pytest
import torch
from torch import nn

from modelopt_lite import quant_modules, quant_nn
from modelopt_lite import utils as quant_utils
from modelopt_lite.optim import helper


# --- utils.reduce_amax -------------------------------------------------------------------------------------------
def test_reduce_amax_values_shapes_and_errors():
    x = torch.tensor([[1.0, -5.0, 2.0], [-0.5, 0.25, 3.0]])
    full = quant_utils.reduce_amax(x)
    assert full.shape == () and full.item() == 5.0
    rows = quant_utils.reduce_amax(x, axis=1)
    assert rows.shape == (2, 1) and rows.dtype == torch.float32
    assert torch.equal(rows, torch.tensor([[5.0], [3.0]]))
    cols = quant_utils.reduce_amax(x, axis=(0,), keepdims=False)
    assert torch.equal(cols, torch.tensor([1.0, 5.0, 3.0]))
    assert torch.equal(quant_utils.reduce_amax(x, axis=-1), rows)
    assert torch.equal(x, torch.tensor([[1.0, -5.0, 2.0], [-0.5, 0.25, 3.0]]))  # input untouched
    with pytest.raises(ValueError, match="Cannot reduce more axes"):
        quant_utils.reduce_amax(x, axis=(0, 1, 2))
    with pytest.raises(ValueError, match="out of range"):
        quant_utils.reduce_amax(x, axis=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quant_utils.reduce_amax([1.0, 2.0])


# --- optim.helper ------------------------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = quant_nn.QuantConv2d(1, 2, 3)
        self.block = nn.Sequential(nn.Linear(4, 4), quant_nn.QuantLinear(4, 3))
        self.head = nn.Linear(3, 2, bias=False)


def test_match_parameters_searches_names():
    net = _Net()
    assert [p.shape for p in helper.match_parameters(net, ["conv1"])] == [(2, 1, 3, 3), (2,)]
    assert len(list(helper.match_parameters(net, ["weight$"]))) == 4
    assert len(list(helper.match_parameters(net, ["^block", "bias"]))) == 5  # each parameter once
    assert not list(helper.match_parameters(net, ["wei$"]))
    with pytest.raises(TypeError, match="list of regular expression"):
        list(helper.match_parameters(net, "conv1"))


def test_group_parameters_and_optimizer():
    net = _Net()
    groups = helper.group_parameters(net, [["conv1"], ["block.1"]], lrs=[0.1, 0.01], weight_decays=[0.0, 1e-4])
    assert [len(g["params"]) for g in groups] == [2, 2]
    assert groups[0]["lr"] == 0.1 and groups[1]["weight_decay"] == 1e-4 and "momentum" not in groups[0]
    torch.optim.SGD(groups, lr=1.0).step()
    with pytest.raises(TypeError, match="must be list of list of patterns"):
        helper.group_parameters(None, [["conv1"], "head"])
    with pytest.raises(TypeError, match=r"len\(momentums\) must match"):
        helper.group_parameters(None, [["conv1"], ["head"]], momentums=[0.9])


def test_freeze_parameters():
    net = _Net()
    helper.freeze_parameters(net, ["^head"])
    assert [n for n, p in net.named_parameters() if not p.requires_grad] == ["head.weight"]


def test_quant_weight_inplace_puts_weights_on_the_grid():
    torch.manual_seed(0)
    net = _Net()
    net.conv1.weight_quantizer.disable()
    conv_before = net.conv1.weight.detach().clone()
    float_before = net.block[0].weight.detach().clone()
    want = net.block[1].weight_quantizer(net.block[1].weight).detach()
    helper.quant_weight_inplace(net)
    assert torch.equal(net.block[1].weight.detach(), want)
    assert not torch.equal(want, float_before)
    assert torch.equal(net.conv1.weight.detach(), conv_before)  # disabled quantizer: untouched
    assert torch.equal(net.block[0].weight.detach(), float_before)  # no weight quantizer: untouched
    again = net.block[1].weight_quantizer(net.block[1].weight).detach()
    assert torch.equal(again, want)
    assert isinstance(net.block[1].weight, nn.Parameter) and net.block[1].weight.requires_grad


# --- quant_modules.QuantModuleReplacementHelper ------------------------------------------------------------------
@pytest.fixture
def _restore_nn():
    orig = {name: getattr(nn, name) for _, name, _ in quant_modules.DEFAULT_QUANT_MAP}
    yield orig
    quant_modules.deactivate()
    for name, cls in orig.items():
        setattr(nn, name, cls)


def test_replacement_helper_prepare_apply_restore(_restore_nn):
    orig = _restore_nn
    helper_ = quant_modules.QuantModuleReplacementHelper()
    with pytest.raises(RuntimeError, match="prepare_state"):
        helper_.apply_quant_modules()
    helper_.prepare_state(["Linear"], None)
    assert "Linear" not in helper_.quant_map and helper_.quant_map["Conv2d"] is quant_nn.QuantConv2d
    assert nn.Conv2d is orig["Conv2d"]  # preparing patches nothing
    helper_.apply_quant_modules()
    assert nn.Conv2d is quant_nn.QuantConv2d and nn.Linear is orig["Linear"]
    assert quant_modules.active()["Conv2d"] is quant_nn.QuantConv2d
    helper_.restore_float_modules()
    assert all(getattr(nn, n) is c for n, c in orig.items()) and quant_modules.active() == {}

    custom = quant_modules.QuantModuleReplacementHelper()
    custom.prepare_state(["Linear"], [(torch.nn, "Linear", quant_nn.QuantLinear)])  # the custom map wins
    custom.apply_quant_modules()
    assert type(nn.Linear(2, 2)) is quant_nn.QuantLinear
    custom.restore_float_modules()
    assert nn.Linear is orig["Linear"]
    with pytest.raises(TypeError, match="custom_quant_modules"):
        custom.prepare_state(None, [(torch.nn, "NoSuchLayer", quant_nn.QuantLinear)])
