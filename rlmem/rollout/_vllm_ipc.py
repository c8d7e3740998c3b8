"""The trainer's side of vLLM's own ``ipc`` weight-transfer backend, for a vLLM server where rlmem's backend
cannot be installed (``--weight-transfer-config '{"backend": "ipc"}'``): the format of vLLM 0.32's
``vllm/distributed/weight_transfer/ipc_engine.py`` in its packed mode, as its HTTP client sends it.

CUDA IPC exports memory that ``cudaMalloc`` made; a Region's memory is mapped through the driver's virtual
memory calls and cannot be exported that way. So the weights are copied, chunk by chunk, into one staging
buffer from PyTorch's allocator, exported once per update (``reduce_tensor``) and reused for every chunk,
as vLLM's own producer does: each ``/update_weights`` names the chunk's tensors, their dtypes, shapes and
byte sizes (the worker splits the buffer by them, clones each piece and loads it by name) and carries the
handle pickled and base64-encoded (the server must run with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["DEFAULT_BUFFER_BYTES", "IpcStaging"]

DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM's producer's default


class IpcStaging:
    """A staging buffer on the weights' GPU, exported by CUDA IPC, and the update payloads that fill it.

    Args:
        tensors: the shared weights by name (``SharedWeights.tensors``), on a CUDA device.
        buffer_bytes: the buffer's size (default :data:`DEFAULT_BUFFER_BYTES`); grown to the largest tensor
            if that is bigger.

    Raises:
        ValueError: weights off a GPU (CUDA IPC has nothing to export), or a bad ``buffer_bytes``.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], buffer_bytes: int | None = None) -> None:
        if buffer_bytes is None:
            buffer_bytes = DEFAULT_BUFFER_BYTES
        if not isinstance(buffer_bytes, int) or isinstance(buffer_bytes, bool) or buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be a positive int, got {buffer_bytes!r}")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            where = ", ".join(sorted(str(d) for d in devices)) or "none"
            raise ValueError(f"backend 'ipc': CUDA IPC needs the weights on one GPU, they are on {where}")
        self.device = next(iter(devices))
        self.tensors = tensors
        size = max(buffer_bytes, max(t.numel() * t.element_size() for t in tensors.values()))
        self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self._handle = ""

    def _export(self) -> None:
        # Once per update, as vLLM's producer does: torch pairs each export with one open and one release
        # on the other side (its worker releases the mapping at /finish_weight_update); an export reused
        # over updates would be released once per update and never be reclaimed here.
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.buffer)
        # vLLM's worker finds its own GPU's entry by UUID and puts its device index in args[6]
        self._handle = base64.b64encode(pickle.dumps({self._uuid: args})).decode("ascii")

    def updates(self, names: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
        """The ``update_info`` of each chunk, the buffer filled for it when it is yielded (send it before
        asking for the next: the next chunk overwrites the buffer).

        Raises:
            ValueError: a name the weights do not have.
        """
        if names is None:
            names = list(self.tensors)
        unknown = [n for n in names if n not in self.tensors]
        if unknown:
            raise ValueError(f"names: not in the shared weights: {', '.join(map(repr, unknown[:5]))}")
        self._export()
        chunk: dict[str, list[Any]] = {"names": [], "dtype_names": [], "shapes": [], "tensor_sizes": []}
        used = 0
        for n in names:
            t = self.tensors[n]
            flat = t.contiguous().view(-1).view(torch.uint8)
            if used and used + flat.numel() > self.buffer.numel():
                yield self._payload(chunk)
                chunk = {k: [] for k in chunk}
                used = 0
            self.buffer[used : used + flat.numel()].copy_(flat)
            chunk["names"].append(n)
            chunk["dtype_names"].append(str(t.dtype).removeprefix("torch."))
            chunk["shapes"].append(list(t.shape))
            chunk["tensor_sizes"].append(flat.numel())
            used += flat.numel()
        if chunk["names"]:
            yield self._payload(chunk)

    def _payload(self, chunk: dict[str, list[Any]]) -> dict[str, Any]:
        # the worker reads the buffer once the request arrives: every copy into it must have finished
        torch.cuda.current_stream(self.device).synchronize()
        return {**chunk, "ipc_handles_pickled": self._handle}

    def close(self) -> None:
        """Let the buffer go (vLLM's worker released its mapping at ``/finish_weight_update``)."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
