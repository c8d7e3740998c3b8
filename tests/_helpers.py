"""Test helpers: bit-level comparison, random contents, running code in a fresh process, and ranks of a
process group spawned by a script."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

from rlmem._procs import communicate_or_stop, launch

ROOT = Path(__file__).resolve().parents[1]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a).cpu(), as_bytes(b).cpu())


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Two lists of tensors equal one for one: same dtype, shape and values."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


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


GROUP_TIMEOUT_S = 300.0  # the longest a rank waits in one collective (a peer gone or stuck ends it then)


@contextmanager
def rank_group(backend: str, rank: int, world: int, port: int, **kw: Any) -> Iterator[None]:
    """This rank's default process group (its rendezvous at 127.0.0.1:``port``) over the block, each
    collective bounded by :data:`GROUP_TIMEOUT_S`. Leaving the block normally, the ranks meet at a barrier
    before any of them destroys the group, so that none tears it down while another still uses it; it is
    destroyed on every path (after an error without the barrier: the peer may be gone)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(worker: Any, nprocs: int, *args: Any) -> None:
    """``worker(i, *args)`` in ``nprocs`` fresh processes (torch.multiprocessing.spawn: when one fails the
    others are ended and its error is raised here). A process whose ``worker`` returned leaves at once with
    ``os._exit(0)``, its output flushed: not through the interpreter's teardown, in which a Gloo rank that
    had finished its work was seen to abort (SIGABRT, ``terminate called without an active exception``: a
    C++ thread of the group's leftovers meeting the interpreter as it is torn down), as ``rlmem train``'s
    ranks were before it left the same way."""
    import torch.multiprocessing as mp

    mp.spawn(_leave_after, args=(worker, *args), nprocs=nprocs, join=True)


def _leave_after(i: int, worker: Any, *args: Any) -> None:
    worker(i, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker: Any, world: int, out: str, *args: Any) -> None:
    """Run ``worker(rank, world, port, out, *args)`` in ``world`` processes with :func:`spawn` (``port``: a
    free one for the process group's rendezvous), then print what rank 0 wrote to ``out``."""
    spawn(worker, world, world, free_port(), out, *args)
    with open(out) as f:
        print(f.read())


def shared_server_argv(tmp: Path, broker: Any, sock: Path) -> list[str]:
    """``rlmem serve`` of the tiny policy on the CPU, joining ``broker`` with shared weights and answering
    at ``sock`` (the server needs the architecture only: the policy's config, saved in ``tmp/model``)."""
    from rlmem.models import load_model

    cfg_dir = tmp / "model"
    if not (cfg_dir / "config.json").is_file():
        model = load_model("tiny", torch.device("cpu"), torch.float32)
        model.config.save_pretrained(cfg_dir)
    argv = [sys.executable, "-m", "rlmem", "serve", str(cfg_dir), "--weights", "shared", "--device", "cpu"]
    argv += ["--broker", str(broker.path), "--uds", str(sock), "--pad-id", "0", "--eos-id", "2"]
    return [*argv, "--max-len", "64", "--batch-size", "16"]


def run_launcher(argv: list[str], *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``argv`` (a launcher: torchrun, or a script that spawns ranks) in a session of its own, its output
    captured. Past ``timeout`` every process below it writes its Python stacks (rlmem's entry points dump
    them on SIGUSR1; torchrun's ranks are in sessions of their own), then all are killed, the ranks
    included, and the run fails with their output; so is anything of it still there once the launcher
    exited."""
    proc = launch(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err, late = communicate_or_stop(proc, timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if late:
        name = " ".join(str(a) for a in argv[1:4])
        raise AssertionError(f"{name} ran past {timeout:g} s, killed:\n{out[-2000:]}{err[-20000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_ranks(script: Path, *args: str, timeout: float = 600, env: dict | None = None) -> Any:
    """``python script args...`` (a script that spawns ranks) through :func:`run_launcher`."""
    return run_launcher([sys.executable, str(script), *args], timeout=timeout, env=env)


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


def serve_routes(outer: Any) -> tuple[ThreadingHTTPServer, str]:
    """A stand-in server on 127.0.0.1 (a thread of its own), and its URL: each request is recorded in
    ``outer.requests`` as (method, path, query, body) and answered with ``outer.route(method, path, query,
    body)`` -> (code, body), a code of None closing the connection unanswered (a server that died); 401
    where ``outer.token`` is set and the request does not carry it."""

    class Handler(JSONHandler):
        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def _route(self, method: str) -> None:
            u = urlparse(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            token = getattr(outer, "token", None)
            if token and self.headers.get("Authorization") != f"Bearer {token}":
                return self._answer(401, {"error": "unauthorized"})
            outer.requests.append((method, u.path, parse_qs(u.query), body))
            code, out = outer.route(method, u.path, parse_qs(u.query), body)
            if code is None:
                self.close_connection = True
                return
            self._answer(code, out)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def in_thread(fn: Any) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a thread; (thread, box): box["out"] or box["error"], and box["t"] when it ended."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except Exception as e:
            box["error"] = e
        box["t"] = time.monotonic()

    th = threading.Thread(target=run)
    th.start()
    return th, box


def read_text(path: Path) -> str:
    """A file's text, "" while it does not exist (another process writes it)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def make_venv(root: Path, install: list[list[str]], what: str, marker: str) -> tuple[Path | None, str]:
    """A venv of its own at ``root``, made once per machine: ``python -m venv``, then each command of
    ``install`` (``{python}`` in one stands for the venv's python), marked ready with ``marker`` when all
    succeed. (the venv's python, "") or (None, why ``what`` could not be made)."""
    py = root / "bin" / "python"
    done = root / ".rlmem-ready"
    if done.is_file():
        return py, ""
    steps = [[sys.executable, "-m", "venv", "--clear", str(root)]]
    steps += [[str(py) if a == "{python}" else a for a in cmd] for cmd in install]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"could not make {what} ({' '.join(cmd[2:5])}): {' | '.join(tail)}"
    done.write_text(marker)
    return py, ""


def install_checkout(python: Path, what: str) -> str:
    """Install this checkout into another venv (editable, no dependencies: that venv's own packages stay);
    "" or why it could not."""
    cmd = [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return f"could not install rlmem into {what}: {tail}"
    return ""
