"""Weights shared, not copied: a rollout process runs its model on the trainer's rollout copy, mapped from
a shareable Region; a sync is the trainer's in-place cast-copy, and the rollout process (a CUDA graph
captured over the views included) sees the new weights at the same addresses, through a pause and reattach
of the memory too."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from rlmem.colocate import SharedWeights, attach_weights

ROLLOUT = textwrap.dedent(
    """
    import json, os, socket, sys
    import torch
    from torch import nn
    from rlmem.colocate import attach_weights

    device = sys.argv[2]
    torch.manual_seed(123)  # its own weights differ: only the shared ones may be used
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    x = torch.linspace(-1, 1, 4 * 16, device=device).view(4, 16).to(torch.bfloat16)
    sock = socket.socket(fileno=int(sys.argv[1]))
    weights = graph = None

    def forward():
        return torch.func.functional_call(model, weights.tensors, (x,))

    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 64)
        if not msg:
            break
        cmd = json.loads(msg)
        if cmd["op"] == "attach":
            weights = attach_weights(cmd["spec"], fds)
            if device == "cuda":  # captured once over the shared views; replayed after every sync
                forward()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = forward()
        elif cmd["op"] == "pause":
            weights.pause()
        elif cmd["op"] == "reattach":
            weights.reattach(cmd["spec"], fds)
        for fd in fds:
            os.close(fd)
        reply = {}
        if cmd["op"] != "pause":
            with torch.no_grad():
                if graph is not None:
                    graph.replay()
                    torch.cuda.synchronize()
                else:
                    out = forward()
            ptrs = [t.data_ptr() for t in weights.tensors.values()]
            reply = {"out": out.float().cpu().tolist(), "ptrs": ptrs}
        sock.send(json.dumps(reply).encode())
    """
)


def test_the_rollout_process_runs_on_the_trainers_weights(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    x = torch.linspace(-1, 1, 4 * 16, device=device).view(4, 16).to(torch.bfloat16)
    shared = SharedWeights(model, torch.bfloat16)
    assert {t.dtype for t in shared.tensors.values()} == {torch.bfloat16}

    def here() -> list:
        with torch.no_grad():
            return torch.func.functional_call(model, shared.tensors, (x,)).float().cpu().tolist()

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.settimeout(120)
    proc = subprocess.Popen(
        [sys.executable, "-c", ROLLOUT, str(theirs.fileno()), device], pass_fds=[theirs.fileno()]
    )
    theirs.close()

    def ask(op: str, fds: list[int] | None = None, **kw) -> dict:
        socket.send_fds(mine, [json.dumps({"op": op, **kw}).encode()], fds or [])
        for fd in fds or []:
            os.close(fd)
        reply = mine.recv(1 << 20)
        assert reply, f"the rollout process died (exit {proc.poll()})"
        return json.loads(reply)

    try:
        spec, fds = shared.export()
        got = ask("attach", fds, spec=json.loads(json.dumps(spec)))
        assert got["out"] == here()
        with torch.no_grad():  # a training step: the trainer's weights move, the copy follows at the sync
            for p in model.parameters():
                p.mul_(-0.5)
        shared.sync()
        again = ask("read")
        assert again["out"] == here() and again["out"] != got["out"] and again["ptrs"] == got["ptrs"]
        # The memory goes and comes back: the rollout process lets go first, then the trainer.
        ask("pause")
        shared.region.pause(keep=False)
        shared.region.resume()
        shared.sync()
        spec, fds = shared.export()
        back = ask("reattach", fds, spec=spec)
        assert back["ptrs"] == got["ptrs"] and back["out"] == here()
    finally:
        mine.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    shared.close()


def test_shared_weights_refuse_bad_input():
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        SharedWeights("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype must be a floating torch\.dtype"):
        SharedWeights(nn.Linear(2, 2), torch.int8)
    with pytest.raises(ValueError, match="has no parameters"):
        SharedWeights(nn.ReLU())
    with pytest.raises(ValueError, match="not a SharedWeights spec"):
        attach_weights({"tensors": []}, [])
    w = SharedWeights(nn.Linear(2, 2))
    w.region.pause()
    with pytest.raises(RuntimeError, match="is paused: resume it before sync"):
        w.sync()
    w.close()
