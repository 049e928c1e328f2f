"""bench/bench_real_gpu.py runs every path on the CPU with tiny shapes (the GPU run is tests/gpu/run_session.sh's)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_real_gpu.py"


@pytest.mark.slow
def test_bench_real_gpu_quick_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("bench_real_gpu", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--device", "cpu", "--quick", "--repeats", "1", "--profile"])
    out = capsys.readouterr().out
    for path in ("fp8 tensor", "fp8 rowwise dyn", "int8", "int4 g128"):
        assert out.count(f" {path} ") == 2, path  # M in {1, 32}
    assert "int4 crossover K=N=256" in out and "fp8 real" in out and "top-1 agree" in out
    for path in ("fp8 tensor", "fp8 rowwise dyn", "int8", "int4 g128"):
        assert f"profile: {path}, M=32, K=N=256, 10 forwards" in out
    assert "Self CPU" in out  # torch.profiler's table
