"""Stopping a launcher and what it started: ranks in sessions of their own (as torchrun starts them) are
found, say where they were, and are killed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _helpers import run_launcher

from rlmem._procs import descendants, stop_tree

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="walks /proc")

# A launcher starting two "ranks", each in a session of its own, that never end.
_LAUNCHER = """
import subprocess, sys, time
rank = '''
import importlib.util, sys, time
# the module alone, by its path: not the package (and torch) in every rank
spec = importlib.util.spec_from_file_location("procs", sys.argv[1] + "/rlmem/_procs.py")
procs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(procs)
procs.dump_stacks_on_signal()
def waiting_in_a_collective():
    print("rank up", flush=True)
    time.sleep(600)
waiting_in_a_collective()
'''
kids = [subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]], start_new_session=True) for _ in range(2)]
with open(sys.argv[2], "w") as f:
    f.write(" ".join(str(k.pid) for k in kids))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def _all_ended(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def _start(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pids = tmp_path / "pids"
    argv = [sys.executable, "-c", _LAUNCHER, root, str(pids)]
    return argv, pids


def _wait_for(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def test_a_launcher_past_its_time_takes_its_ranks_with_it_and_they_say_where_they_were(tmp_path):
    argv, pids = _start(tmp_path)
    before = set(Path(tempfile.gettempdir()).glob("rlmem-stacks-*"))
    with pytest.raises(AssertionError) as e:
        run_launcher(argv, timeout=8)
    ranks = [int(p) for p in pids.read_text().split()]
    assert len(ranks) == 2
    # each rank's Python stack, from SIGUSR1, in what the failure says: under its pid, whole (each rank
    # wrote to a file of its own; written at once into the launcher's one stderr they interleave)
    text = str(e.value)
    assert "ran past 8 s" in text
    blocks = text.split("--- stacks of ")[1:]
    assert sorted(int(b.split()[1].rstrip(",:")) for b in blocks) == sorted(ranks), text[-3000:]
    assert all("waiting_in_a_collective" in b and "(most recent call first)" in b for b in blocks)
    assert _all_ended(ranks)
    assert set(Path(tempfile.gettempdir()).glob("rlmem-stacks-*")) <= before  # the files went with the run


def test_stop_tree_finds_ranks_in_their_own_sessions(tmp_path):
    argv, pids = _start(tmp_path)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    ranks = _wait_for(pids)
    assert set(ranks) <= set(descendants(proc.pid))
    assert all(os.getsid(p) == p for p in ranks)  # not in the launcher's session: killpg would miss them
    stop_tree(proc)  # no stacks asked for: killed at once
    assert proc.returncode == -9
    assert _all_ended(ranks)
    assert descendants(proc.pid) == []
