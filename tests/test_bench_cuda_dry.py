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
    for name in ("bench_cuda", "bench_qat_cuda", "cuda_mx_rows", "cuda_profile", "sass_hot_path"):
        sys.modules.pop(name, None)


def test_bench_cuda_mx_rows_dry_run(bench_path, capsys):
    import bench_cuda

    assert bench_cuda.main(["--dry-run-cpu", "--cases", "mx", "--dtypes", "fp32,bf16", "--numel", "8192"]) == 0
    out = capsys.readouterr().out
    for case in ("NVFP4", "MXFP8 E4M3", "MXFP4 E2M1", "MXINT8", "MX E5M2", "E5M2 per-tensor", "E2M1 per-tensor"):
        assert out.count(f"| {case}") >= 2 * 2, case  # ours and the chain, two dtypes
    for case in ("dynamic", "static"):  # the fused kernel and the chain (the public rows are CUDA-only), two dtypes
        assert out.count(f"int4 blocks of 128, {case} amax (fused)") == 2 * 2, case
    assert out.count("bit-exact") == 2 * 9 and "NOT EXACT" not in out


def test_bench_cuda_burst_dry_run(bench_path, capsys):
    """--burst N times N calls back to back per run (the header says so); a bad count is refused."""
    import bench_cuda

    assert (
        bench_cuda.main(["--dry-run-cpu", "--cases", "mx", "--dtypes", "fp32", "--numel", "8192", "--burst", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "median of 2 runs, 3 calls back to back per run (mean per call)" in out
    assert "| NVFP4 fake quant | fp32 | modelopt_lite |" in out
    with pytest.raises(SystemExit):
        bench_cuda.main(["--dry-run-cpu", "--burst", "0"])
    assert "--burst must be >= 1" in capsys.readouterr().err


def test_call_latency_dry_run(capsys):
    """bench/cuda_call_latency.py: every public row (and the yardsticks) on tiny CPU tensors, two dtypes."""
    sys.path.insert(0, str(BENCH))
    try:
        import cuda_call_latency
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("cuda_call_latency", None)
    assert cuda_call_latency.main(["--dry-run-cpu", "--repeats", "2", "--dtypes", "fp32,bf16"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fp32 |") or line.startswith("| bf16 |")]
    names = {line.split(" | ")[1] for line in rows}
    assert names == {
        "y.copy_(x), preallocated y",
        "torch.fake_quantize_per_tensor_affine",
        "public mx_fake_quant e4m3",
        "public nvfp4_fake_quant",
        "public fake_block_quant int4/128 dynamic",
        "public fake_block_quant int4/128 static",
        "public fake_tensor_quant int8",
        "TensorQuantizer MXFP8",
    }
    assert len(rows) == 8 + 7  # torch's op: float32 only
    assert "| host primitive | warm host us |" in out and "| torch.zeros(1, int32) | " in out
    for line in rows:
        event_ms, host_us, warm_us = (float(v) for v in line.strip("| ").split(" | ")[2:])
        assert event_ms > 0 and host_us > 0 and warm_us > 0, line


def test_bench_qat_dry_run(bench_path, capsys):
    import bench_qat_cuda

    assert bench_qat_cuda.main(["--dry-run-cpu"]) == 0
    out = capsys.readouterr().out
    for fmt in ("nvfp4", "mxfp8"):
        assert f"| {fmt} | modelopt_lite eager |" in out and f"| {fmt} | model with pure-torch chain (eager) |" in out
        assert f"| {fmt} | modelopt_lite eager, TensorQuantizer per weight |" in out


def test_bench_qat_profile_dry_run(bench_path, capsys):
    """--profile prints one torch.profiler table per row (bench/cuda_profile.py; on the CPU without kernels)."""
    import bench_qat_cuda

    assert bench_qat_cuda.main(["--dry-run-cpu", "--formats", "mxfp8", "--profile"]) == 0
    out = capsys.readouterr().out
    for row in ("mxfp8, modelopt_lite eager", "mxfp8, model with pure-torch chain (eager)"):
        assert f"#### {row}: " in out and " ms per call" in out, row
    assert out.count("| host op | per call | self CPU ms per call |") == 3
    assert "| modelopt_lite::fake_mx | 2 |" in out  # the quantizer op of each of the 2 weights, per step


def test_sass_report_labels_and_rows(bench_path):
    """bench/sass_hot_path.py's parsing, on mangled names and a SASS excerpt (no nvcc or cuobjdump needed)."""
    import sass_hot_path as sh

    nv = "_ZN3mxk12lanes_kernelINS_7Nvfp4OpI13__nv_bfloat16Lb0ELb1EEELi2EEEvT_"
    assert sh.label(nv) == "Nvfp4Op bf16 FULL"
    assert sh.label(nv.replace("Lb0ELb1", "Lb1ELb0")) is None  # backward kernels get no row
    assert sh.label("_ZN3mxk12lanes_kernelINS_4MxOpIfLi2ELb0ELb0EEELi2EEEvT_") == "MxOp fp32 e2m1 general"
    dyn = "_ZN3mxk12lanes_kernelINS_10DynBlockOpI6__halfLi4ELb1ELb0ELb1EEELi1EEEvT_"
    assert sh.label(dyn) == "DynBlockOp fp16 e4m3 P=4 FULL"
    one_lane = "_ZN3mxk12lanes_kernelINS_7Nvfp4OpI13__nv_bfloat16Li2ELb0ELb1EEELi2EEEvT_"
    assert sh.label(one_lane) == "Nvfp4Op bf16 P=2 FULL"
    assert sh.label("_ZN3mxk12lanes_kernelINS_4MxOpIfLi0ELb0ELb1EEELi4EEEvT_") == "MxOp fp32 e4m3 FULL U=4"
    capped = "_ZN3mxk23lanes_kernel_min_blocksINS_7Nvfp4OpI13__nv_bfloat16Li2ELb0ELb1EEELi2ELi5EEEvT_b"
    assert sh.label(capped) == "Nvfp4Op bf16 P=2 FULL min 5 blocks"
    sass = (
        "\n\t\tFunction : " + nv + "\n"
        "        /*0000*/                   I2F.U32.RP R0, R1 ;\n"
        "        /*0010*/              @!P0 FCHK P1, R2, R3 ;\n"
        "        /*0020*/                   F2F.F64.F32 R4, R5 ;\n"
        "        /*0030*/                   BSSY B0, 0x60 ;\n"
    )
    log = f"ptxas info    : Compiling entry function '{nv}' for 'sm_90'\nptxas info    : Used 52 registers\n"
    rows = sh.kernel_rows(log, sass, sh.re.compile(""))
    assert rows == [
        {
            "kernel": "Nvfp4Op bf16 FULL",
            "regs": 52,
            "spill": 0,
            "instructions": 4,
            "div32": 1,
            "f64": 1,
            "branch regions": 1,
            "fdiv": 1,
            "loop/elem": "",
        }
    ]
    hist = "_ZN3mlq49_GLOBAL__N__bf21e2e7_16_quant_kernels_cu_435b571716histogram_kernelI13__nv_bfloat16EEvPKNS_8HistE"
    assert sh.label(hist) == "histogram bf16"
    body = [
        f"        /*{16 * i:04x}*/                   {op} ;\n"
        for i, op in enumerate(
            [
                "MOV R0, RZ",
                "LDG.E.128 R4, desc[UR4][R2.64]",
                *["ATOMS.POPC.INC.32 RZ, [R8+URZ]"] * 8,
                "IADD3 R1, R1, 1, RZ",
                "@P0 BRA 0x10",
                "EXIT",
            ]
        )
    ]
    (row,) = sh.kernel_rows("", "\n\t\tFunction : " + hist + "\n" + "".join(body), sh.re.compile(""))
    assert row["loop/elem"] == "1.4"  # the loop 0x10-0xb0: 11 instructions for one 16-byte load of 8 bfloat16


def test_gpu_session_default_steps_fit_one_device_command():
    """tests/gpu/run_session.sh: every default step exists, and their limits (+2 s kill grace each) fit inside the
    device tool's 600 s per command."""
    import re

    script = (BENCH.parent / "tests" / "gpu" / "run_session.sh").read_text()
    defaults = re.search(r'steps=\$\{STEPS:-"([^"]+)"\}', script).group(1).split()
    limits = dict(re.findall(r"^step (\w+) (\d+) ", script, re.M))
    assert set(defaults) <= set(limits), set(defaults) - set(limits)
    total = sum(int(limits[s]) + 2 for s in defaults)
    assert total <= 600, total
    assert f"The default steps' limits sum to {total - 2 * len(defaults)} s" in script
