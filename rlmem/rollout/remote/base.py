"""A rollout engine in a server process, as an engine of this one: :class:`RemoteEngine`, the part every
server's client shares, and the registry of flavors; one module per server speaks its endpoints
(:mod:`~rlmem.rollout.remote.rlmem`, :mod:`~rlmem.rollout.remote.vllm`,
:mod:`~rlmem.rollout.remote.sglang`). ``RemoteEngine(url, flavor=...)`` gives the flavor's class, loaded
on first use.

Shared here: the engine protocol's outline (``sleep`` waits for this engine's own generations, releases,
then fences; ``wake`` takes by tag and notes what it took), ``generate``'s checks and its count of calls in
flight, requests with their time-outs and errors, health, the flush's retry.

With ``member=`` (the rlmem flavor; ``rlmem serve --broker``), the memory handoff goes through the device's
broker instead: ``sleep`` / ``wake`` are :class:`~rlmem.rollout.PeerEngine`'s (the server's fenced release
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

import importlib
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ..._checks import check_sampling, check_tags
from ...colocate.device import mem_info
from ...colocate.member import FenceError, Member, RemoteError, fence_bytes
from ...colocate.weights import SharedWeights
from ...errors import OutOfMemoryError
from .peer import PeerEngine

__all__ = ["FLAVORS", "RemoteEngine", "engine_class"]

# flavor -> (module, class): each server's client, imported when an engine of it is first made
_REGISTRY = {
    "rlmem": ("rlmem.rollout.remote.rlmem", "RlmemRemote"),
    "vllm": ("rlmem.rollout.remote.vllm", "VLLMRemote"),
    "sglang": ("rlmem.rollout.remote.sglang", "SGLangRemote"),
}
FLAVORS = tuple(_REGISTRY)
_SETTLE_S = 0.05  # free memory unchanged this long: a release with nothing to compare to has ended
_POLL = 0.002


def engine_class(flavor: str) -> type[RemoteEngine]:
    """The client class of ``flavor``'s server.

    Raises:
        ValueError: not one of :data:`FLAVORS`.
    """
    if flavor not in _REGISTRY:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
    module, name = _REGISTRY[flavor]
    return getattr(importlib.import_module(module), name)


class RemoteEngine:
    """An inference server (rlmem's, vLLM's or SGLang's) driven by the engine protocol.

    Args:
        url: the server, ``http://HOST:PORT``, or ``unix:///PATH`` for one on a Unix socket.
        flavor: ``"rlmem"``, ``"vllm"`` or ``"sglang"``: whose endpoints it speaks (default: the class's,
            ``"rlmem"`` for this one). ``RemoteEngine(...)`` is an instance of that flavor's class.
        token: sent as ``Authorization: Bearer TOKEN`` (vLLM's ``--api-key``, rlmem's ``--token``).
        model: the model name vLLM's completions endpoint wants (default: the server's first).
        device: the GPU the server shares with this process: ``sleep`` is fenced on its free memory.
        timeout: seconds for each generate request.
        control_timeout: seconds for each control call (sleep, wake, weight updates, flush, health,
            pause and resume) and for each fence; default ``min(30, timeout)``. A frozen server fails a
            control call this fast, whatever a generation may take; a call that asks the server to wait
            for the generations in flight (vLLM's sleep, an update's ``pause="wait"``) may take a
            generation's ``timeout`` more.
        member: this process's seat at the broker the server joined (``rlmem serve --broker``): sleep and
            wake go through it (see the module docstring). The rlmem flavor only.
        weights: with ``member``, the rollout copy the server samples from (mapped there, not copied).

    Raises:
        ValueError: a bad argument (the message names it).

    Example:
        >>> engine = RemoteEngine("http://127.0.0.1:30000", flavor="sglang", device="cuda:0")
        >>> pm.add_engine(engine)   # doctest: +SKIP
    """

    flavor: ClassVar[str] = "rlmem"
    joins_broker: ClassVar[bool] = False  # its server can join a broker (``member=``)
    flush_path: ClassVar[str] = "/flush_cache"

    def __new__(cls, url: str = "", flavor: str | None = None, **_: Any) -> RemoteEngine:
        if cls is RemoteEngine:
            cls = engine_class(cls.flavor if flavor is None else flavor)
        return super().__new__(cls)

    def __init__(
        self,
        url: str,
        flavor: str | None = None,
        *,
        token: str | None = None,
        model: str | None = None,
        device: str | torch.device | None = None,
        timeout: float = 120.0,
        control_timeout: float | None = None,
        member: Member | None = None,
        weights: SharedWeights | None = None,
    ) -> None:
        import httpx  # noqa: F401  (only where a server is talked to: missing, it fails here)

        if not isinstance(url, str) or not url.startswith(("http://", "https://", "unix:///")):
            raise ValueError(f"url must be http://HOST:PORT, https://... or unix:///PATH, got {url!r}")
        if flavor is not None and flavor != self.flavor:
            engine_class(flavor)  # an unknown one is named as such
            raise ValueError(f"flavor: {type(self).__name__} speaks {self.flavor!r}, not {flavor!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if control_timeout is None:
            control_timeout = min(30.0, float(timeout))
        if not (isinstance(control_timeout, (int, float)) and control_timeout > 0):
            raise ValueError(f"control_timeout must be a positive number of seconds, got {control_timeout!r}")
        if member is not None and not self.joins_broker:
            raise ValueError(f"member: only rlmem's server joins a broker, not flavor {self.flavor!r}")
        if weights is not None and member is None:
            raise ValueError("weights are shared through the broker: give member= too")
        self.url, self.model, self.timeout = url.rstrip("/"), model, float(timeout)
        self.control_timeout = float(control_timeout)
        self.device = None if device is None else torch.device(device)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = self._client()
        self._took: int | None = None  # device bytes the last wake took
        self._running = 0  # this engine's generate calls in flight: no sleep meanwhile
        self._idle = threading.Condition()
        self.last_fence: dict[str, Any] | None = None
        self.last_update: dict[str, float] | None = None  # update_weights' seconds, by part
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
        if not self._release(level):
            return
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
        if not self._resume(tags):
            return
        if free0 is not None:
            free1 = self._free()
            assert free1 is not None
            took = max(0, free0 - free1)
            self._took = took if tags is None or self._took is None else self._took + took

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        **sampling: Any,
    ) -> list[str] | list[list[int]]:
        """Completions of ``prompts``, in order (greedy by default): text for text prompts; token ids for
        token-id prompts, as :meth:`HFSampler.generate` returns them. With ``n`` > 1 a list of ``n`` per
        prompt. ``sampling`` goes to the server as its keys (SGLang: checked against the keys
        its ``SamplingParams`` takes, ``seed`` sent as ``sampling_seed``). ``max_new_tokens=None``: the one
        default (:func:`rlmem.rollout.engine.generation_length`), which rlmem's server bounds by the room
        its cache leaves. ``temperature`` and ``top_p`` follow the one rule
        (:func:`rlmem._checks.check_sampling`).

        Raises:
            ValueError: prompts neither all text nor all token ids; a sampling key SGLang does not take; a
                bad ``max_new_tokens``, ``temperature`` or ``top_p`` (nothing is sent).
            RemoteError: the server refused, is asleep (vLLM) or released by this engine (SGLang), or cut
            a completion short (``finish_reason`` abort).
        """
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of str, or of token-id lists")
        ids = bool(prompts) and all(isinstance(p, (list, tuple)) for p in prompts)
        if not ids and not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be a list of str, or of token-id lists")
        check_sampling(temperature, sampling.get("top_p", 1.0))
        with self._idle:
            # under the lock a sleep holds from its wait to its release (SGLang's): no batch of this engine
            # reaches a server releasing its memory
            self._check_generate()
            self._running += 1
        try:
            return self._generate(prompts, ids, max_new_tokens, temperature, sampling)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    # -- what each server's client says its own way -------------------------------------------------------
    def _release(self, level: int) -> bool:
        """Ask the server to release what ``level`` takes; False where nothing was to be released."""
        raise NotImplementedError

    def _resume(self, tags: list[str] | None) -> bool:
        """Ask the server to take ``tags`` again (None: all); False where nothing was sent."""
        raise NotImplementedError

    def _generate(
        self,
        prompts: Sequence[Any],
        ids: bool,
        max_new_tokens: int | None,
        temperature: float,
        sampling: dict,
    ) -> Any:
        """One generate request in the server's form, its length checked (or resolved) by
        :func:`~rlmem.rollout.engine.generation_length` before anything is sent."""
        raise NotImplementedError

    def _check_generate(self) -> None:
        """Raise where the server cannot take a generation now (called under this engine's lock)."""

    def is_sleeping(self) -> bool:
        """Whether the server is asleep (SGLang, which has no endpoint saying so: whether this engine has
        released any of its memory)."""
        raise NotImplementedError

    def update_weights_from_tensor(
        self, named: Any, *, partial: bool = False, check: bool = True
    ) -> dict[str, Any]:
        """Send ``named`` tensors by handle into the server's weights (rlmem's and SGLang's servers: see
        :meth:`RlmemRemote.update_weights_from_tensor <rlmem.rollout.remote.rlmem.RlmemRemote>` and
        :meth:`SGLangRemote.update_weights_from_tensor <rlmem.rollout.remote.sglang.SGLangRemote>`).

        Raises:
            ValueError: this server takes no tensors by handle (vLLM: use :meth:`update_weights`).
        """
        raise ValueError(f"update_weights_from_tensor: flavor 'rlmem' or 'sglang', not {self.flavor!r}")

    def update_weights(self, weights: SharedWeights, **kw: Any) -> None:
        """Load the server's weights from the trainer's shared copy (vLLM's and SGLang's servers).

        Raises:
            ValueError: this server has no such path (rlmem's maps the weights through the broker).
        """
        raise ValueError(f"update_weights: the vllm and sglang flavors, not {self.flavor!r}")

    def stats(self) -> dict[str, Any]:
        """rlmem's server: the cache's shape and what the process holds (``GET /memory``).

        Raises:
            ValueError: another server.
        """
        raise ValueError(f"stats: the rlmem flavor only, not {self.flavor!r}")

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

    def flush_cache(self) -> None:
        """Drop the server's prefix cache (SGLang ``/flush_cache``, vLLM ``/reset_prefix_cache``).

        Raises:
            RemoteError: the server said it did not flush, through the time-out (vLLM answers
                ``{"success": false}`` while blocks are held, and asks callers to retry).
        """
        params = self._flush_params()
        t0 = time.monotonic()
        while True:
            out = self._call("POST", self.flush_path, params=params, wait=self.control_timeout)
            if not (isinstance(out, dict) and out.get("success") is False):
                return
            if time.monotonic() - t0 > self.control_timeout:
                raise RemoteError(f"{self.flavor} server at {self.url} did not flush its cache: {out}")
            time.sleep(0.05)

    def _flush_params(self) -> dict[str, Any] | None:
        return None

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
            return self._http.get(self._health_path(), timeout=self.control_timeout).status_code == 200
        except Exception:
            return False

    def close(self) -> None:
        self._http.close()

    # -- plumbing ---------------------------------------------------------------------------------------
    def _client(self) -> Any:
        import httpx

        if self.url.startswith("unix://"):
            transport = httpx.HTTPTransport(uds=self.url.removeprefix("unix://"))
            return httpx.Client(
                base_url="http://rlmem", headers=self._headers, timeout=self.timeout, transport=transport
            )
        return httpx.Client(base_url=self.url, headers=self._headers, timeout=self.timeout)

    def _health_path(self) -> str:
        return "/health"

    def _wait_own_generations(self) -> None:
        """Wait (bounded) until this engine's generate calls have returned: a sleep never cuts them."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._running == 0, timeout=self.timeout):
                raise RemoteError(
                    f"{self.flavor} server at {self.url}: {self._running} generate call(s) of this engine "
                    f"still running after {self.timeout:g} s; not put to sleep"
                )

    def _call(
        self, method: str, path: str, *, timeout: float | None = None, wait: float = 0.0, **kw: Any
    ) -> Any:
        """One request, bounded by ``timeout`` (default: the control time-out), plus ``wait``: the seconds
        the server itself was asked to wait before it answers (SGLang's ``?timeout=``)."""
        import httpx

        limit = (self.control_timeout if timeout is None else timeout) + wait
        try:
            r = self._http.request(method, path, timeout=limit, **kw)
        except httpx.HTTPError as e:
            raise ConnectionError(f"{method} {self.url}{path}: {e}") from e
        if r.status_code >= 400:
            try:
                detail = r.json()
            except ValueError:
                detail = r.text[:500]
            if r.status_code >= 500:
                # a server whose handler raised (vLLM on a failed weight update) closes the connection
                # after its answer: the next call must not be sent on it
                self._http.close()
                self._http = self._client()
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
            if now - t0 > self.control_timeout:
                raise FenceError(
                    f"{self.flavor} server at {self.url}: after sleep the device's free memory rose "
                    f"{max(0, rise) / 2**30:.2f} GiB of the {(want or 0) / 2**30:.2f} GiB its last wake "
                    f"took, within {self.control_timeout:g} s"
                )
            time.sleep(_POLL)
        self._took = None
        return {"free_rise_bytes": max(0, rise), "expected_bytes": want, "seconds": time.monotonic() - t0}
