"""What every rlmem benchmark shares: the machine's description, timing, the table and the JSON file."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .._procs import communicate_or_stop, launch


def package_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_name(device: torch.device) -> str:
    """A short name for the machine, like ``nvidia-h100-x1`` or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    m = re.search(r"\b([a-z]+\d{2,4}[a-z]?)\b", name)
    model = m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"nvidia-{model}-x{torch.cuda.device_count()}"


def environment(device: torch.device) -> dict[str, Any]:
    """Device, versions, host and date, for the JSON header of a benchmark."""
    from .. import __version__

    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "rlmem": __version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cuda_bindings": package_version("cuda-bindings"),
            "python": platform.python_version(),
        },
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    try:
        with open("/proc/meminfo") as f:
            env["host"]["mem_total_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device"] = {
            "type": "cuda",
            "name": props.name,
            "index": device.index,
            "count": torch.cuda.device_count(),
            "total_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
        try:
            from ..memory._cuda import call

            v = int(call("cuDriverGetVersion"))
            env["versions"]["driver_cuda"] = f"{v // 1000}.{(v % 1000) // 10}"
        except Exception:
            pass
    else:
        env["device"] = {"type": "cpu", "name": platform.processor() or platform.machine()}
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn`` takes, device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def warm_steps(handle: Any, done: int, warm: int, cap: int = 128) -> int:
    """Untimed steps before the timed ones: ``warm``, plus one more each time ``done`` reaches it while a
    budget-mode activation handle is still measuring its plan (``handle.settled``), at most ``cap``."""
    if done == warm and not getattr(handle, "settled", True) and warm < cap:
        return warm + 1
    return warm


def spawn_part(
    module: str,
    part: str,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    nproc: int = 1,
    timeout_s: float | None = None,
    outcome_key: str | None = None,
) -> dict[str, Any]:
    """Run ``python -m module --part part *argv`` in a process of its own (a fresh CUDA context), or under
    torchrun in ``nproc`` (one per GPU), and return the JSON object its last ``{`` line prints (the lead
    rank's); ``{"error": ...}`` with its stderr's end if there is none, or if it ran past ``timeout_s``
    (then every process it started is killed). A line whose ``outcome_key`` is true is the part's outcome
    even where the launch failed (a rank that prints one, then fails to end the others)."""
    run = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if nproc > 1:
        run.append(f"--nproc-per-node={nproc}")
    cmd = [*run, "-m", module, "--part", part, *argv]
    # its own session: a part that runs over its time goes whole, each process's stacks first
    popen = launch(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    # The part runs in a session of its own, which a signal to this process's group (coreutils' timeout,
    # Ctrl-C) does not reach: a SIGTERM here ends this process through an exception, which takes the part
    # with it, instead of leaving its ranks on the GPUs.
    # (Only the main thread can set a handler; None: one not set from Python, left alone.)
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    if before is not None:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        # past its time: torchrun's ranks too (each in a session of their own), their stacks first
        out, err, late = communicate_or_stop(popen, timeout_s)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    if late:
        return {"error": f"ran past {timeout_s:g} s: {err[-12000:]}"}  # each rank's stacks at the end
    sys.stderr.write(err[-4000:])
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if popen.returncode != 0 and outcome_key is not None:
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                if (obj := json.loads(line)).get(outcome_key):
                    return obj
    if popen.returncode != 0 or not lines:
        return {"error": f"exit {popen.returncode}: {err[-3000:]}"}
    return json.loads(lines[-1])


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def visible_gpus() -> list[str]:
    """This process's GPUs as ``CUDA_VISIBLE_DEVICES`` entries for a child (one GPU each)."""
    n = torch.cuda.device_count()
    named = [x for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return named[:n] if named else [str(i) for i in range(n)]


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Render ``rows`` as a text table; ``columns`` are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, spec in columns:
            v = r.get(key)
            line.append("-" if v is None else format(v, spec))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for k, c in enumerate(cells):
        out.append("  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
}


def check_targets(summary: dict[str, Any], targets: dict[str, tuple[str, float]]) -> dict[str, bool]:
    """Which targets (``name: (op, value)``) the summary meets; targets it has no figure for are left out."""
    return {k: _OPS[op](summary[k], v) for k, (op, v) in targets.items() if k in summary}


def targets_text(targets: dict[str, tuple[str, float]]) -> dict[str, str]:
    return {k: f"{op} {v}" if isinstance(v, bool) else f"{op} {v:g}" for k, (op, v) in targets.items()}


def summary_lines(summary: dict[str, Any], met: dict[str, bool]) -> str:
    """The summary and target lines every benchmark prints under its table."""
    text = "summary: " + ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
    )
    if met:
        text += "\ntargets met: " + ", ".join(f"{k}={v}" for k, v in met.items())
    return text


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return p


def link_rates(
    device: torch.device, nbytes: int = 1 << 30, before_each: Callable[[], Any] | None = None
) -> tuple[float, float]:
    """Pinned D2H and H2D copy rates (bytes/s, best of 4) of ``nbytes``; ``before_each`` is called before
    each copy is started (e.g. a barrier, for every rank to copy at once)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(4):
        for out, src, acc in ((host, dev, d2h), (dev, host, h2d)):
            torch.cuda.synchronize(device)
            if before_each is not None:
                before_each()
            t0 = time.perf_counter()
            out.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            acc.append(time.perf_counter() - t0)
    del dev, host
    return nbytes / min(d2h), nbytes / min(h2d)
