"""compare_models, sensitivity, auto_skip, model summaries and plots on the digits models."""

import io
import math

import pytest
import torch
from real_helpers import data, fake_model, float_model

import modelopt_lite as mtl
from modelopt_lite.analysis import (
    auto_skip,
    calculate_quantization_error,
    compare_models,
    plot_calibration_histogram,
    plot_layer_errors,
    plot_sensitivity,
    print_quantization_summary,
    sensitivity,
)
from modelopt_lite.examples import accuracy
from modelopt_lite.real import fake2real


def test_compare_models_rows_by_hand():
    fm, qm = float_model("mlp"), fake_model("mlp")
    x = data().x_test[:200]
    rows = compare_models(fm, qm, x)
    assert [r["name"] for r in rows] == ["body.0", "body.1", "body.2", "body.3", "head", "(output)"]
    assert rows[0]["float_type"] == "Linear" and rows[0]["quant_type"] == "QuantLinear"
    with torch.no_grad():
        expected_out = calculate_quantization_error(fm(x), qm(x))
        expected_b0 = calculate_quantization_error(fm.body[0](x.flatten(1)), qm.body[0](x.flatten(1)))
    assert rows[-1]["mse"] == expected_out["mse"] and rows[-1]["sqnr_db"] == expected_out["sqnr_db"]
    assert rows[0]["max_abs_error"] == expected_b0["max_abs_error"]
    assert all(r["sqnr_db"] > 20 for r in rows)
    same = compare_models(fm, fm, x)
    assert all(r["mse"] == 0.0 and r["sqnr_db"] == math.inf for r in same)
    real_rows = compare_models(fm, fake2real(qm, inplace=False), x)
    assert real_rows[0]["quant_type"] == "QuantizedLinear"
    with pytest.raises(ValueError, match="layer 'nope' is missing from the float model"):
        compare_models(fm, qm, x, layers=["nope"])


def _damaged_cnn():
    """Float-equivalent CNN whose conv2 cannot be quantized: one input channel of conv2 is 1e4x larger (bn1
    scaled up, conv2's matching weights scaled down; ReLU is positively homogeneous)."""
    m = float_model("cnn")
    with torch.no_grad():
        m.bn1.weight[3] *= 1e4
        m.bn1.bias[3] *= 1e4
        m.conv2.weight[:, 3] /= 1e4
    return m


def _metric(model):
    return accuracy(model, data().x_test, data().y_test)


def test_sensitivity_ranks_the_damaged_layer_first():
    m = _damaged_cnn()
    assert abs(_metric(m) - _metric(float_model("cnn"))) < 0.5  # float behaviour preserved
    calib = data().calib_batches(4, 64)
    rep = sensitivity(m, mtl.INT8_DEFAULT_CFG, calib, _metric)
    assert rep.ranking[0] == "conv2" and sorted(rep.ranking) == ["conv1", "conv2", "fc"]
    top = rep.rows[0]
    assert top["rank"] == 1 and top["drop"] > 20.0 and top["drop"] == rep.baseline - top["metric"]
    assert all(r["drop"] < 2.0 for r in rep.rows[1:])
    assert rep.baseline == _metric(m) and rep.all_quantized < rep.baseline - 20
    assert type(m.conv2) is torch.nn.Conv2d  # the caller's model is untouched


def test_auto_skip_meets_the_budget(tmp_path):
    m = _damaged_cnn()
    calib = data().calib_batches(4, 64)
    rep = auto_skip(m, mtl.INT8_DEFAULT_CFG, calib, _metric, max_drop=1.0)
    assert rep.skipped == ["conv2"] and rep.met_budget and rep.final_drop <= 1.0
    assert [s["skipped"] for s in rep.steps] == [[], ["conv2"]] and rep.steps[0]["drop"] > 20
    assert not rep.model.conv2.input_quantizer.is_enabled and rep.model.conv1.input_quantizer.is_enabled
    assert rep.config["quant_cfg"]["conv2.*"] == {"enable": False}
    assert "conv2.*" not in mtl.INT8_DEFAULT_CFG["quant_cfg"]
    again = mtl.quantize(_damaged_cnn(), rep.config, lambda mm: [mm(b) for b in calib])
    assert _metric(again) == rep.final_metric  # the returned config reproduces the result
    real = fake2real(rep.model, inplace=False)  # skipped layers become float modules
    assert type(real.conv2) is torch.nn.Conv2d and type(real.conv1).__name__ == "QuantizedConv2d"
    png = plot_sensitivity(rep, tmp_path / "sens.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="max_drop must be a number >= 0"):
        auto_skip(m, mtl.INT8_DEFAULT_CFG, calib, _metric, max_drop=-1)


def test_model_and_tensor_quantizer_summaries():
    qm = fake_model("mlp")
    buf = io.StringIO()
    rows = print_quantization_summary(qm, file=buf)
    assert len(rows) == 9 and rows[0]["name"] == "body.0.input_quantizer"
    real = fake2real(qm, inplace=False)
    rrows = print_quantization_summary(real, file=io.StringIO())
    assert [r["name"] for r in rrows] == ["body.0", "body.2", "head"]
    assert rrows[0]["bytes"] == 128 * 64 + 4 * (128 + 128 + 1) and rrows[0]["compute"] == "int8"
    wq = qm.body[0].weight_quantizer
    w = qm.body[0].weight.detach()
    (row,) = print_quantization_summary(wq, w, file=io.StringIO())
    err = calculate_quantization_error(w, wq(w))
    assert row["mse"] == err["mse"] and row["amax_max"] == float(w.abs().max())
    with pytest.raises(TypeError, match="applies to a quantizer"):
        print_quantization_summary(qm, w)


def test_plots(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(20000)
    x[:3] = torch.tensor([12.0, -9.0, 15.0])  # outliers: max calibration is pulled far out
    res = plot_calibration_histogram(x, tmp_path / "hist.png")
    assert res["path"].read_bytes()[:4] == b"\x89PNG"
    a = res["amax"]
    assert a["max"] == 15.0 and a["percentile"] < a["max"] and a["mse"] < a["max"] and a["entropy"] < a["max"]
    from modelopt_lite.calib import HistogramCalibrator

    h = HistogramCalibrator()
    h.collect(x)
    assert a["mse"] == float(h.compute_amax("mse"))
    rows = compare_models(float_model("mlp"), fake_model("mlp"), data().x_test[:100])
    assert plot_layer_errors(rows, tmp_path / "err.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="must end with .png"):
        plot_layer_errors(rows, tmp_path / "err.jpg")
    with pytest.raises(ValueError, match="no metric 'psnr'"):
        plot_layer_errors(rows, tmp_path / "e.png", metric="psnr")
