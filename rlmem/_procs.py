"""Process trees: stopping a launcher and everything it started, and Python stacks on request.

torchrun starts each rank in a session of its own, so a signal to the launcher's process group does not
reach the ranks: a launcher killed past its time leaves them on the GPUs, waiting in a collective. What a
launcher started is found by walking parent links (Linux ``/proc``) while the launcher is still alive,
before anything is signalled.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import time

STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> None:
    """``kill -USR1 PID`` writes every thread's Python stack of this process to stderr (a rank that seems
    stuck says where). Installed by rlmem's command-line entry points only, where SIGUSR1 is unhandled."""
    if sys.platform == "win32" or signal.getsignal(STACKS_SIGNAL) != signal.SIG_DFL:
        return
    # the process's own stderr (file descriptor 2), not a replacement of sys.stderr (a capture has none)
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no stderr at all: nothing to write to
        faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True, chain=False)


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
    if stacks_s > 0 and below:
        for pid in below:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, STACKS_SIGNAL)
        time.sleep(stacks_s)
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
        return "", "(the output could not be read: a process it started still holds its pipes)"
    return out or "", err or ""


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
    return out or "", err or "", False
