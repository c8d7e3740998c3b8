"""``torchrun -m rlmem train engine=server``: a server per rank (each on its rank's device, sampling that
rank's share from its shared rollout copy) trains as ``engine=local`` does at the same world size, step for
step; one rank's server killed ends every rank with a checkpoint and a message naming the rank, and
``resume=auto`` finishes the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import gpu_worlds, run_launcher, shared_server_argv

from rlmem._procs import stop_tree

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

_COMMON = ["prompts_per_step=8", "group_size=4", "kl_coef=0.1", "micro_batch_size=4", "offload=true"]
_COMMON += ["plot=false", "progress=false"]


def _cmd(out: Path, device: str, *args: str, world: int = 2) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    return [*run, "-m", "rlmem", "train", f"device={device}", *_COMMON, *args, f"out_dir={out}"]


def _rows(out: Path) -> list[dict]:
    log = out / "log.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return [r for r in map(json.loads, lines) if "loss" in r]


def _compare(tmp_path: Path, device: str, world: int = 2) -> None:
    for name, extra in (("server", ["engine=server"]), ("local", [])):
        proc = run_launcher(_cmd(tmp_path / name, device, "steps=3", *extra, world=world), timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    server, local = _rows(tmp_path / "server"), _rows(tmp_path / "local")
    keys = ("reward", "loss", "kl", "grad_norm", "tokens")
    assert len(server) == len(local) == 3
    assert [[r[k] for k in keys] for r in server] == [[r[k] for k in keys] for r in local]
    # each rank had its own server, which logged beside the run
    assert all((tmp_path / "server" / f"server-rank{r}.log").is_file() for r in range(world))
    summary = json.loads((tmp_path / "server" / "summary.json").read_text())
    assert summary["world_size"] == world
    # the summary (and the table) have each rank's memory, its server's cache among it; each rank its timeline
    ranks = summary["phases_by_rank"]
    assert len(ranks) == world and all(r["rollout"]["max_server_kv_cache"] > 0 for r in ranks)
    assert all(r["train"]["max_server_kv_cache"] == 0 for r in ranks)
    assert all((tmp_path / "server" / f"timeline-rank{r}.jsonl").is_file() for r in range(1, world))


def test_a_server_per_cpu_rank_trains_as_the_local_engine(tmp_path):
    _compare(tmp_path, "cpu")


@pytest.mark.parametrize("world", gpu_worlds(2, 4))
def test_a_server_per_gpu_trains_as_the_local_engine(tmp_path, world):
    _compare(tmp_path, "cuda", world)


def test_each_rank_joins_the_running_server_of_its_local_rank(tmp_path):
    # engine_url with {local_rank}: two servers started beforehand (each with its broker), each rank trains
    # through its own, as the local engine does; the servers, not started by the run, are left running.
    from rlmem.colocate import Broker

    brokers, servers, socks = [], [], [tmp_path / "s" / f"serve-{r}.sock" for r in range(2)]
    try:
        for r, sock in enumerate(socks):
            brokers.append(Broker(tmp_path / f"b{r}" / "broker.sock").start())
            argv = shared_server_argv(tmp_path, brokers[-1], sock)
            with open(tmp_path / f"serve-{r}.log", "w") as log:  # a file: a full pipe would stall it
                servers.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while not all(s.exists() for s in socks):
            assert all(p.poll() is None for p in servers), [
                (tmp_path / f"serve-{r}.log").read_text() for r in range(2)
            ]
            assert time.monotonic() < deadline, "the servers did not start within 120 s"
            time.sleep(0.1)
        url = f"engine_url=unix://{tmp_path / 's'}/serve-{{local_rank}}.sock"
        for name, extra in (("url", ["engine=server", url]), ("local", [])):
            proc = run_launcher(_cmd(tmp_path / name, "cpu", "steps=2", *extra), timeout=600)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        keys = ("reward", "loss", "kl", "grad_norm", "tokens")
        joined, local = _rows(tmp_path / "url"), _rows(tmp_path / "local")
        assert len(joined) == 2
        assert [[r[k] for k in keys] for r in joined] == [[r[k] for k in keys] for r in local]
        assert all(p.poll() is None for p in servers)  # not started by the run: left running
        # each rank sampled its share through its own server: both generated, together the run's tokens
        made = [_generated(sock) for sock in socks]
        assert all(n > 0 for n in made) and sum(made) == sum(r["tokens"] for r in joined), made
    finally:
        for p in servers:
            p.kill()
            p.wait(10)
        for b in brokers:
            b.close()


def _generated(sock: Path) -> int:
    """The tokens the rlmem server at ``sock`` has generated."""
    from rlmem import RemoteEngine

    eng = RemoteEngine(f"unix://{sock}", timeout=10)
    try:
        return int(eng.stats()["tokens_generated"])
    finally:
        eng.close()


def _server_of_rank(rank: int) -> int | None:
    """The pid of the ``rlmem serve`` started by the trainer of torchrun rank ``rank``, if running."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" not in argv or b"--exit-with" not in argv:
            continue
        trainer = argv[argv.index(b"--exit-with") + 1].decode()
        try:
            env = (Path("/proc") / trainer / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


def _interrupted(out: Path, steps: int, hit) -> tuple[subprocess.Popen, str, float]:
    """A run of ``steps`` with a server per rank; once it has logged a step, ``hit()`` (a fault) is done to
    it. Returns the launcher, what it printed, and how long it took to end after ``hit``."""
    argv = _cmd(out, "cpu", f"steps={steps}", "max_new_tokens=64", "engine=server")
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 600
        while not _rows(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before a step was logged"
        hit(proc)
        t = time.monotonic()
        text, _ = proc.communicate(timeout=300)
        return proc, text, time.monotonic() - t
    finally:
        if proc.poll() is None:  # the ranks too (torchrun starts each in a session of its own)
            stop_tree(proc)


def _resumed(out: Path, steps: int) -> None:
    """``resume=auto`` finishes the run from the checkpoint the interrupted one left."""
    again = run_launcher(
        _cmd(out, "cpu", f"steps={steps}", "max_new_tokens=64", "engine=server", "resume=auto"), timeout=900
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    assert (out / f"checkpoint-{steps}").is_dir() and len(_rows(out)) == steps


def test_one_ranks_server_killed_ends_every_rank_with_a_checkpoint(tmp_path):
    out, victim = tmp_path / "run", []

    def kill(proc):
        victim.append(_server_of_rank(1))
        os.kill(victim[0], signal.SIGKILL)

    proc, text, ended_in = _interrupted(out, 4, kill)
    assert proc.returncode != 0
    # both ranks name the rank, the server's pid and its exit code (rank 0's server was fine)
    named = f"rank 1: the rollout server (pid {victim[0]}, exit code -9) was lost"
    assert text.count(f"rlmem train: error: {named}") == 2, text[-4000:]  # one line from each rank
    assert ended_in < 120, ended_in
    done = len(_rows(out))
    assert 1 <= done < 4 and (out / f"checkpoint-{done}").is_dir(), text[-3000:]
    _resumed(out, 4)


def test_ctrl_c_stops_every_rank_after_the_step_with_a_checkpoint_and_their_servers(tmp_path):
    out, servers = tmp_path / "run", []

    def ctrl_c(proc):
        servers.extend(_server_of_rank(r) for r in (0, 1))
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at a terminal does: every process of the group

    _, text, _ = _interrupted(out, 6, ctrl_c)
    assert None not in servers
    done = len(_rows(out))
    assert 1 <= done < 6 and (out / f"checkpoint-{done}").is_dir(), text[-3000:]
    assert f"interrupted after {done} steps" in text
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in servers)  # no server left behind
    _resumed(out, 6)


def test_the_server_benchmark_runs_a_rank_per_device(tmp_path):
    # rlmem bench grpo_colocated --engine server --gpus 2, as on two GPUs, here on two CPU ranks
    from rlmem.benchmarks import grpo_colocated

    out = tmp_path / "bench.json"
    argv = ["--engine", "server", "--device", "cpu", "--model", "tiny", "--gpus", "2", "--prompts", "2"]
    argv += ["--group", "2", "--max-new-tokens", "8", "--kv-big-gib", "0.01", "--steps", "2"]
    argv += ["--parts", "server-big-offload,big-offload", "--json", str(out)]
    assert grpo_colocated.main(argv) == 0
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["world_size"] == 2 and s["fits_with_rlmem"] and s["step_vs_single_process"] > 0
    assert len(s["rank_peaks_gib_server"]) == 2
    assert all(r["server_rollout"] > 0 for r in s["rank_peaks_gib_server"])  # each rank's own server
    # each GPU the one-GPU workload: 2 prompts x 2 samples per rank, 8 sequences in all
    assert data["results"]["server-big-offload"]["steps"][-1]["tokens"] <= 8 * 8
    assert data["results"]["big-offload"]["world_size"] == 2


@pytest.mark.parametrize("world", gpu_worlds(2, 4))
def test_a_server_per_gpu_with_the_trainers_communicators_suspended(tmp_path, world):
    # While each rank's server samples, the trainer's NCCL communicators give their memory back; training
    # is what it is with them kept. An NCCL that cannot suspend is refused before anything is built.
    from rlmem.comm import _nccl

    args = ["steps=2", "engine=server", "rollout_dtype=bf16", "save_every=0"]
    if not _nccl.library().has_suspend:
        cmd = _cmd(tmp_path / "refused", "cuda", *args, "comms=suspend", world=world)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0 and "comms='suspend' needs an NCCL that can suspend" in proc.stderr
        return
    for comms in ("keep", "suspend"):
        cmd = _cmd(tmp_path / comms, "cuda", *args, f"comms={comms}", world=world)
        proc = run_launcher(cmd, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    keep, susp = _rows(tmp_path / "keep"), _rows(tmp_path / "suspend")
    assert [(r["reward"], r["loss"]) for r in keep] == [(r["reward"], r["loss"]) for r in susp]
    assert all(len(r["comm_freed_bytes_by_rank"]) == world for r in susp)
    assert all(b > 0 for r in susp for b in r["comm_freed_bytes_by_rank"])


_AGREE = """
import json, sys
sys.path[:0] = sys.argv[2:4]  # the checkout and its tests
import torch
import torch.distributed as dist
from _helpers import free_port, rank_group, spawn
from rlmem.rollout.remote.server_rollout import EngineLostError, ServerRollout


def worker(rank, world, port, out):
    with rank_group("gloo", rank, world, port):
        eng = ServerRollout.__new__(ServerRollout)  # the agreement alone: no server behind it
        eng._group, eng._rank = dist.group.WORLD, rank
        eng._guard = lambda fn, *a, **k: fn(*a, **k)
        seen = []
        for fails in ({}, {1: "oom"}, {1: "oom", 2: "lost"}, {2: "boom"}):
            def call():
                what = fails.get(rank)
                if what == "oom":
                    raise torch.OutOfMemoryError(f"no room on {rank}")
                if what == "lost":
                    raise EngineLostError(f"server of {rank} gone")
                if what:
                    raise ValueError(what)
                return rank
            try:
                seen.append(["ok", eng._call(call)])
            except Exception as e:
                seen.append([type(e).__name__, str(e)])
        with open(f"{out}.{rank}", "w") as f:
            json.dump(seen, f)


if __name__ == "__main__":
    spawn(worker, 3, 3, free_port(), sys.argv[1])
"""


def test_a_failure_on_one_rank_raises_its_kind_on_every_rank(tmp_path):
    # Under torchrun every server call ends in the ranks' agreement: a rank whose server ran out of memory
    # makes every rank raise an out-of-memory error naming it (what a caller trying a smaller cache
    # catches), a lost server wins over it (the run ends with its checkpoint), anything else a RuntimeError.
    from _helpers import ROOT, run_ranks

    script = tmp_path / "agree.py"
    script.write_text(_AGREE)
    proc = run_ranks(script, str(tmp_path / "seen"), str(ROOT), str(ROOT / "tests"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(3)]
    assert [s[0] for s in seen] == [["ok", 0], ["ok", 1], ["ok", 2]]
    assert seen[0][1] == seen[2][1] == ["OutOfMemoryError", "rank 1: no room on 1"]
    assert seen[1][1] == ["OutOfMemoryError", "no room on 1"]  # its own, as raised
    assert seen[0][2] == ["EngineLostError", "rank 2: server of 2 gone"] == seen[2][2]
    assert seen[1][2] == ["OutOfMemoryError", "no room on 1"]
    assert seen[0][3] == seen[1][3] == ["RuntimeError", "rank 2: boom"]
    assert seen[2][3] == ["ValueError", "boom"]
