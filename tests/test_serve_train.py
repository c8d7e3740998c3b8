"""``rlmem train engine=server``: the rollout in ``rlmem serve`` (a process of its own) sampling from the
trainer's shared rollout copy, handing the device over through a broker: the same rollouts, rewards and
losses as the sampler in the trainer's process for the same seed; the server's memory in the table; a server
killed mid-rollout ends the run with a clear error and a checkpoint of the intact state; ``engine_url=`` to
a server already running; Ctrl-C ends the run with a checkpoint and stops the server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _helpers import shared_server_argv
from safetensors.torch import load_file

from rlmem.colocate import Broker
from rlmem.recipes import grpo
from rlmem.recipes.config import GRPOConfig
from rlmem.rollout.remote.server_rollout import EngineLostError, ServerRollout


def _cfg(out: Path, device: str, **kw) -> GRPOConfig:
    base = dict(
        device=device,
        steps=3,
        prompts_per_step=4,
        group_size=4,
        offload=True,
        out_dir=str(out),
        progress=False,
        plot=False,
    )
    return GRPOConfig(**{**base, **kw})


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert (x["reward"], x["loss"], x["tokens"]) == (y["reward"], y["loss"], y["tokens"])


def test_train_through_the_server_matches_the_local_sampler(device, tmp_path):
    s_server = grpo.run(_cfg(tmp_path / "server", device, engine="server"), echo=lambda *a, **k: None)
    grpo.run(_cfg(tmp_path / "local", device), echo=lambda *a, **k: None)
    _same(_rows(tmp_path / "server"), _rows(tmp_path / "local"))
    # The server's cache shows in the timeline: held in rollout, given back once in train (after the
    # phase's entry sample, taken before the switch).
    assert s_server["phases"]["rollout"]["max_server_kv_cache"] > 0
    lines = (tmp_path / "server" / "timeline.jsonl").read_text().splitlines()
    samples = [json.loads(line)["sample"] for line in lines if '"sample"' in line]
    train = [
        s["categories"]["server_kv_cache"] for s in samples if s["phase"] == "train" and not s.get("entry")
    ]
    assert train and all(b == 0 for b in train)
    a = load_file(str(tmp_path / "server" / "checkpoint-3" / "model.safetensors"))
    b = load_file(str(tmp_path / "local" / "checkpoint-3" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_server_killed_mid_rollout_ends_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    real = ServerRollout.generate
    calls = {"n": 0}

    def generate(self, prompts, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the second rollout: the server dies under it
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        return real(self, prompts, **kw)

    monkeypatch.setattr(ServerRollout, "generate", generate)
    with pytest.raises(EngineLostError, match=r"rollout server \(pid \d+, exit code -9\)"):
        grpo.run(_cfg(tmp_path / "killed", "cpu", engine="server"), echo=lambda *a, **k: None)
    ckpt = tmp_path / "killed" / "checkpoint-1"
    assert ckpt.is_dir()
    monkeypatch.setattr(ServerRollout, "generate", real)
    # The state saved is that of one whole step, as a run of one step in one process leaves it.
    grpo.run(_cfg(tmp_path / "one", "cpu", steps=1), echo=lambda *a, **k: None)
    a = load_file(str(ckpt / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "checkpoint-1" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # ... and the run resumes from it (with a new server).
    grpo.run(_cfg(tmp_path / "killed", "cpu", engine="server", resume="auto"), echo=lambda *a, **k: None)
    assert (tmp_path / "killed" / "checkpoint-3").is_dir()


def test_engine_url_trains_through_a_running_server(tmp_path):
    broker = Broker(tmp_path / "b" / "broker.sock").start()
    sock = tmp_path / "s" / "serve.sock"
    argv = shared_server_argv(tmp_path, broker, sock)
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        url = f"unix://{sock}"
        grpo.run(_cfg(tmp_path / "url", "cpu", engine="server", engine_url=url), echo=lambda *a, **k: None)
        grpo.run(_cfg(tmp_path / "local", "cpu"), echo=lambda *a, **k: None)
        _same(_rows(tmp_path / "url"), _rows(tmp_path / "local"))
        assert server.poll() is None  # a server this run did not start is left running
    finally:
        server.kill()
        server.wait(10)
        broker.close()


def test_ctrl_c_saves_and_stops_the_server(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "rlmem", "train", "engine=server", "device=cpu", "steps=200"]
    argv += ["prompts_per_step=4", "group_size=4", "offload=true", f"out_dir={out}", "progress=false"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        for line in p.stdout:
            if line.startswith("step "):
                break
            assert time.monotonic() < deadline
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, rest
    assert "checkpoint:" in rest and list(out.glob("checkpoint-*"))
    # The server it started is gone (its log says it stopped), none left behind.
    assert "rlmem serve: stopped" in (out / "server.log").read_text()
