"""rlmem as a vLLM weight-transfer backend (``"rlmem"``): vLLM's workers map the trainer's
:class:`~rlmem.colocate.SharedWeights` and load their weights from it, with no copy of handles per tensor.

Loaded inside vLLM's processes through its plugin entry point (``vllm.general_plugins``, installed with
rlmem): :func:`register` adds the backend to vLLM's ``WeightTransferEngineFactory``. A server started with
``--weight-transfer-config '{"backend": "rlmem"}'`` (and ``VLLM_SERVER_DEV_MODE=1``) then takes:

- ``POST /init_weight_transfer_engine {"init_info": {"socket": PATH}}``: each worker connects to the Unix
  socket the trainer serves (:class:`~rlmem.rollout.RemoteEngine` makes it, private to the user) and
  receives the shared weights' layout and the descriptors of their memory (file descriptors passed over the
  socket: no pickle), which it maps once;
- ``/start_weight_update``, ``/update_weights {"update_info": {"names": [...] | null}}``,
  ``/finish_weight_update``: vLLM's layerwise reload around ``model.load_weights`` over the mapped views (all
  names, or those given), as its own IPC backend loads; a sync is one pass over memory the two processes
  share, on the device on a GPU.

``RemoteEngine(flavor="vllm").update_weights(weights)`` drives these calls. Where rlmem cannot be installed in
the server's environment, ``update_weights(weights, backend="ipc")`` speaks vLLM's own ``ipc`` backend instead
(``rlmem/rollout/_vllm_ipc.py``: a staging buffer exported by CUDA IPC, a copy per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..colocate import wire
from ..colocate.weights import AttachedWeights, attach_weights

NAME = "rlmem"


@dataclass
class RLMemInitInfo(WeightTransferInitInfo):
    """Where the trainer hands out its shared weights: a Unix socket, and how long to wait for it."""

    socket: str
    timeout: float = 60.0


@dataclass
class RLMemUpdateInfo(WeightTransferUpdateInfo):
    """The names to load (None: every shared weight)."""

    names: list[str] | None = None


class RLMemWeightTransferEngine(WeightTransferEngine[RLMemInitInfo, RLMemUpdateInfo]):
    """A vLLM worker's side of the ``"rlmem"`` backend (see the module docstring)."""

    init_info_cls = RLMemInitInfo
    update_info_cls = RLMemUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attached: AttachedWeights | None = None

    def init_transfer_engine(self, init_info: RLMemInitInfo) -> None:
        sock = wire.connect(init_info.socket, timeout=init_info.timeout)
        try:
            wire.check_peer(sock)  # the trainer's process, of this user
            msg, fds = wire.recv(sock, timeout=init_info.timeout)
        finally:
            sock.close()
        if self.attached is not None:
            self.attached.close()
        self.attached = attach_weights(msg["spec"], fds)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: RLMemUpdateInfo) -> None:
        if self.attached is None:
            raise RuntimeError("rlmem weight transfer: init_weight_transfer_engine was not called")
        views = self.attached.tensors
        names = list(views) if update_info.names is None else update_info.names
        unknown = [n for n in names if n not in views]
        if unknown:
            raise ValueError(f"rlmem weight transfer: no shared weight named {unknown[0]!r}")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check(), torch.no_grad():
            self.model.load_weights((n, views[n]) for n in names)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.attached is not None:
            self.attached.close()
            self.attached = None


def register() -> None:
    """vLLM's plugin hook: the ``"rlmem"`` backend in its factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(NAME, __name__, "RLMemWeightTransferEngine")
    except ValueError:  # registered already (the plugins of a process loaded twice)
        pass
