"""fake2real of CNNs with max pooling (the default presets quantize its input): real pooling of integer codes is
exact, the whole model converts without strict=False, and round-trips through a real checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modelopt_lite as mtq
from modelopt_lite.real import QuantizedMaxPool1d, QuantizedMaxPool2d, QuantizedMaxPool3d, fake2real, load_real


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 10),
    ).eval()


def _batches(shape=(16, 1, 8, 8), n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _fake(cfg_name="INT8_DEFAULT_CFG", model=None):
    batches = _batches()
    return mtq.quantize(model or _cnn(), getattr(mtq, cfg_name), lambda m: [m(b) for b in batches]).eval()


def test_default_preset_cnn_with_maxpool_converts_and_matches():
    fq = _fake()
    assert type(fq[2]).__name__ == "QuantMaxPool2d" and fq[2].input_quantizer.is_enabled
    real = fake2real(fq, inplace=False)  # strict (the default): no module may stay fake-quantized
    assert isinstance(real[2], QuantizedMaxPool2d) and isinstance(real[5], QuantizedMaxPool2d)
    assert not any(type(m).__name__.startswith("Quant") and hasattr(m, "input_quantizer") for m in real.modules())
    x = _batches(n=1, seed=7)[0]
    x[0, 0, 1, 1] = float("nan")
    with torch.no_grad():
        for i in (2, 5):  # the pooling layers themselves: bit-identical on the very same input
            xin = fq[:i](x)
            assert torch.equal(torch.isnan(fq[i](xin)), torch.isnan(real[i](xin)))
            a, b = fq[i](xin), real[i](xin)
            ok = ~torch.isnan(a)
            assert torch.equal(a[ok], b[ok]) and a.dtype == b.dtype
        x = _batches(n=1, seed=8)[0]
        lf, lr = fq(x), real(x)
    # end to end: the int8 GEMMs differ from the float ones by float rounding only (test_real_convert's criterion)
    assert torch.equal(lf.argmax(1), lr.argmax(1))
    assert float((lf - lr).abs().max()) < 1e-4


def test_dequant_path_cnn_with_maxpool_is_bit_identical_end_to_end():
    fq = _fake("W4A8_CFG")
    real = fake2real(fq, inplace=False)
    assert isinstance(real[2], QuantizedMaxPool2d)
    x = _batches(n=1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(fq(x), real(x))


def test_maxpool_checkpoint_round_trip(tmp_path):
    fq = _fake()
    real = fake2real(copy.deepcopy(fq), tmp_path)
    loaded = load_real(_cnn(), tmp_path)
    assert isinstance(loaded[2], QuantizedMaxPool2d) and loaded[5].ceil_mode
    x = _batches(n=1, seed=3)[0]
    with torch.no_grad():
        assert torch.equal(real(x), loaded(x))
    other = _cnn()
    other[5] = nn.MaxPool2d(3, stride=1)
    with pytest.raises(ValueError, match=r"modules\['5'\].pool: is .* the model's MaxPool2d has"):
        load_real(other, tmp_path)


@pytest.mark.parametrize(
    "pool, real_cls, shape",
    [
        (nn.MaxPool1d(3, stride=2, padding=1, return_indices=True), QuantizedMaxPool1d, (4, 3, 11)),
        (nn.MaxPool2d(2, dilation=2), QuantizedMaxPool2d, (4, 3, 9, 9)),
        (nn.MaxPool3d(2), QuantizedMaxPool3d, (2, 3, 4, 6, 6)),
    ],
)
def test_every_maxpool_dim_unsigned_and_fp16(pool, real_cls, shape):
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["0.input_quantizer"] = {"unsigned": True, "num_bits": 7}
    model = nn.Sequential(pool)
    batches = _batches(shape, seed=4)
    fq = mtq.quantize(model, cfg, lambda m: [m(b.abs()) for b in batches]).eval()
    real = fake2real(nn.Sequential(fq), inplace=False)[0]  # wrapped: the model itself is not converted
    assert isinstance(real[0], real_cls)
    x = _batches(shape, n=1, seed=5)[0].abs() * 3
    with torch.no_grad():
        a, b = fq(x), real(x)
        if isinstance(a, tuple):
            assert torch.equal(a[1], b[1])  # indices too
            a, b = a[0], b[0]
        assert torch.equal(a, b)
        h16 = x.half()
        a16, b16 = fq(h16), real(h16)
        a16, b16 = (a16[0], b16[0]) if isinstance(a16, tuple) else (a16, b16)
        assert b16.dtype == torch.float16 and torch.equal(a16, b16)


def test_temporal_maxpool_follows_quant_step():
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["*input_quantizer"]["num_steps"] = 3
    model = nn.Sequential(nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 4))
    batches = _batches((8, 1, 8, 8), n=3, seed=6)

    def loop(m):
        for t, b in enumerate(batches):
            with mtq.quant_step(m, t):
                m(b * (t + 1))

    fq = mtq.quantize(model, cfg, loop).eval()
    real = fake2real(fq, inplace=False)
    assert isinstance(real[0], QuantizedMaxPool2d) and real[0].num_steps == 3
    x = batches[0] * 2
    for t in range(3):
        with mtq.quant_step(fq, t), mtq.quant_step(real, t), torch.no_grad():
            assert real[0].step == t
            assert torch.equal(fq[0](x), real[0](x))


def test_uncalibrated_model_names_the_quantizers():
    fq = mtq.quantize(_cnn(), mtq.INT8_DEFAULT_CFG)  # no forward loop: the weights only are calibrated (ModelOpt)
    with pytest.raises(
        ValueError,
        match=r"fake2real: 5 quantizer\(s\) are not calibrated \(no amax\): 0.input_quantizer, "
        r"2.input_quantizer, 3.input_quantizer, 5.input_quantizer, 7.input_quantizer\. Calibrate the model first",
    ):
        fake2real(fq)
    assert type(fq[0]).__name__ == "QuantConv2d"  # nothing was converted
    lin = mtq.quantize(nn.Sequential(nn.Linear(4, 3)), mtq.INT8_DEFAULT_CFG)
    lin[0].input_quantizer.amax = 1.0
    lin[0].weight_quantizer.reset_amax()
    with pytest.raises(ValueError, match=r"1 quantizer\(s\) are not calibrated \(no amax\): 0.weight_quantizer\."):
        fake2real(lin)
