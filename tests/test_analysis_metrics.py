"""Analysis metrics and Int8Quantizer checked against hand computations."""

import io
import math

import numpy as np
import pytest
import torch

from modelopt_lite.analysis import (
    Int8Quantizer,
    calculate_model_size,
    calculate_quantization_error,
    print_quantization_summary,
)
from modelopt_lite.tensor_quant import fake_block_quant


def test_quantization_error_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    xq = torch.tensor([1.0, 2.0, 3.0, 5.0])
    r = calculate_quantization_error(x, xq)
    assert r["mse"] == 0.25 and r["mae"] == 0.25 and r["max_abs_error"] == 1.0 and r["numel"] == 4
    assert r["sqnr_db"] == pytest.approx(10 * math.log10(30.0), rel=1e-12)
    assert r["cosine_similarity"] == pytest.approx(34.0 / math.sqrt(30.0 * 39.0), rel=1e-12)
    same = calculate_quantization_error(x, x.clone())
    assert same["sqnr_db"] == math.inf and same["cosine_similarity"] == 1.0 and same["mse"] == 0.0
    z = calculate_quantization_error(torch.zeros(3), torch.tensor([0.0, 1.0, 0.0]))
    assert z["sqnr_db"] == -math.inf and z["cosine_similarity"] == 0.0


