"""Meta-device inputs hold no values: the public quantization calls refuse them with a TypeError that says so (not
torch's "Tensor.item() cannot be called on meta tensors" from deep inside), while a disabled quantizer passes them
through and the ops themselves keep their fake (shape) implementations for torch.compile / torch.export."""

from __future__ import annotations

import pytest
import torch

from modelopt_lite import tensor_quant as tq
from modelopt_lite.functional import library_mx as lx
from modelopt_lite.nn import QuantizerAttributeConfig, TensorQuantizer

META = r"is on the meta device, which holds no values to quantize or calibrate"


@pytest.mark.parametrize(
    "call",
    [
        lambda x: tq.fake_tensor_quant(x, torch.tensor(2.0), 8),
        lambda x: tq.fake_block_quant(x, {-1: 16}),
        lambda x: lx.mx_fake_quant(x, "e4m3"),
        lambda x: lx.nvfp4_fake_quant(x, torch.tensor(2.0)),
    ],
)
def test_functional_calls_refuse_meta_inputs(call):
    with pytest.raises(TypeError, match=META):
        call(torch.empty(4, 64, device="meta"))


@pytest.mark.parametrize("calib", [False, True])
def test_quantizer_refuses_meta_inputs_naming_itself(calib):
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)), name="fc.input_quantizer")
    q.amax = 2.0
    if calib:
        q.enable_calib()
    with pytest.raises(TypeError, match=r"'fc.input_quantizer'.*: the input " + META):
        q(torch.empty(4, 64, device="meta"))
    q.disable()
    x = torch.empty(4, 64, device="meta")
    assert q(x) is x  # a disabled quantizer touches nothing


def test_the_op_keeps_its_fake_implementation_on_meta():
    y = torch.ops.modelopt_lite.fake_e5m2(torch.empty(3, 4, device="meta"), torch.empty(3, 1, device="meta"))
    assert y.device.type == "meta" and y.shape == (3, 4) and y.dtype == torch.float32
