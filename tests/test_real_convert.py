"""fake2real: real INT8 digits models agree with their fake-quant twins within the derived rounding bound."""

import copy

import pytest
import torch
from real_helpers import data, fake_model, layer_inputs

import modelopt_lite as mtl
from modelopt_lite.examples import accuracy
from modelopt_lite.real import QuantizedConv2d, QuantizedLinear, fake2real, int8_gemm


def _backends():
    return ["reference", "float_exact", "int_mm"] + (["onednn"] if int8_gemm.onednn_available() else [])


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_real_int8_digits_accuracy_and_bound(kind):
    fq = fake_model(kind)
    real = fake2real(fq, inplace=False)
    kinds = {type(m) for m in real.modules()}
    assert QuantizedLinear in kinds and (kind == "mlp" or QuantizedConv2d in kinds)
    assert all(m.compute == "int8" for m in real.modules() if isinstance(m, (QuantizedLinear, QuantizedConv2d)))
    x, y = data().x_test, data().y_test
    with torch.no_grad():
        lf, lr = fq(x), real(x)
    assert accuracy(lf, y=y) == accuracy(lr, y=y) > 90.0
    assert torch.equal(lf.argmax(1), lr.argmax(1))
    # per layer: feed each real layer the very input its fake twin sees; the difference obeys the bound
    ins = layer_inputs(fq, x)
    mods = dict(real.named_modules())
    fmods = dict(fq.named_modules())
    for name, xin in ins.items():
        with torch.no_grad():
            a, b = fmods[name](xin), mods[name](xin)
        bound = mods[name].error_bound(xin)
        diff = (a.double() - b.double()).abs()
        assert bool((diff <= bound).all()), name
        assert float(bound.max()) < 1e-3 * float(a.abs().max())  # far below one quantization step
    # end to end, a layer's input can differ from its fake twin's by float rounding only; where that lands on
    # the other side of a rounding tie, the code differs by exactly one and the value was within the bound of it
    rins = layer_inputs(real, x, set(ins))
    upstream_clean = True
    for name in ins:  # forward order
        m = mods[name]
        qf, qr = m.input_codes(ins[name]), m.input_codes(rins[name])
        flips = qf != qr
        assert float((qf - qr).abs().max()) <= 1.0
        assert int(flips.sum()) <= max(2, qf.numel() // 10000), name
        if bool(flips.any()) and upstream_clean:  # the first flips come from values sitting on a rounding tie
            v = ins[name][flips].double() / float(m.current_input_scale())
            assert float((v - v.floor() - 0.5).abs().max()) < 1e-4
        upstream_clean = upstream_clean and not bool(flips.any())
    assert float((lf - lr).abs().max()) < 0.05


@pytest.mark.parametrize("backend", _backends())
def test_every_backend_gives_the_same_model_outputs(backend):
    fq = fake_model("cnn")
    ref = fake2real(fq, inplace=False, backend="reference")
    real = fake2real(fq, inplace=False, backend=backend)
    x = data().x_test[:64]
    with torch.no_grad():
        a, b, f = ref(x), real(x), fq(x)
    if backend in ("reference", "float_exact", "int_mm"):  # exact accumulators, same final formula
        assert torch.equal(a, b)
    assert float((b - f).abs().max()) < 1e-4


def test_int4_block_weight_only_is_bit_identical_and_packed():
    fq = fake_model("mlp", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG")
    real = fake2real(fq, inplace=False)
    lin = real.body[0]
    assert isinstance(lin, QuantizedLinear) and lin.compute == "dequant"
    assert lin.weight_packed.dtype == torch.uint8 and lin.weight_packed.shape == (128, 32)
    assert lin.weight_scale.shape == (128, 1)  # 64 inputs: one block of 128 (padded)
    x = data().x_test
    with torch.no_grad():
        assert torch.equal(fq(x), real(x))


def test_w4a8_uses_exact_dequant_path():
    fq = fake_model("mlp", "W4A8_CFG")
    real = fake2real(fq, inplace=False)
    assert {m.compute for m in real.modules() if isinstance(m, QuantizedLinear)} == {"dequant"}
    with torch.no_grad():
        assert torch.equal(fq(data().x_test), real(data().x_test))


def test_output_quantizer_raises_clearly():
    fq = fake_model("cnn", "INT8_ORT_CFG")
    with pytest.raises(ValueError, match=r"module 'conv1': output_quantizer is enabled"):
        fake2real(fq)
    assert type(fq.conv1).__name__ == "QuantConv2d"  # nothing was converted


def test_uncalibrated_and_still_calibrating_raise():
    fq = fake_model("mlp")
    fq.body[0].input_quantizer.enable_calib()
    with pytest.raises(ValueError, match=r"'body.0': input_quantizer is still calibrating"):
        fake2real(fq)


def test_disabled_layers_go_back_to_float():
    fq = fake_model("mlp")
    for q in (fq.head.input_quantizer, fq.head.weight_quantizer):
        q.disable()
    real = fake2real(fq, inplace=False)
    assert type(real.head) is torch.nn.Linear and not hasattr(real.head, "input_quantizer")
    assert torch.equal(real.head.weight, fq.head.weight)
    with torch.no_grad():
        assert float((real(data().x_test) - fq(data().x_test)).abs().max()) < 1e-4


def test_nan_propagates_like_fake_quant():
    fq = fake_model("cnn")
    real = fake2real(fq, inplace=False)
    x = data().x_test[:4].clone()
    x[1, 0, 3, 3] = float("nan")
    with torch.no_grad():
        a = fq.conv1(x)
        b = real.conv1(x)
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and bool(torch.isnan(b).any())
    xl = torch.randn(3, 512)
    xl[2, 5] = float("nan")
    with torch.no_grad():
        assert torch.equal(torch.isnan(fq.fc(xl)), torch.isnan(real.fc(xl)))


def test_unsigned_inputs_and_fp16_and_odd_conv():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, padding_mode="reflect"),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 2, padding="same", groups=2, dilation=2),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 5 * 5, 7),
    )
    cfg = copy.deepcopy(mtl.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["2.input_quantizer"] = {"unsigned": True}
    cfg["quant_cfg"]["5.input_quantizer"] = {"unsigned": True, "num_bits": 7}
    batches = [torch.randn(4, 3, 9, 9) for _ in range(3)]
    fq = mtl.quantize(model, cfg, lambda m: [m(b) for b in batches])
    real = fake2real(fq, inplace=False)
    assert real[2].unsigned_input and real[5].spec["input"]["num_bits"] == 7
    x = torch.randn(5, 3, 9, 9)
    with torch.no_grad():
        a, b = fq(x), real(x)
        assert float((a - b).abs().max()) < 1e-4
        for i in (0, 2):
            xin = fq[:i](x) if i else x
            assert bool(((fq[i](xin) - real[i](xin)).abs().double() <= real[i].error_bound(xin)).all())
        h = real[5](torch.relu(torch.randn(2, 200)).half())
    assert h.dtype == torch.float16


def test_repr_and_bad_backend():
    real = fake2real(fake_model("mlp"), inplace=False)
    assert "compute=int8" in repr(real.body[0]) and "in_features=64" in repr(real.body[0])
    with pytest.raises(ValueError, match="backend must be one of"):
        fake2real(fake_model("mlp"), backend="cuda")


def test_compress_alias_and_public_names():
    assert mtl.compress is mtl.fake2real
    assert mtl.fake_quant.__module__ == "modelopt_lite.real.seed_api"
