"""auto_quantize converts the user's model as quantize() does and then installs the chosen quantizers only: the
layers keep their train/eval flags (as ModelOpt), never replaced by the search's eval-mode copies; SequentialQuantizers
still count as one quantizer."""

from __future__ import annotations

import copy

import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.algorithms.auto_quantize_spaces import is_quantizer_child
from modelopt_lite.nn import QuantConv2d, SequentialQuantizer, TensorQuantizer


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def _search(model, batches):
    return mtq.auto_quantize(
        model,
        constraints={"effective_bits": 6.0},
        quantization_formats=[mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, mtq.INT8_DEFAULT_CFG],
        data_loader=batches,
        forward_step=lambda m, b: m(b),
        loss_func=lambda out, b: out.sum(),
        num_calib_steps=2,
        num_score_steps=2,
    )


def test_auto_quantize_keeps_the_users_layers_and_training_flags():
    model = _net()  # train mode, as nn.Module starts
    float_weight = model[0].weight.detach().clone()
    batches = [torch.randn(2, 3, 6, 6) for _ in range(2)]
    best, state = _search(model, batches)
    assert best is model and state["best"]["is_satisfied"]
    assert [n for n, m in best.named_modules() if not m.training] == []  # nothing switched to eval
    assert isinstance(best[0], QuantConv2d)
    assert torch.equal(best[0].weight, float_weight)
    # a train-mode BatchNorm still uses batch statistics: same output as a fresh model restored from the checkpoint
    restored = mtq.opt.restore(_net(), _to_buffer(best))
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert torch.equal(best(x), restored(x))


def _to_buffer(model):
    import io

    buf = io.BytesIO()
    mtq.opt.save(model, buf)
    buf.seek(0)
    return buf


def test_is_quantizer_child_is_a_quantizer_or_a_sequential_of_them_never_a_layer():
    q = TensorQuantizer()
    assert is_quantizer_child(q)
    assert is_quantizer_child(SequentialQuantizer(TensorQuantizer(), TensorQuantizer()))
    layer = mtq.quantize(nn.Sequential(nn.Conv2d(3, 4, 3)), mtq.INT8_DEFAULT_CFG)[0]
    assert not is_quantizer_child(layer)  # its children are all quantizers, but it is the layer itself
    pool = mtq.quantize(nn.Sequential(nn.MaxPool2d(2)), copy.deepcopy(mtq.INT8_DEFAULT_CFG))[0]
    assert not is_quantizer_child(pool)
