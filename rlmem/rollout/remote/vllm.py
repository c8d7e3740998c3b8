"""vLLM's server as an engine of this process: :class:`VLLMRemote`.

Its endpoints (the dev ones, ``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=L&mode=wait``,
``POST /wake_up?tags=weights&tags=kv_cache``, ``GET /is_sleeping``, ``POST /v1/completions``,
``POST /reset_prefix_cache``, ``POST /pause`` / ``/resume``, and its weight-transfer API
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``),
through rlmem's backend (:mod:`rlmem.integrations.vllm_transfer`) or vLLM's own ``ipc`` one.

:class:`IpcStaging` is the trainer's side of that ``ipc`` backend, for a vLLM server where rlmem's backend
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
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch

from ..._checks import check_choice
from ...colocate.member import RemoteError
from ...colocate.weights import SharedWeights
from ..engine import generation_length
from .base import RemoteEngine

__all__ = ["DEFAULT_BUFFER_BYTES", "PAUSE_MODES", "IpcStaging", "VLLMRemote"]

DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM's producer's default
PAUSE_MODES = ("wait", "keep")  # vLLM's /pause modes an update may use ("abort" would cut others short)


class VLLMRemote(RemoteEngine):
    """vLLM's OpenAI-compatible server driven by the engine protocol (``RemoteEngine(url, "vllm")``).

    Example:
        >>> engine = RemoteEngine("http://127.0.0.1:8000", flavor="vllm", device="cuda:0")
        >>> pm.add_engine(engine)   # doctest: +SKIP
    """

    flavor: ClassVar[str] = "vllm"
    flush_path: ClassVar[str] = "/reset_prefix_cache"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        # (backend, sender, weights) of update_weights: the descriptors handed to its workers (rlmem's
        # backend) or the exported staging buffer (its ipc backend)
        self._transfer: tuple[Any, Any, SharedWeights] | None = None

    def _release(self, level: int) -> bool:
        # vLLM's /sleep aborts the requests in flight unless told otherwise (mode="abort" by default,
        # vllm/entrypoints/serve/dev/sleep/api_router.py, 0.32): they would come back cut short. "wait"
        # lets them finish first.
        self._call("POST", "/sleep", params={"level": level, "mode": "wait"}, wait=self.timeout)
        return True

    def _resume(self, tags: list[str] | None) -> bool:
        self._call("POST", "/wake_up", params={"tags": tags} if tags else None)
        return True

    def _generate(
        self,
        prompts: Sequence[Any],
        ids: bool,
        max_new_tokens: int | None,
        temperature: float,
        sampling: dict,
    ) -> Any:
        """``/v1/completions``: token-id prompts give token ids back; ``n`` samples grouped per prompt."""
        if self.is_sleeping():  # vLLM would queue the request until a wake, past any time-out of ours
            raise RemoteError(f"vllm server at {self.url} is asleep: wake it before generating")
        body = {"max_tokens": generation_length(max_new_tokens), "temperature": temperature, **sampling}
        body["prompt"] = [[int(t) for t in p] for p in prompts] if ids else list(prompts)
        body.update(model=self.model or self._first_model(), **({"return_token_ids": True} if ids else {}))
        out = self._call("POST", "/v1/completions", json=body, timeout=self.timeout)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        cut = sum(c.get("finish_reason") == "abort" for c in choices)
        outs = [list(c["token_ids"]) if ids else c["text"] for c in choices]
        return self._grouped(outs, cut, int(sampling.get("n", 1)), len(prompts))

    def update_weights(
        self,
        weights: SharedWeights,
        *,
        partial: bool = False,
        sync: bool = True,
        names: Sequence[str] | None = None,
        backend: str = "rlmem",
        verify: bool = False,
        pause: str | None = "wait",
    ) -> None:
        """Load the server's weights from ``weights`` through its weight-transfer API: vLLM's
        ``/start_weight_update``, ``/update_weights`` (``names``: these only), ``/finish_weight_update``,
        after ``weights.sync()`` (with ``sync``), with the server's scheduling paused around them.

        ``backend="rlmem"`` (the server started with ``--weight-transfer-config '{"backend": "rlmem"}'``,
        rlmem installed beside it): the first call hands the shared memory's descriptors to its workers over
        a private Unix socket (``/init_weight_transfer_engine``), and each update loads from that memory
        itself. The server checks the whole update against the checkpoint it loaded before loading a byte
        (every name known, every shape its model's, the set complete unless ``partial``, a tied pair
        consistent): a refused update leaves it serving its old weights, and the next good one loads.
        ``backend="ipc"``, where rlmem cannot be installed beside the server: vLLM's own CUDA IPC backend
        (``'{"backend": "ipc"}'``, and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in its environment, as its
        HTTP client needs): the weights go through a staging buffer of 1 GiB exported once, a copy and a
        request per chunk; nothing is checked before loading.

        Args:
            weights: the trainer's shared copy.
            partial: ``names`` (or the shared weights) are a subset of the model's weights, on purpose.
            sync: copy the trainer's parameters into ``weights`` first.
            names: load these only (default: every shared weight).
            backend: ``"rlmem"`` or ``"ipc"`` (see above).
            verify: after loading, compare what the server's model holds with the shared weights, bit for
                bit, on its device (rlmem's backend; a second pass over the weights: see
                ``rlmem bench verify`` for its cost).
            pause: how other clients' requests meet the update (vLLM's ``/pause``): ``"wait"`` lets those
                running finish first (bounded by ``timeout``) and holds new ones until the update is done;
                ``"keep"`` freezes those running where they are and resumes them on the new weights; None
                sends no pause (no other client, or a vLLM without ``/pause``).

        Raises:
            ValueError: ``weights`` not a SharedWeights, an unknown ``backend`` or
                ``pause``, ``verify``/``partial`` with ``"ipc"``, or ``"ipc"`` with weights off a GPU.
            RemoteError: the server refused (the update, naming the parameters at fault and what its model
                takes; an unknown backend: its message names the ones it has), or the verification found
                parameters that differ (named).
        """
        if not isinstance(weights, SharedWeights):
            raise ValueError(f"weights must be a SharedWeights, got {type(weights).__name__}")
        check_choice("backend", backend, ("rlmem", "ipc"))
        if pause is not None:
            check_choice("pause", pause, PAUSE_MODES)
        if backend == "ipc" and (verify or partial):
            raise ValueError("verify and partial: rlmem's backend only, not vLLM's 'ipc'")
        if names is not None:
            unknown = [str(n) for n in names if n not in weights.tensors]
            if unknown:
                raise ValueError(f"names: not in the shared weights: {', '.join(map(repr, unknown[:5]))}")
        if self._transfer is None or self._transfer[0] != backend or self._transfer[2] is not weights:
            self._close_transfer()
            if backend == "rlmem":
                from ...colocate.handout import Handout

                sender: Any = Handout(weights)
                info: dict[str, Any] = {"socket": sender.path, "timeout": self.control_timeout}
            else:
                sender = IpcStaging(weights.tensors)
                info = {"packed": True}
            self._transfer = (backend, sender, weights)
            self._call("POST", "/init_weight_transfer_engine", json={"init_info": info})
        sender = self._transfer[1]
        if sync:
            weights.sync()
        listed = None if names is None else [str(n) for n in names]
        t0 = time.perf_counter()
        timings: dict[str, float] = {}
        paused = False
        try:
            if pause is not None:
                # "wait": the server answers once the requests running have finished
                paused = True
                self._call(
                    "POST", "/pause", params={"mode": pause}, wait=self.timeout if pause == "wait" else 0.0
                )
                timings["pause_s"] = time.perf_counter() - t0
            if backend == "rlmem":
                self._session([{"names": listed, "partial": bool(partial)}])
                timings["load_s"] = time.perf_counter() - t0 - timings.get("pause_s", 0.0)
                if verify:
                    t1 = time.perf_counter()
                    self._session([{"names": listed, "action": "verify"}])
                    timings["verify_s"] = time.perf_counter() - t1
            else:
                self._session(sender.updates(listed))
                timings["load_s"] = time.perf_counter() - t0 - timings.get("pause_s", 0.0)
        finally:
            if paused:
                self._call("POST", "/resume")
        self.last_update = {**timings, "seconds": time.perf_counter() - t0}

    def _session(self, updates: Any) -> None:
        """One weight-update session: ``/start_weight_update``, an ``/update_weights`` per update,
        ``/finish_weight_update``. A failed ``/update_weights`` ends the session on vLLM's side (its worker
        resets it, ``v1/worker/gpu_worker.py``): no finish is sent after one."""
        handout = self._transfer[1] if self._transfer and self._transfer[0] == "rlmem" else None
        if handout is not None:
            handout.take_reports()  # none left from before
        self._call("POST", "/start_weight_update", json={})
        for update in updates:
            try:
                self._call("POST", "/update_weights", json={"update_info": update})
            except RemoteError as e:
                # vLLM's answer carries no reason; rlmem's backend told this process its own
                said = [r["error"] for r in (handout.take_reports(2.0) if handout else []) if r.get("error")]
                if said:
                    raise RemoteError(f"vllm server at {self.url}: {said[0]}") from e
                raise
        self._call("POST", "/finish_weight_update", json={})

    def _close_transfer(self) -> None:
        if self._transfer is not None:
            self._transfer[1].close()
            self._transfer = None

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/is_sleeping")["is_sleeping"])

    def close(self) -> None:
        self._close_transfer()
        super().close()

    def _first_model(self) -> str:
        models = self._call("GET", "/v1/models")["data"]
        if not models:
            raise RemoteError(f"{self.url} serves no model")
        self.model = str(models[0]["id"])
        return self.model


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
