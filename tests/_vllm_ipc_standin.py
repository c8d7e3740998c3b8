"""A stand-in for a vLLM 0.32 server started with ``--weight-transfer-config '{"backend": "ipc"}'``: its
weight-transfer routes, decoding ``/update_weights`` as vLLM's worker does in packed mode
(``vllm/distributed/weight_transfer/ipc_engine.py`` and ``packed_tensor.py``: the pickled handles refused
without ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, the entry of this GPU's UUID, its device index put in
``args[6]``, ``rebuild_cuda_tensor`` once per exported buffer, the buffer split by ``tensor_sizes``, each
piece viewed as its dtype and shape and cloned). CUDA IPC needs another process: run as
``python _vllm_ipc_standin.py PORT``; ``GET /loaded`` answers each loaded tensor's dtype, shape and sha256."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import sys
from http.server import ThreadingHTTPServer

import torch
from _helpers import JSONHandler
from torch.multiprocessing.reductions import rebuild_cuda_tensor

loaded: dict[str, torch.Tensor] = {}
state: dict[str, object] = {"packed": None, "entry": None, "updating": False}


def update(info: dict) -> None:
    if not state["updating"]:
        raise ValueError("update_weights outside start_weight_update / finish_weight_update")
    if not state["packed"]:
        raise ValueError("this stand-in decodes vLLM's packed mode only")
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        raise ValueError(
            "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
        )
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    n = len(info["names"])
    if not (len(info["dtype_names"]) == len(info["shapes"]) == len(info["tensor_sizes"]) == n):
        raise ValueError("names, dtype_names, shapes and tensor_sizes differ in length")
    dev = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    if uuid not in handles:
        raise ValueError(f"IPC handle not found for GPU UUID {uuid}. Available UUIDs: {list(handles)}")
    args = list(handles[uuid])
    args[6] = dev
    key = tuple(args)
    if state["entry"] is None or state["entry"][0] != key:  # PackedBufferImporter: one rebuild per export
        state["entry"] = (key, rebuild_cuda_tensor(*args))
    packed = state["entry"][1][: sum(info["tensor_sizes"])]
    for name, shape, dn, piece in zip(
        info["names"], info["shapes"], info["dtype_names"], packed.split(info["tensor_sizes"]), strict=True
    ):
        loaded[name] = piece.contiguous().view(getattr(torch, dn)).view(shape).clone()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


class Handler(JSONHandler):
    def do_GET(self):
        if self.path == "/health":
            return self._answer(200, {})
        if self.path == "/loaded":
            out = {
                n: [
                    str(t.dtype),
                    list(t.shape),
                    hashlib.sha256(t.cpu().view(torch.uint8).numpy()).hexdigest(),
                ]
                for n, t in loaded.items()
            }
            return self._answer(200, out)
        return self._answer(404, {"error": self.path})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        try:
            if self.path.split("?")[0] in (
                "/pause",
                "/resume",
            ):  # vLLM 0.32's scheduling pause, around updates
                state["paused"] = self.path.startswith("/pause")
            elif self.path == "/init_weight_transfer_engine":
                state["packed"] = bool(body["init_info"].get("packed", False))
            elif self.path == "/start_weight_update":
                state["updating"] = True
            elif self.path == "/update_weights":
                update(body["update_info"])
            elif self.path == "/finish_weight_update":
                state["updating"] = False
                state["entry"] = None  # the importer's close(): the mapping released once per update
            else:
                return self._answer(404, {"error": self.path})
        except (ValueError, KeyError) as e:
            return self._answer(400, {"error": str(e)})
        return self._answer(200, {})


if __name__ == "__main__":
    torch.cuda.init()
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
