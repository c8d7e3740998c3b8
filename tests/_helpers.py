"""Test helpers: bit-level comparison, random contents, running code in a fresh process, and ranks of a
process group spawned by a script."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a).cpu(), as_bytes(b).cpu())


def fill_random(t: torch.Tensor, seed: int) -> None:
    """Random bit patterns (NaNs and denormals included), so comparisons are bit-exact."""
    g = torch.Generator().manual_seed(seed)
    b = as_bytes(t)
    high = 2 if t.dtype == torch.bool else 256  # other bytes are not valid bools
    b.copy_(torch.randint(0, high, (b.numel(),), dtype=torch.uint8, generator=g))


def run_fresh(code: str, timeout: float = 600) -> dict:
    """Run ``code`` in a new Python process; it must print one JSON object as its last line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now (for a rendezvous or a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_worlds(*sizes: int) -> list[Any]:
    """A ``pytest.param`` per world size for a test run with a rank per GPU: marked ``gpus(n)`` (skipped with
    fewer devices) and named ``world<n>``, so ``-k world4`` picks the four-GPU runs."""
    import pytest  # here: the scripts the tests spawn import this module too

    return [pytest.param(n, marks=pytest.mark.gpus(n), id=f"world{n}") for n in sizes]


def spawn_ranks(worker: Any, world: int, out: str, *args: Any) -> None:
    """Run ``worker(rank, world, port, out, *args)`` in ``world`` processes (``port``: a free one for the
    process group's rendezvous), then print what rank 0 wrote to ``out``."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, free_port(), out, *args), nprocs=world, join=True)
    with open(out) as f:
        print(f.read())


class JSONHandler(BaseHTTPRequestHandler):
    """A quiet request handler answering JSON (the stand-ins of the servers rlmem's clients talk to)."""

    def log_message(self, *a):  # quiet
        pass

    def _answer(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
