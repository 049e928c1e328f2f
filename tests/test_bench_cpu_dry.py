"""bench/bench_fake_quant.py (with ``--also-impl``) and bench/bench_call_overhead.py run end to end on tiny tensors:
every row is produced, the forced kernel set is restored after each call."""

import re
import sys
from pathlib import Path

import pytest

from modelopt_lite.functional import backend

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setitem(backend._state, "backend", backend._state["backend"])  # the script sets "native"
    yield
    for name in ("bench_fake_quant", "bench_call_overhead", "mx_formulations", "run_all"):
        sys.modules.pop(name, None)


def test_fake_quant_rows_with_a_second_kernel_set(bench_path, native, capsys):
    import bench_fake_quant

    before = native.kernel_impl()
    bench_fake_quant.main(["--formats", "classic", "--shapes", "32x64", "--rounds", "2", "--also-impl", "scalar"])
    out = capsys.readouterr().out
    assert native.kernel_impl() == before  # "auto" again after every forced call
    ours = [line for line in out.splitlines() if line.startswith("| modelopt_lite")]
    assert len(ours) == 2 * 7, ours  # 7 rows, and each again with the scalar set
    assert all(re.match(r"\| [^|]+ \| \d+\.\d+ \| \d+\.\d \| \d+\.\d\d \|", line) for line in ours), ours
    assert sum("[scalar]" in line for line in ours) == 7
    assert "Targets: 32x64: worst row" in out


def test_call_overhead_rows(bench_path, capsys):
    import bench_call_overhead

    assert bench_call_overhead.main(["--quick", "--shape", "8x32"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| .+ \| \d+\.\d \|$", line)]
    assert len(rows) == 5 and rows[-1].startswith("| torch.fake_quantize_per_tensor_affine"), rows
