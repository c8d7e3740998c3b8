"""Process trees: stopping a launcher and everything it started, and Python stacks on request.

torchrun starts each rank in a session of its own, so a signal to the launcher's process group does not
reach the ranks: a launcher killed past its time leaves them on the GPUs, waiting in a collective. What a
launcher started is found by walking parent links (Linux ``/proc``) while the launcher is still alive,
before anything is signalled.

Stacks asked for by SIGUSR1 go to the process's stderr, or, in a tree started by :func:`launch`, to a file
of each process's own (``RLMEM_STACKS_DIR``): the ranks of one launcher share its stderr, and dumps written
at once into one pipe interleave character by character. :func:`stop_tree` then adds each file to the
output under its process's pid, rank and command.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

STACKS_SIGNAL = signal.SIGUSR1
STACKS_DIR_ENV = "RLMEM_STACKS_DIR"
_STACK_DIRS: dict[int, str] = {}  # launcher pid -> the directory its tree writes its stacks to


def _stack_file(where: str, pid: int) -> str:
    """Where process ``pid`` of a tree :func:`launch` started writes its stacks."""
    return os.path.join(where, f"stacks-{pid}.txt")


def dump_stacks_on_signal() -> None:
    """``kill -USR1 PID`` writes every thread's Python stack of this process to stderr (a rank that seems
    stuck says where), or under :func:`launch` to ``$RLMEM_STACKS_DIR/stacks-PID.txt``. Installed by rlmem's
    command-line entry points only, where SIGUSR1 is unhandled."""
    if sys.platform == "win32" or signal.getsignal(STACKS_SIGNAL) != signal.SIG_DFL:
        return
    # the process's own stderr (file descriptor 2), not a replacement of sys.stderr (a capture has none)
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no stderr at all: nothing to write to
        where, out = os.environ.get(STACKS_DIR_ENV), sys.__stderr__
        if where:  # faulthandler keeps the file (and its descriptor) for as long as the handler is registered
            with contextlib.suppress(OSError):  # the directory gone (its launcher ended): stderr
                out = open(_stack_file(where, os.getpid()), "w")  # noqa: SIM115
        faulthandler.register(STACKS_SIGNAL, file=out, all_threads=True, chain=False)


def launch(argv: list[str], *, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` as :func:`stop_tree` takes it: in a session of its own, every process below it
    writing the stacks SIGUSR1 asks for to a file of its own (read back by :func:`stop_tree`; the directory
    goes with :func:`done`). ``popen``: the rest of ``subprocess.Popen``'s arguments (pipes, text)."""
    where = tempfile.mkdtemp(prefix="rlmem-stacks-")
    try:
        proc = subprocess.Popen(
            argv,
            env={**(os.environ if env is None else env), STACKS_DIR_ENV: where},
            start_new_session=True,
            **popen,
        )
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    _STACK_DIRS[proc.pid] = where
    return proc


def done(proc: subprocess.Popen) -> None:
    """Forget a launcher :func:`launch` started: its stacks' directory goes."""
    where = _STACK_DIRS.pop(proc.pid, None)
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)


def _label(pid: int) -> str:
    """``pid N, RANK=r: command`` of a live process (what /proc says of it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = " ".join(a.decode(errors="replace") for a in f.read().split(b"\0")[:6] if a)
        with open(f"/proc/{pid}/environ", "rb") as f:
            rank = next((v[5:].decode() for v in f.read().split(b"\0") if v.startswith(b"RANK=")), None)
    except OSError:
        return f"pid {pid}"
    return f"pid {pid}" + (f", RANK={rank}" if rank is not None else "") + f": {cmd}"


def _stacks(where: str, pids: list[int], labels: dict[int, str]) -> str:
    """Each process's stack file in ``where`` that holds anything, under its label."""
    out = []
    for pid in pids:
        try:
            with open(_stack_file(where, pid), errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if text.strip():
            out.append(f"--- stacks of {labels.get(pid, f'pid {pid}')} ---\n{text}")
    return "\n".join(out)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, in sessions of their own included (empty where there is no
    ``/proc``)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        # the command name (in parentheses) may hold spaces: the fields after its last ')' are fixed
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stop_tree(proc: subprocess.Popen, *, stacks_s: float = 0.0) -> tuple[str, str]:
    """Kill ``proc`` (started with ``start_new_session=True`` and pipes) and every process below it, and
    return what it had written ``(stdout, stderr)``.

    Args:
        proc: the launcher.
        stacks_s: first send every process below it SIGUSR1 and wait this long: those that called
            :func:`dump_stacks_on_signal` write their Python stacks into the output (0: kill at once).
    """
    below = descendants(proc.pid)  # while the links to the launcher exist
    where, stacks = _STACK_DIRS.get(proc.pid), ""
    if stacks_s > 0 and below:
        labels = {pid: _label(pid) for pid in below}  # before they are killed
        for pid in below:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, STACKS_SIGNAL)
        time.sleep(stacks_s)
        if where is not None:
            stacks = _stacks(where, below, labels)
        below += [p for p in descendants(proc.pid) if p not in below]  # started meanwhile
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a process no walk saw still holds the pipes: give up on the rest
        proc.kill()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
        proc.wait()
        out, err = "", "(the output could not be read: a process it started still holds its pipes)"
    finally:
        done(proc)
    # the stacks last: what a failure keeps of the output is its end
    return out or "", (err or "") + (f"\n{stacks}" if stacks else "")


def communicate_or_stop(proc: subprocess.Popen, timeout: float | None) -> tuple[str, str, bool]:
    """``proc.communicate(timeout)`` for a launcher started as :func:`stop_tree` takes it: its
    ``(stdout, stderr, False)``; past ``timeout`` the whole tree stopped, every process's stacks first:
    ``(stdout, stderr, True)``. Anything raised meanwhile (Ctrl-C, a SIGTERM turned into an exception) stops
    the tree at once and goes on up."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop_tree(proc, stacks_s=3.0)
        return out, err, True
    except BaseException:
        stop_tree(proc)  # it may have ended on its own meanwhile
        raise
    done(proc)
    return out or "", err or "", False