def test_quantization_error_rejects_bad_input():
    with pytest.raises(ValueError, match=r"same shape, got \(2,\) and \(3,\)"):
        calculate_quantization_error(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        calculate_quantization_error(torch.tensor([float("nan")]), torch.zeros(1))
    with pytest.raises(TypeError, match="xq must be a torch.Tensor"):
        calculate_quantization_error(torch.zeros(1), [0.0])


def test_model_size_by_hand():
    lin = torch.nn.Linear(10, 4)  # 44 float32 params
    r = calculate_model_size(lin)
    assert (r["num_params"], r["param_bytes"], r["buffer_bytes"], r["total_bytes"]) == (44, 176, 0, 176)
    assert r["total_mb"] == 176 / 2**20
    m = torch.nn.Sequential(lin, lin, torch.nn.BatchNorm1d(4))  # shared module counted once
    m[2].register_buffer("codes", torch.zeros(7, dtype=torch.int8))
    r = calculate_model_size(m)
    # BN: 8 float params, running mean/var 8 floats, num_batches_tracked int64, + 7 int8
    assert r["param_bytes"] == 176 + 32 and r["buffer_bytes"] == 32 + 8 + 7
    assert r["bytes_by_dtype"] == {"torch.float32": 240, "torch.int64": 8, "torch.int8": 7}


def test_int8_quantizer_symmetric_by_hand():
    t = torch.tensor([[-1.5, 0.5, 2.5], [-127.0, 3.49, 100.2]])  # amax 127 -> scale exactly 1
    q = Int8Quantizer().calibrate(t)
    codes = q.quantize(t)
    assert codes.dtype == torch.int8
    assert codes.tolist() == [[-2, 0, 2], [-127, 3, 100]]  # round half to even
    p = q.get_quantization_params()
    assert p["scale"].item() == 1.0 and p["zero_point"].item() == 0 and (p["qmin"], p["qmax"]) == (-127, 127)
    assert torch.equal(q.dequantize(codes), codes.float())
    wide = Int8Quantizer(narrow_range=False).calibrate(torch.tensor([127.0]))
    assert wide.quantize(torch.tensor([-200.0])).item() == -128


def test_int8_quantizer_asymmetric_notebook_example():
    t = torch.tensor([[191.6, -13.5, 728.6], [92.14, 295.5, -184.0], [0.0, 684.6, 245.5]])
    q = Int8Quantizer(symmetric=False).calibrate(t)
    p = q.get_quantization_params()
    scale = np.float32(np.float32(728.6) - np.float32(-184.0)) / np.float32(255)
    assert p["scale"].item() == pytest.approx(float(scale), rel=0, abs=0)
    assert p["zero_point"].item() == -77 and (p["qmin"], p["qmax"]) == (-128, 127)
    expected = np.clip(np.rint(t.numpy() / scale) - 77, -128, 127)
    codes = q.quantize(t)
    assert codes.tolist() == expected.astype(np.int8).tolist()
    deq = q.dequantize(codes)
    assert torch.equal(deq, (codes.float() + 77) * float(scale))
    assert q.dequantize(q.quantize(torch.zeros(1, 3))).abs().max().item() == 0.0  # zero is exact
    assert float(((deq - t) ** 2).mean()) < 1.6  # the notebook's computed scale/zero point gives ~1.57


def test_int8_quantizer_per_channel_and_groups():
    torch.manual_seed(0)
    t = torch.randn(4, 6) * torch.tensor([[1.0], [10.0], [0.1], [3.0]])
    pc = Int8Quantizer(per_channel=True).calibrate(t)
    s = pc.get_quantization_params()["scale"]
    assert s.shape == (4, 1) and torch.equal(s, t.abs().amax(1, keepdim=True) / 127)
    ax1 = Int8Quantizer(per_channel=True, channel_axis=1).calibrate(t)
    assert ax1.get_quantization_params()["scale"].shape == (1, 6)
    g = Int8Quantizer(group_size=4).calibrate(t)  # groups of 4 along the last dim; the last group is partial
    assert g.get_quantization_params()["scale"].shape == (4, 2)
    fq = fake_block_quant(
        t,
        {-1: 4},
        t.new_tensor([[t[i, :4].abs().max(), t[i, 4:].abs().max()] for i in range(4)]),
        num_bits=8,
        narrow_range=True,
    )
    assert torch.equal(g.dequantize(g.quantize(t)), fq)
    ga = Int8Quantizer(symmetric=False, group_size=3).calibrate(t)
    assert ga.get_quantization_params()["zero_point"].shape == (4, 2, 1)
    assert float((ga.fake_quantize(t) - t).abs().max()) <= float(ga.get_quantization_params()["scale"].max())


def test_int8_quantizer_errors():
    with pytest.raises(ValueError, match="not calibrated"):
        Int8Quantizer().quantize(torch.zeros(2))
    with pytest.raises(ValueError, match="mutually exclusive"):
        Int8Quantizer(per_channel=True, group_size=4)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        Int8Quantizer(group_size=0)
    q = Int8Quantizer(per_channel=True).calibrate(torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"does not match the calibration parameters of shape \(3, 1\)"):
        q.quantize(torch.ones(4, 2))
    with pytest.raises(TypeError, match="expects int8 codes"):
        q.dequantize(torch.ones(3, 2))
    with pytest.raises(ValueError, match="NaN or Inf"):
        Int8Quantizer().calibrate(torch.tensor([float("inf")]))
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        Int8Quantizer(symmetric=False, group_size=4).calibrate(torch.ones(2, 6))


def test_summary_of_int8_quantizer_matches_metrics():
    t = torch.tensor([[-1.5, 0.5, 2.5], [-127.0, 3.49, 100.2]])
    q = Int8Quantizer().calibrate(t)
    buf = io.StringIO()
    rows = print_quantization_summary(q, t, file=buf)
    (row,) = rows
    err = calculate_quantization_error(t, q.dequantize(q.quantize(t)))
    for k in ("mse", "max_abs_error", "sqnr_db", "cosine_similarity"):
        assert row[k] == err[k]
    assert row["levels_used"] == 6 and row["levels_total"] == 255 and row["clipped_fraction"] == 1 / 6
    text = buf.getvalue()
    assert "Int8Quantizer" in text and "symmetric" in text and "sqnr_db" in text
    with pytest.raises(TypeError, match="expects an Int8Quantizer"):
        print_quantization_summary(42)
