"""Running a test's worker on several gloo ranks on localhost (shared by the distributed tests)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, outdir, world: int, timeout: float, what: str) -> list:
    """Spawn ``worker(rank, port, outdir)`` on ``world`` processes, wait (failing the test after ``timeout``
    seconds, naming ``what``), and return what each rank saved as ``outdir/rank{r}.pt``."""
    ctx = mp.start_processes(worker, args=(free_port(), str(outdir)), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} workers hung (timeout)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(Path(outdir) / f"rank{r}.pt") for r in range(world)]
