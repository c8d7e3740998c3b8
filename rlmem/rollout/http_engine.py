"""A rollout engine in a server process, as an engine of this one: :class:`RemoteEngine`.

``sleep(level)`` / ``wake(tags)`` / ``generate`` over HTTP, mapped onto the endpoints of each server:

- ``rlmem``: ``POST /sleep {"level": L}``, ``POST /wake {"tags": [...] | null}``, ``POST /generate``
  ``{"prompts", "max_new_tokens", ...}``, ``GET /health``;
- ``vllm`` (its dev endpoints): ``POST /sleep?level=L``, ``POST /wake_up?tags=weights&tags=kv_cache``,
  ``GET /is_sleeping``, ``POST /v1/completions``, ``POST /reset_prefix_cache``;
- ``sglang``: ``POST /release_memory_occupation {"tags": [...]}``, ``POST /resume_memory_occupation
  {"tags": [...]}``, ``POST /generate {"text" | "input_ids", "sampling_params"}``, ``POST /flush_cache``,
  ``GET /server_info``, ``POST /update_weights_from_tensor`` (its ``flattened_bucket`` format). SGLang's
  scheduler dies on a resume of a tag not released or a release while requests run (see
  :mod:`rlmem.rollout._sglang`): this engine keeps what it released, resumes only that, and releases only
  once its own generations have ended and the server is idle.

With ``member=`` (the rlmem flavor; ``rlmem serve --broker``), the memory handoff goes through the device's
broker instead: ``sleep`` / ``wake`` are :class:`~rlmem.colocate.PeerEngine`'s (the server's fenced release
checked through the ledger, this process's admitted acquire; the trainer's :class:`SharedWeights` mapped by
the server by descriptor), and generation stays on HTTP.

A release counts when the memory is back, not when the HTTP call returns (a server may answer before its
memory is free): with ``device=`` on this machine, ``sleep`` then waits until the device's free memory has
risen by what the last ``wake`` took (less 1/64 and 4 MiB), or, before any wake, until it stops rising;
bounded, with :class:`~rlmem.colocate.FenceError`. Every request has a time-out; an error answer is raised
as :class:`RemoteError` with the server's message (rlmem's ``OutOfMemoryError`` where rlmem's server ran out
of device memory).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._checks import check_choice, check_tags
from ..colocate.device import mem_info
from ..colocate.member import FenceError, Member, RemoteError, fence_bytes
from ..colocate.weights import SharedWeights
from ..errors import OutOfMemoryError
from . import _sglang
from .process_engine import PeerEngine

__all__ = ["FLAVORS", "RemoteEngine"]

FLAVORS = ("rlmem", "vllm", "sglang")
_SETTLE_S = 0.05  # free memory unchanged this long: a release with nothing to compare to has ended
_POLL = 0.002


class RemoteEngine:
    """An inference server (rlmem's, vLLM's or SGLang's) driven by the engine protocol.

    Args:
        url: the server, ``http://HOST:PORT``, or ``unix:///PATH`` for one on a Unix socket.
        flavor: ``"rlmem"``, ``"vllm"`` or ``"sglang"``: whose endpoints it speaks.
        token: sent as ``Authorization: Bearer TOKEN`` (vLLM's ``--api-key``, rlmem's ``--token``).
        model: the model name vLLM's completions endpoint wants (default: the server's first).
        device: the GPU the server shares with this process: ``sleep`` is fenced on its free memory.
        timeout: seconds for each request, and for each fence.
        member: this process's seat at the broker the server joined (``rlmem serve --broker``): sleep and
            wake go through it (see the module docstring). The rlmem flavor only.
        weights: with ``member``, the rollout copy the server samples from (mapped there, not copied).

    Raises:
        ValueError: a bad argument (the message names it).

    Example:
        >>> engine = RemoteEngine("http://127.0.0.1:30000", flavor="sglang", device="cuda:0")
        >>> pm.add_engine(engine)   # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        flavor: str = "rlmem",
        *,
        token: str | None = None,
        model: str | None = None,
        device: str | torch.device | None = None,
        timeout: float = 120.0,
        member: Member | None = None,
        weights: SharedWeights | None = None,
    ) -> None:
        import httpx  # only where a server is talked to

        if not isinstance(url, str) or not url.startswith(("http://", "https://", "unix:///")):
            raise ValueError(f"url must be http://HOST:PORT, https://... or unix:///PATH, got {url!r}")
        if flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if member is not None and flavor != "rlmem":
            raise ValueError(f"member: only rlmem's server joins a broker, not flavor {flavor!r}")
        if weights is not None and member is None:
            raise ValueError("weights are shared through the broker: give member= too")
        self.url, self.flavor, self.model, self.timeout = url.rstrip("/"), flavor, model, float(timeout)
        self.device = None if device is None else torch.device(device)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url.startswith("unix://"):
            transport = httpx.HTTPTransport(uds=url.removeprefix("unix://"))
            self._http = httpx.Client(
                base_url="http://rlmem", headers=headers, timeout=self.timeout, transport=transport
            )
        else:
            self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout)
        self._took: int | None = None  # device bytes the last wake took
        self._released: set[str] = set()  # SGLang: the tags this engine released (it has no such endpoint)
        self._info: dict[str, Any] | None = None  # SGLang's /server_info, read once
        self._running = 0  # this engine's generate calls in flight: no sleep meanwhile
        self._idle = threading.Condition()
        # vLLM: (backend, sender, weights) of update_weights: the descriptors handed to its workers
        # (rlmem's backend) or the exported staging buffer (its ipc backend)
        self._transfer: tuple[Any, Any, SharedWeights] | None = None
        self.last_fence: dict[str, Any] | None = None
        self.peer: PeerEngine | None = None
        if member is not None:
            self.peer = PeerEngine(member, weights=weights, timeout=self.timeout)

    # -- the engine protocol ----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Give the server's device memory back (level 1: weights to host memory, KV cache discarded; 2:
        both discarded), and with ``device`` wait until it is back.

        Raises:
            RemoteError: the server refused. FenceError: the memory did not come back in time.
        """
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._wait_own_generations()
        if self.peer is not None:
            self.peer.sleep(level)
            self.last_fence = self.peer.last_peer_fence
            return
        free0 = self._free()
        if self.flavor == "vllm":
            # vLLM's /sleep aborts the requests in flight unless told otherwise (mode="abort" by default,
            # vllm/entrypoints/serve/dev/sleep/api_router.py, 0.32): they would come back cut short. "wait"
            # lets them finish first.
            self._call("POST", "/sleep", params={"level": level, "mode": "wait"})
        elif self.flavor == "sglang":
            tags = _sglang.release_tags(level, self._sglang_info(), self._released, self.url)
            if not tags:
                return
            # A release while anything runs kills SGLang's scheduler: a flush succeeds only once it is idle.
            self._call("POST", "/flush_cache", params={"timeout": self.timeout})
            self._call("POST", "/release_memory_occupation", json={"tags": tags})
            self._released.update(tags)
        else:
            self._call("POST", "/sleep", json={"level": level})
        if free0 is not None:
            self.last_fence = self._fence(free0)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory again, by tag (``"weights"``, ``"kv_cache"``, ``"cuda_graph"``; None: all). SGLang:
        only what this engine released (``cuda_graph`` with ``kv_cache`` unless named); nothing is sent for
        a tag not released.

        Raises:
            RemoteError: the server refused (e.g. out of memory: its message says).
        """
        tags = check_tags(tags)
        if self.peer is not None:
            self.peer.wake(tags)
            return
        free0 = self._free()
        if self.flavor == "vllm":
            self._call("POST", "/wake_up", params={"tags": tags} if tags else None)
        elif self.flavor == "sglang":
            todo = _sglang.resume_tags(tags, self._released)
            if not todo:
                return
            self._call("POST", "/resume_memory_occupation", json={"tags": todo})
            self._released.difference_update(todo)
        else:
            self._call("POST", "/wake", json={"tags": tags})
        if free0 is not None:
            free1 = self._free()
            assert free1 is not None
            took = max(0, free0 - free1)
            self._took = took if tags is None or self._took is None else self._took + took

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        **sampling: Any,
    ) -> list[str] | list[list[int]]:
        """Completions of ``prompts``, in order (greedy by default): text for text prompts; token ids for
        token-id prompts, as :meth:`HFSampler.generate` returns them. vLLM and SGLang: with ``n`` > 1 a list
        of ``n`` per prompt. ``sampling`` goes to the server as its keys (SGLang: checked against the keys
        its ``SamplingParams`` takes, ``seed`` sent as ``sampling_seed``).

        Raises:
            ValueError: prompts neither all text nor all token ids; a sampling key SGLang does not take.
            RemoteError: the server refused, is asleep (vLLM) or released by this engine (SGLang), or cut
            a completion short (``finish_reason`` abort).
        """
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of str, or of token-id lists")
        ids = bool(prompts) and all(isinstance(p, (list, tuple)) for p in prompts)
        if not ids and not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be a list of str, or of token-id lists")
        with self._idle:
            self._running += 1
        try:
            return self._generate(prompts, ids, max_new_tokens, temperature, sampling)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _generate(
        self, prompts: Sequence[Any], ids: bool, max_new_tokens: int, temperature: float, sampling: dict
    ) -> Any:
        if self.flavor == "vllm":
            return self._vllm_generate(prompts, ids, max_new_tokens, temperature, sampling)
        if self.flavor == "sglang":
            params = _sglang.sampling_params(max_new_tokens, temperature, sampling)
            if self._released:  # its scheduler would run the batch over released memory
                raise RemoteError(
                    f"sglang server at {self.url} is released ({', '.join(sorted(self._released))}): wake it "
                    "before generating"
                )
            body: dict[str, Any] = {"sampling_params": params}
            if ids:
                body["input_ids"] = [[int(t) for t in p] for p in prompts]
            else:
                body["text"] = list(prompts)
            outs, cut = _sglang.completions(self._call("POST", "/generate", json=body), ids)
            return self._grouped(outs, cut, int(params.get("n", 1)), len(prompts))
        if ids:
            body = {"input_ids": [[int(t) for t in p] for p in prompts], "max_new_tokens": max_new_tokens}
            out = self._call("POST", "/generate", json={**body, "temperature": temperature, **sampling})
            return [list(o) for o in out["output_ids"]]
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, **sampling}
        out = self._call("POST", "/generate", json={"prompts": list(prompts), **params})
        return list(out["completions"])

    def _vllm_generate(
        self, prompts: Sequence[Any], ids: bool, max_new_tokens: int, temperature: float, sampling: dict
    ) -> Any:
        """``/v1/completions``: token-id prompts give token ids back; ``n`` samples grouped per prompt."""
        if self.is_sleeping():  # vLLM would queue the request until a wake, past any time-out of ours
            raise RemoteError(f"vllm server at {self.url} is asleep: wake it before generating")
        body = {"max_tokens": max_new_tokens, "temperature": temperature, **sampling}
        body["prompt"] = [[int(t) for t in p] for p in prompts] if ids else list(prompts)
        body.update(model=self.model or self._first_model(), **({"return_token_ids": True} if ids else {}))
        out = self._call("POST", "/v1/completions", json=body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        cut = sum(c.get("finish_reason") == "abort" for c in choices)
        outs = [list(c["token_ids"]) if ids else c["text"] for c in choices]
        return self._grouped(outs, cut, int(sampling.get("n", 1)), len(prompts))

    def _grouped(self, outs: list[Any], cut: int, n: int, prompts: int) -> list[Any]:
        """``outs`` (prompt-major) grouped ``n`` per prompt.

        Raises:
            RemoteError: ``cut`` of them came back aborted (a sleep or pause of the server cut them short):
                never returned as completions.
        """
        if cut:
            raise RemoteError(
                f"{self.flavor} server at {self.url}: {cut} of {len(outs)} completions came back aborted "
                "(finish_reason 'abort'); the server cut them short"
            )
        return outs if n == 1 else [outs[i * n : (i + 1) * n] for i in range(prompts)]

    def update_weights_from_tensor(self, named: Any) -> dict[str, Any]:
        """Send ``named`` tensors (a mapping or ``(name, tensor)`` pairs) by handle (CUDA IPC, or shared
        memory on the host): the server copies them into its weights by name before answering, so they
        may change once this returns. rlmem's server: rlmem's handles; SGLang's: its ``flattened_bucket``
        format (one bucket, sent to every tensor-parallel rank). Not vLLM's.

        Raises:
            ValueError: the vLLM flavor; SGLang's weights released by this engine (wake them first).
            RemoteError: the server refused (an unknown name, another shape).
        """
        pairs = list(named.items()) if isinstance(named, dict) else list(named)
        if self.flavor == "sglang":
            if "weights" in self._released:  # a load into released memory would crash its scheduler
                raise ValueError("update_weights_from_tensor: the sglang server's weights are released")
            bucket = _sglang.bucket(pairs)
            # each tensor-parallel rank reads its own entry; a handle is opened once (a host tensor's
            # descriptor is handed out once), so a dump per rank
            ranks = int(self._sglang_info().get("tp_size") or 1)
            data = [_sglang.serialize(bucket) for _ in range(ranks)]
            body = {"serialized_named_tensors": data, "load_format": "flattened_bucket"}
            out = self._call("POST", "/update_weights_from_tensor", json={**body, "flush_cache": True})
            if isinstance(out, dict) and out.get("success") is False:
                raise RemoteError(f"sglang server at {self.url} did not update its weights: {out}")
            return out if isinstance(out, dict) else {}
        if self.flavor != "rlmem":
            raise ValueError(f"update_weights_from_tensor: flavor 'rlmem' or 'sglang', not {self.flavor!r}")
        from ..colocate.ipc import share_tensors

        return self._call("POST", "/update_weights_from_tensor", json={"tensors": share_tensors(pairs)})

    def update_weights(
        self,
        weights: SharedWeights,
        *,
        sync: bool = True,
        names: Sequence[str] | None = None,
        backend: str = "rlmem",
    ) -> None:
        """vLLM: load the server's weights from ``weights`` through its weight-transfer API: vLLM's
        ``/start_weight_update``, ``/update_weights`` (``names``: these only), ``/finish_weight_update``,
        after ``weights.sync()`` (with ``sync``).

        ``backend="rlmem"`` (the server started with ``--weight-transfer-config '{"backend": "rlmem"}'``,
        rlmem installed beside it): the first call hands the shared memory's descriptors to its workers over
        a private Unix socket (``/init_weight_transfer_engine``), and each update loads from that memory
        itself. ``backend="ipc"``, where rlmem cannot be installed beside the server: vLLM's own CUDA IPC
        backend (``'{"backend": "ipc"}'``, and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in its environment,
        as its HTTP client needs): the weights go through a staging buffer of 1 GiB exported once, a copy
        and a request per chunk.

        Raises:
            ValueError: another flavor, ``weights`` not a SharedWeights, an unknown ``backend``, or
                ``"ipc"`` with weights off a GPU. RemoteError: the server refused (an unknown backend: its
                message names the ones it has).
        """
        if self.flavor != "vllm":
            raise ValueError(f"update_weights: the vllm flavor (rlmem's backend), not {self.flavor!r}")
        if not isinstance(weights, SharedWeights):
            raise ValueError(f"weights must be a SharedWeights, got {type(weights).__name__}")
        check_choice("backend", backend, ("rlmem", "ipc"))
        if self._transfer is None or self._transfer[0] != backend or self._transfer[2] is not weights:
            self._close_transfer()
            if backend == "rlmem":
                from ..colocate.handout import Handout

                sender: Any = Handout(weights)
                info: dict[str, Any] = {"socket": sender.path, "timeout": self.timeout}
            else:
                from ._vllm_ipc import IpcStaging

                sender = IpcStaging(weights.tensors)
                info = {"packed": True}
            self._transfer = (backend, sender, weights)
            self._call("POST", "/init_weight_transfer_engine", json={"init_info": info})
        sender = self._transfer[1]
        if sync:
            weights.sync()
        self._call("POST", "/start_weight_update", json={})
        if backend == "rlmem":
            update = {"names": None if names is None else [str(n) for n in names]}
            self._call("POST", "/update_weights", json={"update_info": update})
        else:
            for update in sender.updates(None if names is None else [str(n) for n in names]):
                self._call("POST", "/update_weights", json={"update_info": update})
        self._call("POST", "/finish_weight_update", json={})

    def _close_transfer(self) -> None:
        if self._transfer is not None:
            self._transfer[1].close()
            self._transfer = None

    def stats(self) -> dict[str, Any]:
        """rlmem's server: the cache's shape and what the process holds (``GET /memory``)."""
        if self.flavor != "rlmem":
            raise ValueError(f"stats: the rlmem flavor only, not {self.flavor!r}")
        return self._call("GET", "/memory")

    def is_sleeping(self) -> bool:
        """Whether the server is asleep (SGLang, which has no endpoint saying so: whether this engine has
        released any of its memory)."""
        if self.flavor == "vllm":
            return bool(self._call("GET", "/is_sleeping")["is_sleeping"])
        if self.flavor == "sglang":
            return bool(self._released)
        return bool(self._call("GET", "/health")["sleeping"])

    def flush_cache(self) -> None:
        """Drop the server's prefix cache (SGLang ``/flush_cache``, vLLM ``/reset_prefix_cache``).

        Raises:
            RemoteError: the server said it did not flush, through the time-out (vLLM answers
                ``{"success": false}`` while blocks are held, and asks callers to retry).
        """
        path = {"sglang": "/flush_cache", "vllm": "/reset_prefix_cache", "rlmem": "/flush_cache"}
        # SGLang waits for its scheduler to be idle up to ?timeout= and answers 400 if it was not
        params = {"timeout": self.timeout} if self.flavor == "sglang" else None
        t0 = time.monotonic()
        while True:
            out = self._call("POST", path[self.flavor], params=params)
            if not (isinstance(out, dict) and out.get("success") is False):
                return
            if time.monotonic() - t0 > self.timeout:
                raise RemoteError(f"{self.flavor} server at {self.url} did not flush its cache: {out}")
            time.sleep(0.05)

    def health_info(self) -> dict[str, Any]:
        """The server's ``GET /health`` answer (rlmem's: ready, sleeping, pid, the broker it joined).

        Raises:
            ConnectionError: it does not answer. RemoteError: it answers with an error.
        """
        path = self._health_path()
        out = self._call("GET", path)
        if out is None or path != "/health":  # vLLM's and SGLang's: 200 and no body (or the server info)
            return {"status": "ok"}
        return out if isinstance(out, dict) else {"status": out}

    def health(self) -> bool:
        """Whether the server answers ``GET /health`` with 200."""
        try:
            return self._http.get(self._health_path()).status_code == 200
        except Exception:
            return False

    def close(self) -> None:
        self._close_transfer()
        self._http.close()

    # -- plumbing ---------------------------------------------------------------------------------------
    def _health_path(self) -> str:
        # SGLang's /health generates a token: not over a KV cache this engine released
        return "/server_info" if self.flavor == "sglang" and self._released else "/health"

    def _sglang_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(self._call("GET", "/server_info") or {})
        return self._info

    def _wait_own_generations(self) -> None:
        """Wait (bounded) until this engine's generate calls have returned: a sleep never cuts them."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._running == 0, timeout=self.timeout):
                raise RemoteError(
                    f"{self.flavor} server at {self.url}: {self._running} generate call(s) of this engine "
                    f"still running after {self.timeout:g} s; not put to sleep"
                )

    def _first_model(self) -> str:
        models = self._call("GET", "/v1/models")["data"]
        if not models:
            raise RemoteError(f"{self.url} serves no model")
        self.model = str(models[0]["id"])
        return self.model

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ConnectionError(f"{method} {self.url}{path}: {e}") from e
        if r.status_code >= 400:
            try:
                detail = r.json()
            except ValueError:
                detail = r.text[:500]
            msg = f"{method} {self.url}{path} answered {r.status_code}: {detail}"
            said = str(detail.get("detail", "") if isinstance(detail, dict) else detail)
            if r.status_code == 503 and said.startswith("out of memory"):
                raise OutOfMemoryError(msg, device=str(self.device or ""))
            raise RemoteError(msg)
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text

    def _free(self) -> int | None:
        return None if self.device is None else mem_info(self.device)[0]

    def _fence(self, free0: int) -> dict[str, Any]:
        """Wait until the free memory has risen by what the last wake took, or, not knowing it, until it
        has stopped rising."""
        assert self.device is not None
        t0 = time.monotonic()
        want = fence_bytes(self._took) if self._took else None
        last, since = mem_info(self.device)[0], time.monotonic()
        while True:
            free = mem_info(self.device)[0]
            rise = free - free0
            now = time.monotonic()
            if want is not None and rise >= want:
                break
            if free != last:
                last, since = free, now
            elif want is None and now - since >= _SETTLE_S:
                break
            if now - t0 > self.timeout:
                raise FenceError(
                    f"{self.flavor} server at {self.url}: after sleep the device's free memory rose "
                    f"{max(0, rise) / 2**30:.2f} GiB of the {(want or 0) / 2**30:.2f} GiB its last wake "
                    f"took, within {self.timeout:g} s"
                )
            time.sleep(_POLL)
        self._took = None
        return {"free_rise_bytes": max(0, rise), "expected_bytes": want, "seconds": time.monotonic() - t0}
