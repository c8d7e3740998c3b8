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

from .._checks import check_choice, check_flag, check_tags
from ..colocate.device import mem_info
from ..colocate.member import FenceError, Member, RemoteError, fence_bytes
from ..colocate.weight_check import check_update
from ..colocate.weights import SharedWeights
from ..errors import OutOfMemoryError
from . import _sglang
from .process_engine import PeerEngine

__all__ = ["FLAVORS", "RemoteEngine"]

FLAVORS = ("rlmem", "vllm", "sglang")
PAUSE_MODES = ("wait", "keep")  # vLLM's /pause modes an update may use ("abort" would cut others short)
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

    def __init__(
        self,
        url: str,
        flavor: str = "rlmem",
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
        if flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {flavor!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if control_timeout is None:
            control_timeout = min(30.0, float(timeout))
        if not (isinstance(control_timeout, (int, float)) and control_timeout > 0):
            raise ValueError(f"control_timeout must be a positive number of seconds, got {control_timeout!r}")
        if member is not None and flavor != "rlmem":
            raise ValueError(f"member: only rlmem's server joins a broker, not flavor {flavor!r}")
        if weights is not None and member is None:
            raise ValueError("weights are shared through the broker: give member= too")
        self.url, self.flavor, self.model, self.timeout = url.rstrip("/"), flavor, model, float(timeout)
        self.control_timeout = float(control_timeout)
        self.device = None if device is None else torch.device(device)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = self._client()
        self._took: int | None = None  # device bytes the last wake took
        self._released: set[str] = set()  # SGLang: the tags this engine released (it has no such endpoint)
        self._info: dict[str, Any] | None = None  # SGLang's /server_info, read once
        self._running = 0  # this engine's generate calls in flight: no sleep meanwhile
        self._idle = threading.Condition()
        # vLLM: (backend, sender, weights) of update_weights: the descriptors handed to its workers
        # (rlmem's backend) or the exported staging buffer (its ipc backend)
        self._transfer: tuple[Any, Any, SharedWeights] | None = None
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
        if self.flavor == "vllm":
            # vLLM's /sleep aborts the requests in flight unless told otherwise (mode="abort" by default,
            # vllm/entrypoints/serve/dev/sleep/api_router.py, 0.32): they would come back cut short. "wait"
            # lets them finish first.
            self._call("POST", "/sleep", params={"level": level, "mode": "wait"}, wait=self.timeout)
        elif self.flavor == "sglang":
            if not self._sglang_release(level):
                return
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
            if not self._sglang_resume(tags):
                return
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
            # SGLang: under the lock a sleep holds from its wait to its release, so no batch of this engine
            # reaches a scheduler asserting idleness, or running over released memory
            if self._released:
                raise RemoteError(
                    f"sglang server at {self.url} is released ({', '.join(sorted(self._released))}): wake it "
                    "before generating"
                )
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
            body: dict[str, Any] = {"sampling_params": params}
            if ids:
                body["input_ids"] = [[int(t) for t in p] for p in prompts]
            else:
                body["text"] = list(prompts)
            out = self._call("POST", "/generate", json=body, timeout=self.timeout)
            outs, cut = _sglang.completions(out, ids)
            return self._grouped(outs, cut, int(params.get("n", 1)), len(prompts))
        if ids:
            body = {"input_ids": [[int(t) for t in p] for p in prompts], "max_new_tokens": max_new_tokens}
            body.update(temperature=temperature, **sampling)
            out = self._call("POST", "/generate", json=body, timeout=self.timeout)
            return [list(o) for o in out["output_ids"]]
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, **sampling}
        out = self._call("POST", "/generate", json={"prompts": list(prompts), **params}, timeout=self.timeout)
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
        out = self._call("POST", "/v1/completions", json=body, timeout=self.timeout)
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

    def update_weights_from_tensor(
        self, named: Any, *, partial: bool = False, check: bool = True
    ) -> dict[str, Any]:
        """Send ``named`` tensors (a mapping or ``(name, tensor)`` pairs) by handle (CUDA IPC, or shared
        memory on the host): the server copies them into its weights by name before answering, so they
        may change once this returns. rlmem's server: rlmem's handles; SGLang's: its ``flattened_bucket``
        format (one bucket, sent to every tensor-parallel rank), inside a weight-update session
        (``/begin_weight_update`` ... ``/end_weight_update``, always ended; a server without sessions
        loads without one), after every name, shape and dtype was checked against the checkpoint the
        server loaded (its ``/model_info``; read once). Not vLLM's.

        Args:
            named: the tensors by name.
            partial: SGLang: these are some of the model's tensors (else every one it loads is required).
            check: SGLang: check the tensors first (False: send them unchecked, where the checkpoint
                cannot be read here; a name or shape its model lacks then kills the server).

        Raises:
            ValueError: the vLLM flavor; SGLang: its weights released by this engine (wake them first), its
                weight cache on, a tensor its model does not have as given (named with what was sent and
                what the model has), a set not complete without ``partial``, a checkpoint not readable
                here (nothing is sent in each case).
            RemoteError: the server refused (SGLang: another client's session open).
        """
        pairs = list(named.items()) if isinstance(named, dict) else list(named)
        if self.flavor == "sglang":
            return self._sglang_update(
                pairs, partial=check_flag("partial", partial), check=check_flag("check", check)
            )
        if self.flavor != "rlmem":
            raise ValueError(f"update_weights_from_tensor: flavor 'rlmem' or 'sglang', not {self.flavor!r}")
        from ..colocate.ipc import share_tensors

        return self._call("POST", "/update_weights_from_tensor", json={"tensors": share_tensors(pairs)})

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
        """SGLang: ``weights``' parameters through :meth:`update_weights_from_tensor` (checked against the
        checkpoint the server loaded, inside its weight-update session).

        vLLM: load the server's weights from ``weights`` through its weight-transfer API: vLLM's
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
            ValueError: the rlmem flavor, ``weights`` not a SharedWeights, an unknown ``backend`` or
                ``pause``, ``verify``/``partial`` with ``"ipc"``, or ``"ipc"`` with weights off a GPU.
            RemoteError: the server refused (the update, naming the parameters at fault and what its model
                takes; an unknown backend: its message names the ones it has), or the verification found
                parameters that differ (named).
        """
        if self.flavor not in ("vllm", "sglang"):
            raise ValueError(f"update_weights: the vllm and sglang flavors, not {self.flavor!r}")
        if not isinstance(weights, SharedWeights):
            raise ValueError(f"weights must be a SharedWeights, got {type(weights).__name__}")
        if self.flavor == "sglang":
            if verify or backend != "rlmem":
                raise ValueError(
                    "update_weights: verify and backend are vLLM's; SGLang takes the tensors by handle"
                )
            if sync:
                weights.sync()
            self._sglang_update_shared(weights, names, partial)
            return
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
                from ..colocate.handout import Handout

                sender: Any = Handout(weights)
                info: dict[str, Any] = {"socket": sender.path, "timeout": self.control_timeout}
            else:
                from ._vllm_ipc import IpcStaging

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
        params = {"timeout": self.control_timeout} if self.flavor == "sglang" else None
        t0 = time.monotonic()
        while True:
            out = self._call("POST", path[self.flavor], params=params, wait=self.control_timeout)
            if not (isinstance(out, dict) and out.get("success") is False):
                return
            if time.monotonic() - t0 > self.control_timeout:
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
            return self._http.get(self._health_path(), timeout=self.control_timeout).status_code == 200
        except Exception:
            return False

    def close(self) -> None:
        self._close_transfer()
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
        # SGLang's /health generates a token: not over a KV cache this engine released
        ctl = self.__dict__.get("_sgl_control")  # not _sgl(): no wait for a sleep holding the lock
        if self.flavor == "sglang" and (self._released or (ctl is not None and ctl.paused)):  # paused: held
            return "/server_info"
        return "/health"

    def _sglang_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(self._call("GET", "/server_info") or {})
        return self._info

    def _sgl(self) -> _sglang.Control:
        with self._idle:
            ctl = self.__dict__.get("_sgl_control")
            if ctl is None:
                ctl = self._sgl_control = _sglang.Control(self)
            return ctl

    def _sglang_release(self, level: int) -> bool:
        """Release what ``level`` takes and is not released yet (False: nothing to release), only once the
        server is idle: SGLang's scheduler dies on a release while a request runs (module docstring).

        This engine's lock is held from the wait for its own generations to the release's answer, and
        ``generate`` takes it to check what is released: no request of this engine's other threads
        reaches the server in between. Other clients' are held by SGLang's pause (``retract``: those
        running go back to its queue, to run after the wake), which lasts until every tag is resumed; a
        server without ``/pause_generation`` has only the flush's check of idleness, and a request of
        another client arriving between the flush and the release still kills it.
        """
        ctl = self._sgl()
        with self._idle:
            self._wait_own_generations()
            info = self._sglang_info()
            tags = _sglang.release_tags(level, info, self._released, self.url)
            if not tags:
                return False
            if "weights" in tags:
                _sglang.check_weight_cache(info, self.url, f"sleep(level={level})")
            if not self._released:
                ctl.refuse_if_paused_elsewhere(f"sleep(level={level})")
            ctl.pause()
            try:
                wait = self.control_timeout
                self._call("POST", "/flush_cache", params={"timeout": wait}, wait=wait)
                self._call("POST", "/release_memory_occupation", json={"tags": tags})
            except RemoteError as e:
                # an answer: nothing was released (a failed release gets none, the server dies)
                if not self._released:
                    try:
                        ctl.unpause()
                    except Exception as u:
                        e.add_note(f"and its generation could not be let go on: {u}")
                raise
            except Exception as e:  # no answer: what was released is not known, so nothing runs
                e.add_note(f"sglang server at {self.url}: its generation stays paused (GET /ready says so)")
                raise
            self._released.update(tags)
        return True

    def _sglang_resume(self, tags: Sequence[str] | None) -> bool:
        """Resume the tags of ``tags`` this engine released (False: none), and once nothing is released
        let the server's held requests run. A tag this engine did not release is never resumed (the
        server dies on it), and, having released nothing, a server paused by another is refused."""
        ctl = self._sgl()
        with self._idle:
            todo = _sglang.resume_tags(tags, self._released)
            if not todo:
                if not self._released:
                    ctl.refuse_if_paused_elsewhere("wake")
                return False
            if "weights" in todo:
                _sglang.check_weight_cache(self._sglang_info(), self.url, "wake")
            self._call("POST", "/resume_memory_occupation", json={"tags": todo})
            self._released.difference_update(todo)
            if not self._released:
                ctl.unpause()
        return True

    def _sglang_update(
        self, pairs: list[tuple[str, torch.Tensor]], *, partial: bool, check: bool
    ) -> dict[str, Any]:
        """:meth:`update_weights_from_tensor` for SGLang: checked before anything is sent, then loaded in a
        weight-update session that is always ended, under this engine's lock (no sleep or wake of it
        meanwhile; SGLang itself waits for the requests in flight, ``tokenizer_control_mixin.py:563-598``)."""
        ctl = self._sgl()
        with self._idle:
            if "weights" in self._released:  # a load into released memory would crash its scheduler
                raise ValueError("update_weights_from_tensor: the sglang server's weights are released")
            info = self._sglang_info()
            _sglang.check_weight_cache(info, self.url, "update_weights_from_tensor")
            if check:
                check_update(
                    pairs,
                    ctl.checkpoint(),
                    partial,
                    f"the sglang server at {self.url}",
                    "update_weights_from_tensor",
                )
            bucket = _sglang.bucket(pairs)
            opened = ctl.begin()
            try:
                # each tensor-parallel rank reads its own entry; a handle is opened once (a host tensor's
                # descriptor is handed out once), so a dump per rank
                data = [_sglang.serialize(bucket) for _ in range(int(info.get("tp_size") or 1))]
                body = {"serialized_named_tensors": data, "load_format": "flattened_bucket"}
                body["flush_cache"] = True
                out = self._call("POST", "/update_weights_from_tensor", json=body, wait=ctl.generations())
                if isinstance(out, dict) and out.get("success") is False:
                    raise RemoteError(f"sglang server at {self.url} did not update its weights: {out}")
            except BaseException as e:
                if opened:
                    ctl.end(failed=e)
                raise
            if opened:
                ctl.end()
        return out if isinstance(out, dict) else {}

    def _sglang_update_shared(
        self, weights: SharedWeights, names: Sequence[str] | None, partial: bool
    ) -> None:
        """SGLang's ``update_weights(weights)``: the parameters of ``weights`` (``names``: these only; its
        buffers are not the checkpoint's) through :meth:`update_weights_from_tensor`. The caller syncs."""
        if names is None:
            names = [n for n, _ in weights.model.named_parameters()]
        names = [str(n) for n in names]
        unknown = [n for n in names if n not in weights.tensors]
        if unknown:
            raise ValueError(
                f"names: {', '.join(map(repr, unknown[:3]))} not among the shared weights' tensors"
            )
        self._sglang_update([(n, weights.tensors[n]) for n in names], partial=partial, check=True)

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
