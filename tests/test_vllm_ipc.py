"""vLLM's own ``ipc`` weight-transfer backend, where rlmem's cannot be installed beside the server: the
shared weights reach a process that decodes ``/update_weights`` exactly as vLLM 0.32's worker does in packed
mode (``tests/_vllm_ipc_standin.py``), bit for bit, over several chunks and twice (the exported buffer
reused), and a server without ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` refuses as vLLM does. CUDA only: CUDA
IPC is what it tests (the refusals off a GPU are in ``test_remote_engine.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _helpers import free_port
from _vllm_ipc_standin import digest
from torch import nn

from rlmem.colocate import RemoteError, SharedWeights
from rlmem.rollout.remote import RemoteEngine
from rlmem.rollout.remote import vllm as _vllm_ipc

pytestmark = pytest.mark.cuda


@pytest.fixture
def standin():
    procs = []

    def start(insecure: bool = True) -> str:
        port = free_port()
        env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1" if insecure else "0"}
        script = Path(__file__).with_name("_vllm_ipc_standin.py")
        procs.append(subprocess.Popen([sys.executable, str(script), str(port)], env=env))
        url = f"http://127.0.0.1:{port}"
        import httpx

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert procs[-1].poll() is None, "the stand-in exited"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError("the stand-in did not answer in 60 s")

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def _digests(shared: SharedWeights) -> dict[str, list]:
    return {n: [str(t.dtype), list(t.shape), digest(t)] for n, t in shared.tensors.items()}


def test_ipc_backend_loads_the_shared_weights_bit_for_bit(standin, monkeypatch):
    import httpx

    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    shared = SharedWeights(model, torch.bfloat16)
    # a chunk smaller than the weights: several /update_weights over one exported buffer
    monkeypatch.setattr(_vllm_ipc, "DEFAULT_BUFFER_BYTES", 40_000)
    url = standin()
    eng = RemoteEngine(url, "vllm", timeout=30)
    eng.update_weights(shared, backend="ipc")
    assert httpx.get(url + "/loaded").json() == _digests(shared)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)
    eng.update_weights(shared, backend="ipc")  # synced, then sent through the same buffer
    assert httpx.get(url + "/loaded").json() == _digests(shared)
    eng.update_weights(shared, backend="ipc", names=["0.bias"], sync=False)
    eng.close()
    shared.close()


def test_a_server_without_insecure_serialization_refuses_as_vllm_does(standin):
    model = nn.Linear(8, 8).cuda()
    shared = SharedWeights(model, torch.bfloat16)
    eng = RemoteEngine(standin(insecure=False), "vllm", timeout=30)
    with pytest.raises(RemoteError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        eng.update_weights(shared, backend="ipc")
    eng.close()
    shared.close()
