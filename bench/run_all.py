"""Run every benchmark script in bench/ and collect their tables in one markdown report.

    python bench/run_all.py                 # short settings, writes bench/REPORT.md
    python bench/run_all.py --full --out /tmp/report.md
    python bench/run_all.py --only bench_onnx bench_calib

Each ``bench/bench_*.py`` runs as its own subprocess (so one crash or timeout does not stop the others). Short
settings: a script whose ``--help`` mentions ``--quick`` (or ``--fast``) gets that flag unless ``--full`` is given.
A script's stdout is pasted into the report as is (the scripts print markdown tables); a failure is reported with
the tail of its stderr. Scripts expected but not written yet are listed as skipped.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXPECTED = ("bench_fake_quant", "bench_calib", "bench_onnx", "bench_real_int8")
#: short settings for scripts without --quick (each flag is passed only if the script's --help lists it)
SHORT_ARGS = {"bench_calib": ["--batches", "10", "--repeats", "1", "--no-loops"]}
#: scripts that need a CUDA device (skipped with a note on CPU-only machines)
GPU_ONLY = ("bench_cuda",)


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _version(mod: str) -> str:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "installed")
    except Exception as e:  # noqa: BLE001  (any import failure is just reported)
        return f"not available ({type(e).__name__})"


def machine_description() -> list[str]:
    """Markdown bullet lines describing this machine and the library versions."""
    lines = [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores; memory {_mem_gib()}",
        f"- OS: {platform.platform()}; Python {platform.python_version()}",
    ]
    flags = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_int8") if f" {f}" in info)
    except OSError:
        pass
    if flags:
        lines.append(f"- CPU features: {flags}")
    lines.append(
        f"- torch {_version('torch')}, numpy {_version('numpy')}, onnx {_version('onnx')}, "
        f"onnxruntime {_version('onnxruntime')}"
    )
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        lines.append(f"- GPU: {gpu}; torch threads: {torch.get_num_threads()}")
    except Exception:  # noqa: BLE001, S110
        pass
    backend = os.environ.get("MODELOPT_LITE_BACKEND", "auto")
    lines.append(f"- MODELOPT_LITE_BACKEND: {backend}")
    return lines


def short_args(script: Path, timeout: float) -> list[str]:
    """The short-settings arguments for ``script``: ``--quick`` (or ``--fast``) if its --help offers it, else the
    entries of :data:`SHORT_ARGS` whose flags its --help lists."""
    try:
        r = subprocess.run(
            [sys.executable, str(script), "--help"],
            check=False,
            capture_output=True,
            text=True,
            timeout=min(timeout, 120),
            cwd=ROOT,
        )
    except (subprocess.TimeoutExpired, OSError):
        return []
    for flag in ("--quick", "--fast"):
        if flag in r.stdout:
            return [flag]
    args, wanted = [], SHORT_ARGS.get(script.stem, [])
    i = 0
    while i < len(wanted):
        flag = wanted[i]
        value = wanted[i + 1 : i + 2] if i + 1 < len(wanted) and not wanted[i + 1].startswith("--") else []
        if flag in r.stdout:
            args += [flag, *value]
        i += 1 + len(value)
    return args


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def run_script(script: Path, full: bool, timeout: float) -> tuple[str, str, float]:
    """``(status, markdown body, seconds)`` for one benchmark script."""
    cmd = [sys.executable, str(script)]
    if not full:
        cmd += short_args(script, timeout)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", f"Timed out after {timeout:.0f} s.\n\n{out.strip()}", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    shown = " ".join(["python", str(script.relative_to(ROOT))] + cmd[2:])
    body = f"Command: `{shown}` ({dt:.1f} s)\n\n{r.stdout.strip()}"
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-15:])
        return f"failed (exit {r.returncode})", body + f"\n\nstderr (tail):\n\n```\n{tail}\n```", dt
    return "ok", body, dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(HERE / "REPORT.md"), help="report path (default bench/REPORT.md)")
    p.add_argument("--full", action="store_true", help="run the scripts with their own (long) defaults")
    p.add_argument("--only", nargs="*", default=None, help="script names (without .py) to run")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per script (default 900)")
    args = p.parse_args(argv)

    found = {s.stem: s for s in sorted(HERE.glob("bench_*.py"))}
    names = list(EXPECTED) + sorted(set(found) - set(EXPECTED))
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            p.error(f"--only: unknown script(s) {unknown}; known: {names}")
        names = [n for n in names if n in args.only]
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    parts = (
        [
            "# modelopt_lite benchmark report",
            "",
            f"Generated by `python bench/run_all.py{' --full' if args.full else ''}` on {stamp}.",
            "",
            "## Machine",
            "",
        ]
        + machine_description()
        + [""]
    )
    summary = []
    for name in names:
        script = found.get(name)
        if script is None:
            summary.append((name, "skipped (script not written yet)", 0.0))
            parts += [f"## {name}", "", f"Skipped: bench/{name}.py does not exist yet.", ""]
            continue
        if name in GPU_ONLY and not _has_cuda():
            summary.append((name, "skipped (needs a CUDA GPU)", 0.0))
            parts += [f"## {name}", "", "Skipped: this benchmark needs a CUDA GPU and none is available.", ""]
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        status, body, dt = run_script(script, args.full, args.timeout)
        summary.append((name, status, dt))
        parts += [f"## {name}", "", body, ""]
    table = ["| script | status | seconds |", "|:--|:--|--:|"] + [f"| {n} | {s} | {d:.1f} |" for n, s, d in summary]
    parts[parts.index("## Machine") : parts.index("## Machine")] = ["## Summary", ""] + table + [""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts).rstrip() + "\n", encoding="utf-8")
    print(f"wrote {out}", flush=True)
    return 0 if all(s in ("ok",) or s.startswith("skipped") for _, s, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
