"""bench/bench_cuda.py (issue 24's MX / fused-block rows) and bench/bench_qat_cuda.py run on the CPU with tiny
tensors (the GPU run is tests/gpu/run_session.sh's): every row is produced and every pure-torch chain the GPU table
compares against is bit-exact with the reference."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their helper module (cuda_mx_rows) by name
    yield
    for name in ("bench_cuda", "bench_qat_cuda", "cuda_mx_rows"):
        sys.modules.pop(name, None)


def test_bench_cuda_mx_rows_dry_run(bench_path, capsys):
    import bench_cuda

    assert bench_cuda.main(["--dry-run-cpu", "--cases", "mx", "--dtypes", "fp32,bf16", "--numel", "8192"]) == 0
    out = capsys.readouterr().out
    for case in ("NVFP4", "MXFP8 E4M3", "MXFP4 E2M1", "MXINT8", "MX E5M2", "E5M2 per-tensor", "E2M1 per-tensor"):
        assert out.count(f"| {case}") >= 2 * 2, case  # ours and the chain, two dtypes
    assert out.count("int4 blocks of 128, dynamic amax (fused)") == 2 * 3
    assert out.count("bit-exact") == 2 * 8 and "NOT EXACT" not in out


def test_bench_qat_dry_run(bench_path, capsys):
    import bench_qat_cuda

    assert bench_qat_cuda.main(["--dry-run-cpu"]) == 0
    out = capsys.readouterr().out
    for fmt in ("nvfp4", "mxfp8"):
        assert f"| {fmt} | modelopt_lite eager |" in out and f"| {fmt} | model with pure-torch chain (eager) |" in out
