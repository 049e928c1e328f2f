"""Run error cases of the CUDA extension in child processes, so that a crash is one case's failure, not the run's.

The first GPU run lost the whole pytest session to a SIGSEGV inside the extension (an error case that should have
raised ValueError). :func:`run_isolated` runs a list of ``(callable(mod), exception type, message regex)`` cases in
a child interpreter (``sys.executable``, this file as a script) that reports each case on its own line as it
finishes. When the child dies (a signal, an exit, a timeout), the case it was running is reported with the cause
and a fresh child resumes at the next case, so a clean run costs one child per list and a crash one more.

    python tests/gpu/isolated_cases.py MODULE FUNCTION DEVICE START    # the child
MODULE is a module of tests/gpu (``cuda_cases``) or a path to a ``.py`` file; DEVICE ``cuda`` passes the CUDA
extension to each case, ``none`` passes None (the runner's own tests).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"child exited with status {rc}"


def run_isolated(module: str, function: str, device: str, timeout_s: float = 120.0) -> tuple[int, list[str]]:
    """Run ``MODULE.FUNCTION(device)``'s cases in children; returns (number of cases, failure lines)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash prints the Python stack of the case to stderr
    name = Path(module).stem
    failures: list[str] = []
    start, total = 0, None
    while total is None or start < total:
        cmd = [sys.executable, str(Path(__file__).resolve()), module, function, device, str(start)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
            out, err, cause = proc.stdout, proc.stderr, _describe(proc.returncode) if proc.returncode else None
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            cause = f"timed out after {timeout_s:.0f} s"
        done = start
        for line in out.splitlines():
            if line.startswith("TOTAL "):
                total = int(line.split()[1])
            elif line.startswith("CASE "):
                _, i, status, *rest = line.split(" ", 3)
                done = int(i) + 1
                if status != "OK":
                    failures.append(f"{name}.{function}[{i}]: {' '.join(rest)}")
        if cause is None:
            if total is None or done < total:
                failures.append(f"{name}.{function}: the child stopped at case {done} without a reason: {err[-500:]}")
                break
            start = done
            continue
        if total is None:  # died before listing the cases (import, build): nothing to resume
            failures.append(f"{name}.{function}: the child {cause} before running a case: {err[-1500:]}")
            break
        failures.append(f"{name}.{function}[{done}]: {cause} (the process would have crashed); stderr: {err[-800:]}")
        start = done + 1
    return total or 0, failures


def _child(module: str, function: str, device: str, start: int) -> None:
    import importlib
    import importlib.util

    mod = None
    if device == "cuda":
        import torch

        from modelopt_lite.functional import backend

        mod = backend._load("cuda")
        if mod is None:
            raise SystemExit(f"the CUDA kernels failed to build: {backend.native_error('cuda')}")
    if module.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module).stem, module)
        assert spec is not None and spec.loader is not None
        cases_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cases_module)
    else:
        cases_module = importlib.import_module(module)
    cases = getattr(cases_module, function)(device)
    print(f"TOTAL {len(cases)}", flush=True)
    for i in range(start, len(cases)):
        call, exc, msg = cases[i]
        try:
            call(mod)
            status = "FAIL no exception raised"
        except exc as e:
            text = str(e).replace("\n", " ")
            status = "OK" if re.search(msg, text) else f"FAIL {exc.__name__} without {msg!r}: {text[:300]}"
        except Exception as e:  # noqa: BLE001 (reported as the case's failure)
            status = f"FAIL {type(e).__name__} instead of {exc.__name__}: {str(e)[:300]}"
        if device == "cuda":
            torch.cuda.synchronize()  # no device-side error left behind (torch is imported above for "cuda")
        print(f"CASE {i} {status}", flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
