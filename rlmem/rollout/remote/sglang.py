"""SGLang's server as an engine of this process: :class:`SGLangRemote`, and what it knows of SGLang:
which memory tags a sleep level releases, which of them may be resumed, the sampling keys its
``/generate`` takes, its ``flattened_bucket`` weight format, and the checks that keep a call of the engine
from reaching a rule that kills the server.

Its endpoints: ``POST /release_memory_occupation {"tags": [...]}``, ``POST /resume_memory_occupation
{"tags": [...]}``, ``POST /generate {"text" | "input_ids", "sampling_params"}``, ``POST /flush_cache``,
``GET /server_info``, ``POST /update_weights_from_tensor`` (its ``flattened_bucket`` format). SGLang's
scheduler dies on a resume of a tag not released or a release while requests run: this engine keeps what
it released, resumes only that, and releases only once its own generations have ended and the server is
idle.

As SGLang 0.5.23 behaves (its PyPI wheel, read; paths under ``sglang/srt``):

- ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` take ``{"tags": [...] | null}`` (null or
  empty: all of ``kv_cache``, ``weights``, ``cuda_graph``; ``constants.py:6-10``,
  ``managers/scheduler_components/weight_updater.py:343-346, 384-387``). Resuming a tag that is not
  released is ``self.offload_tags.remove(tag)`` on a set, a ``KeyError`` (``weight_updater.py:389-390``); a
  release asserts ``is_fully_idle(ignore_waiting=<generation paused>)`` (``weight_updater.py:337-341``);
  with ``--weight-cache-mode`` other than ``off`` a release or resume of the weights raises
  (``weight_updater.py:293-307, 368-369, 395-396``), as does any weight update
  (``model_executor/model_runner_components/weight_updater.py:159-171, 353``). Each of these exceptions
  ends the scheduler, which sends SIGQUIT to its parent (``managers/scheduler.py:6370-6373``), whose handler
  kills the whole server (``managers/tokenizer_manager.py:2458, 4072-4081``): the HTTP caller gets no
  answer. No endpoint says what is released (``offload_tags`` is not in ``/server_info``'s
  ``internal_states``, ``managers/scheduler_components/internal_state.py:45-63``).
- ``POST /pause_generation {"mode"}``: the tokenizer manager holds every new request until
  ``/continue_generation`` (``managers/tokenizer_manager.py:938-939, 2267-2286``); ``"retract"`` moves the
  running requests back to the waiting queue, their KV cache freed and recomputed after the continue
  (``managers/scheduler.py:5817-5910``; ``"in_place"`` leaves them running, ``"abort"`` ends them), and a
  paused scheduler runs no batch (``scheduler.py:2033-2035``) and counts only running requests against
  idleness, for the flush as for the release (``scheduler.py:5337-5360, 5518-5520``). ``GET /ready``
  answers 503 while paused (``entrypoints/http_server.py:714-718``, ``tokenizer_manager.py:732-734``).
  0.5.10 has ``/pause_generation`` but no ``/ready`` nor ``/begin_weight_update`` (FastAPI answers 404).
- ``POST /update_weights_from_tensor`` answers 400 outside a session opened by ``POST
  /begin_weight_update`` and closed by ``POST /end_weight_update`` (``weight_updater.py:232-239, 309-335``:
  one session at a time, 400 for a second begin or an end without one; ``http_server.py:1436-1485``). The
  loaded tensors go to the model's ``load_weights`` with no ``try`` around it
  (``model_executor/model_runner_components/weight_updater.py:383-413``): a shape its parameter does not
  have fails ``default_weight_loader``'s ``assert`` (``model_loader/weight_utils.py:1574-1586``, which
  casts the dtype with ``copy_``) and kills the server; a name the model does not have is skipped with a
  warning (``models/qwen3.py:753-760``), or fails a stacked parameter's lookup (``qwen3.py:737-746``). No
  endpoint lists the model's parameters: ``/get_weights_by_name`` answers a parameter's first rows as
  floats, on the five model classes that define it (``model_runner_components/weight_exporter.py:169-188``,
  ``models/llama.py:819-890``). So names and shapes are checked against the checkpoint the server loaded,
  ``GET /model_info``'s ``model_path`` (``http_server.py:812-850``): a directory, or a Hugging Face name
  resolved as SGLang does (``model_loader/weight_utils.py:621-650``, ``--download-dir``, ``--revision``),
  its safetensors files filtered by their index (``weight_utils.py:757-790``). ``rotary_emb`` tables in a
  checkpoint are skipped by the models (``qwen3.py:725-730``), and a tied ``lm_head`` is loaded from the
  embedding (``qwen3.py:705-712``).
- ``GET /server_info`` has the server arguments as top-level keys and ``version``
  (``http_server.py:863-895``, ``utils/common.py:3584-3593``): ``enable_memory_saver`` (without it nothing
  is given back) and ``enable_weights_cpu_backup`` (without it a release discards the weights,
  ``arg_groups/fields/exec_.py:58-65``), ``weight_cache_mode`` (``arg_groups/fields/model.py:377-389``),
  ``tp_size``.
- ``/health`` runs a one-token generation by default (``http_server.py:721-800``, ``environ.py:344``): not
  sent while the KV cache is released.

As SGLang's ``main`` behaves (cf7923615, 2026-08; paths under ``python/sglang/srt``):

- ``sampling_params`` is splatted into ``SamplingParams(**kwargs)`` (``managers/tokenizer_manager.py:1339``):
  an unknown key is an error there (``sampling/sampling_params.py:54-82`` lists the keys; the seed is
  ``sampling_seed``). ``n`` samples come back prompt-major (``tokenizer_manager.py:1850-1870``); a completion
  cut short has ``meta_info.finish_reason.type == "abort"`` (``managers/schedule_batch.py:219-280``).
- ``POST /update_weights_from_tensor`` with ``load_format="flattened_bucket"``: ``serialized_named_tensors``
  is a list of base64 strings, one per tensor-parallel rank (each rank reads its own,
  ``managers/tp_worker.py:198-209``), each a ``ForkingPickler`` dump (``utils/common.py:2719-2758``, unpickled
  with an allow-list of ``torch.`` and ``sglang.srt.weight_sync.tensor_bucket.``) of ``{"flattened_tensor":
  uint8 tensor, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}`` with
  byte offsets, read back as ``flat[start_idx:end_idx].view(dtype).reshape(shape)``
  (``weight_sync/tensor_bucket.py:7-107``, ``model_executor/.../weight_updater.py:330-385``).
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import importlib.util
import io
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..._checks import check_flag
from ...colocate.member import RemoteError
from ...colocate.weight_check import Checkpoint, check_update, read_checkpoint
from ...colocate.weights import SharedWeights
from ..engine import generation_length
from .base import RemoteEngine

__all__ = ["SAMPLING_KEYS", "SGLangRemote"]

# SGLang's release order (its resume runs them in reverse; each request names them in this order).
ORDER = ("kv_cache", "weights", "cuda_graph")
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)
_RENAMED = {"seed": "sampling_seed"}
_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


def release_tags(level: int, info: Mapping[str, Any], released: Iterable[str], url: str) -> list[str]:
    """The tags a ``sleep(level)`` releases on a server whose ``/server_info`` is ``info``: every tag not
    released yet (the weights survive level 1 only where the server backs them up).

    Raises:
        ValueError: the server gives nothing back (no ``--enable-memory-saver``), or level 1 on a server
            that would discard the weights (no ``--enable-weights-cpu-backup``).
    """
    if not info.get("enable_memory_saver"):
        raise ValueError(
            f"sglang server at {url} was started without --enable-memory-saver: its release gives no memory "
            "back (start it with that flag)"
        )
    if level == 1 and not info.get("enable_weights_cpu_backup"):
        raise ValueError(
            f"sleep(level=1) keeps the weights, which the sglang server at {url} discards on release "
            "(started without --enable-weights-cpu-backup): start it with that flag, or use level 2 and "
            "update its weights after the wake"
        )
    done = set(released)
    return [t for t in ORDER if t not in done]


def resume_tags(asked: Sequence[str] | None, released: Iterable[str]) -> list[str]:
    """The tags of ``asked`` (None: all) to resume: those this client released, ``cuda_graph`` with
    ``kv_cache`` unless named on its own."""
    want = set(ORDER if asked is None else asked)
    if "kv_cache" in want:
        want.add("cuda_graph")
    done = set(released)
    return [t for t in ORDER if t in want and t in done]


def sampling_params(max_new_tokens: int, temperature: float, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """``sampling_params`` for SGLang's ``/generate`` (``seed`` becomes ``sampling_seed``).

    Raises:
        ValueError: a key SGLang's ``SamplingParams`` does not take (it would fail the request there).
    """
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    for k, v in sampling.items():
        key = _RENAMED.get(k, k)
        if key not in SAMPLING_KEYS:
            allowed = ", ".join(sorted(SAMPLING_KEYS))
            raise ValueError(
                f"sampling parameter {k!r} is not one SGLang takes; allowed: {allowed} (and seed, sent as "
                "sampling_seed)"
            )
        out[key] = v
    return out


def completions(out: Any, ids: bool) -> tuple[list[Any], int]:
    """The texts (token ids for token-id prompts) of ``/generate``'s answer, in its order (prompt-major),
    and how many came back aborted (cut short on the server's side)."""
    rows = out if isinstance(out, list) else [out]
    cut = sum(((r.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "abort" for r in rows)
    return [list(r["output_ids"]) if ids else r["text"] for r in rows], cut


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """The fields SGLang's bucket metadata has (pickled under SGLang's class name, see :func:`bucket`)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def bucket(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's flattened bucket of ``named`` tensors (one device): their bytes back to back in one uint8
    tensor, and where each lies."""
    flat, meta, at = [], [], 0
    for name, t in named:
        b = t.detach().contiguous().view(-1).view(torch.uint8)
        meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + b.numel(), b.numel()))
        flat.append(b)
        at += b.numel()
    if not flat:
        raise ValueError("update_weights_from_tensor: no tensors given")
    devices = {b.device for b in flat}
    if len(devices) > 1:
        where = sorted(map(str, devices))
        raise ValueError(f"update_weights_from_tensor: the tensors are on several devices, {where}")
    return {"flattened_tensor": torch.cat(flat), "metadata": meta}


def serialize(obj: Any) -> str:
    """``obj`` as SGLang's ``MultiprocessingSerializer`` takes it: a ``ForkingPickler`` dump (tensors by
    handle: CUDA IPC, or shared memory on the host), base64. The metadata is pickled under SGLang's class
    name, which SGLang's unpickler allows, without SGLang installed here."""
    from multiprocessing.reduction import ForkingPickler

    theirs = sys.modules.get(_BUCKET_MODULE)
    if theirs is None and importlib.util.find_spec("sglang") is not None:
        theirs = importlib.import_module(_BUCKET_MODULE)
    buf = io.BytesIO()
    if theirs is not None:  # SGLang is here: its own class
        ForkingPickler(buf).dump(_as_theirs(obj, theirs))
        return base64.b64encode(buf.getvalue()).decode()
    # pickle writes a class by its module's name, which must import: the names resolve to this class for
    # the dump only
    parts = _BUCKET_MODULE.split(".")
    added = [".".join(parts[: i + 1]) for i in range(len(parts))]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[_BUCKET_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]
    saved = FlattenedTensorMetadata.__module__
    FlattenedTensorMetadata.__module__ = _BUCKET_MODULE
    try:
        ForkingPickler(buf).dump(obj)
    finally:
        FlattenedTensorMetadata.__module__ = saved
        for name in added:
            del sys.modules[name]
    return base64.b64encode(buf.getvalue()).decode()


def _as_theirs(obj: dict[str, Any], module: types.ModuleType) -> dict[str, Any]:
    cls = module.FlattenedTensorMetadata
    return {**obj, "metadata": [cls(**dataclasses.asdict(m)) for m in obj["metadata"]]}


def check_weight_cache(info: Mapping[str, Any], url: str, what: str) -> None:
    """Refuse ``what`` (a release, resume or update of the weights) on a server whose weight cache is on:
    its scheduler raises there, and the server dies.

    Raises:
        ValueError: ``--weight-cache-mode`` is not ``off``.
    """
    mode = info.get("weight_cache_mode") or "off"  # absent before the weight cache existed
    if mode != "off":
        raise ValueError(
            f"{what}: the sglang server at {url} runs with --weight-cache-mode {mode}, whose scheduler "
            "raises on any release, resume or update of the weights (the server then dies); nothing was "
            "sent. Restart it with --weight-cache-mode off"
        )


class Control:
    """What a :class:`SGLangRemote` knows of its SGLang server beyond the protocol's calls,
    and the calls an older server lacks (FastAPI answers 404 there, which is how they are told apart: a
    version number says nothing of a build from source): the weight-update session, the pause, ``/ready``.
    Used under the engine's lock."""

    def __init__(self, engine: SGLangRemote) -> None:
        self.engine = engine
        self.paused = False  # this engine paused the server's generation: held until all is resumed
        self.sessions: bool | None = None  # the server has /begin_weight_update (None: not asked yet)
        self._checkpoint: Checkpoint | str | None = None  # read once; a str says why it cannot be

    def _optional(self, path: str, body: Any, wait: float = 0.0) -> bool:
        """``POST path``: False where the server has no such endpoint (404). ``wait``: what the server may
        take beyond a control call's time-out.

        Raises:
            RemoteError: any other error answer. ConnectionError: no answer.
        """
        r = self._request("POST", path, wait=wait, json=body)
        if r.status_code == 404:
            return False
        if r.status_code >= 400:
            raise RemoteError(f"POST {self.engine.url}{path} answered {r.status_code}: {r.text[:500]}")
        return True

    def _request(self, method: str, path: str, wait: float = 0.0, **kw: Any) -> Any:
        import httpx

        try:
            return self.engine._http.request(method, path, timeout=self.engine.control_timeout + wait, **kw)
        except httpx.HTTPError as e:
            raise ConnectionError(f"{method} {self.engine.url}{path}: {e}") from e

    def refuse_if_paused_elsewhere(self, what: str) -> None:
        """Raise if the server's generation is paused and not by this engine: another engine (or this
        process before a restart) released its memory, and which tags it released no endpoint says.

        Raises:
            RemoteError: ``GET /ready`` answers 503.
        """
        if self.paused:
            return
        code = self._request("GET", "/ready").status_code
        if code == 503:  # 404: a server without /ready (0.5.10), which cannot say
            raise RemoteError(
                f"{what}: the sglang server at {self.engine.url} answers GET /ready with 503: paused, and "
                "not by this engine (another client, or an engine of a process since restarted, may have "
                "released its memory, and no endpoint says which tags), or still starting. Nothing was "
                "sent: a resume of a tag not released, or a release over released memory, kills the "
                "server. Wake it from the engine that put it to sleep (or POST /resume_memory_occupation "
                "with the tags released, then /continue_generation)"
            )

    def pause(self) -> None:
        """Hold every new request at the server and move the running ones back to its queue
        (``mode="retract"``: nobody's request is lost, and a release then finds the scheduler idle)."""
        if not self.paused:
            self.paused = self._optional("/pause_generation", {"mode": "retract"})

    def unpause(self) -> None:
        """Let the requests held since :meth:`pause` run (a retracted one recomputes its KV cache)."""
        if self.paused:
            self._optional("/continue_generation", {})
            self.paused = False

    def begin(self) -> bool:
        """Open a weight-update session; False on a server without them (it loads without one).

        Raises:
            RemoteError: the server refused (one is open already: another client's, or one left by a
                process that died in it).
        """
        if self.sessions is False:
            return False
        self.sessions = self._optional("/begin_weight_update", {}, wait=self.generations())
        return self.sessions

    def generations(self) -> float:
        """How long the server may wait for the generations in flight before a session call or an update:
        each takes the tokenizer manager's writer lock (unless paused), which every request holds as a
        reader to its end (``tokenizer_control_mixin.py:472-483, 580-587``, ``tokenizer_manager.py:941``)."""
        return 0.0 if self.paused else self.engine.timeout

    def end(self, failed: BaseException | None = None) -> None:
        """Close the session :meth:`begin` opened; after ``failed``, its own failure goes on that one."""
        try:
            self.engine._call("POST", "/end_weight_update", json={}, wait=self.generations())
        except Exception as e:
            if failed is None:
                raise
            failed.add_note(f"and the weight-update session opened for it could not be ended: {e}")

    def checkpoint(self) -> Checkpoint:
        """The checkpoint the server loaded (read once).

        Raises:
            ValueError: it cannot be read here (saying why, and what to do).
        """
        if self._checkpoint is None:
            try:
                model = self.engine._call("GET", "/model_info")
                path = model.get("model_path") if isinstance(model, dict) else None
                if not path:
                    raise LookupError("its /model_info names no model_path")
                self._checkpoint = read_checkpoint(str(path), self.engine._server_info())
            except (LookupError, RemoteError, OSError, ValueError) as e:
                if isinstance(e, ConnectionError):  # no answer: asked again next time
                    raise
                self._checkpoint = str(e)
        if isinstance(self._checkpoint, str):
            raise ValueError(
                f"update_weights_from_tensor: the tensors cannot be checked against the sglang server at "
                f"{self.engine.url}: {self._checkpoint}. SGLang has no endpoint that lists its model's "
                "parameters, so they are checked against the checkpoint it loaded, and a name or shape its "
                "model does not have kills its scheduler. Nothing was sent: make that checkpoint readable "
                "here, or pass check=False to send unchecked"
            )
        return self._checkpoint


class SGLangRemote(RemoteEngine):
    """SGLang's server driven by the engine protocol (``RemoteEngine(url, "sglang")``); every call keeps
    clear of the rules under which its scheduler dies (module docstring).

    Example:
        >>> engine = RemoteEngine("http://127.0.0.1:30000", flavor="sglang", device="cuda:0")
        >>> pm.add_engine(engine)   # doctest: +SKIP
    """

    flavor: ClassVar[str] = "sglang"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._released: set[str] = set()  # the tags this engine released (SGLang has no such endpoint)
        self._info: dict[str, Any] | None = None  # its /server_info, read once
        self._control: Control | None = None

    def _check_generate(self) -> None:
        if self._released:
            raise RemoteError(
                f"sglang server at {self.url} is released ({', '.join(sorted(self._released))}): wake it "
                "before generating"
            )

    def _generate(
        self,
        prompts: Sequence[Any],
        ids: bool,
        max_new_tokens: int | None,
        temperature: float,
        sampling: dict,
    ) -> Any:
        params = sampling_params(generation_length(max_new_tokens), temperature, sampling)
        body: dict[str, Any] = {"sampling_params": params}
        if ids:
            body["input_ids"] = [[int(t) for t in p] for p in prompts]
        else:
            body["text"] = list(prompts)
        out = self._call("POST", "/generate", json=body, timeout=self.timeout)
        outs, cut = completions(out, ids)
        return self._grouped(outs, cut, int(params.get("n", 1)), len(prompts))

    def is_sleeping(self) -> bool:
        return bool(self._released)

    def _flush_params(self) -> dict[str, Any] | None:
        # SGLang waits for its scheduler to be idle up to ?timeout= and answers 400 if it was not
        return {"timeout": self.control_timeout}

    def _health_path(self) -> str:
        # SGLang's /health generates a token: not over a KV cache this engine released, nor while it holds
        # the server paused (read without the lock: no wait for a sleep holding it)
        ctl = self._control
        if self._released or (ctl is not None and ctl.paused):
            return "/server_info"
        return "/health"

    def _server_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = dict(self._call("GET", "/server_info") or {})
        return self._info

    def _sgl(self) -> Control:
        with self._idle:
            if self._control is None:
                self._control = Control(self)
            return self._control

    def _release(self, level: int) -> bool:
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
            info = self._server_info()
            tags = release_tags(level, info, self._released, self.url)
            if not tags:
                return False
            if "weights" in tags:
                check_weight_cache(info, self.url, f"sleep(level={level})")
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

    def _resume(self, tags: list[str] | None) -> bool:
        """Resume the tags of ``tags`` this engine released (False: none), and once nothing is released
        let the server's held requests run. A tag this engine did not release is never resumed (the
        server dies on it), and, having released nothing, a server paused by another is refused."""
        ctl = self._sgl()
        with self._idle:
            todo = resume_tags(tags, self._released)
            if not todo:
                if not self._released:
                    ctl.refuse_if_paused_elsewhere("wake")
                return False
            if "weights" in todo:
                check_weight_cache(self._server_info(), self.url, "wake")
            self._call("POST", "/resume_memory_occupation", json={"tags": todo})
            self._released.difference_update(todo)
            if not self._released:
                ctl.unpause()
        return True

    def update_weights_from_tensor(
        self, named: Any, *, partial: bool = False, check: bool = True
    ) -> dict[str, Any]:
        """Send ``named`` tensors (a mapping or ``(name, tensor)`` pairs) by handle (CUDA IPC, or shared
        memory on the host) in SGLang's ``flattened_bucket`` format (one bucket, sent to every
        tensor-parallel rank), inside a weight-update session (``/begin_weight_update`` ...
        ``/end_weight_update``, always ended; a server without sessions loads without one), after every
        name, shape and dtype was checked against the checkpoint the server loaded (its ``/model_info``;
        read once). The server copies them into its weights by name before answering, so they may change
        once this returns.

        Args:
            named: the tensors by name.
            partial: these are some of the model's tensors (else every one it loads is required).
            check: check the tensors first (False: send them unchecked, where the checkpoint
                cannot be read here; a name or shape its model lacks then kills the server).

        Raises:
            ValueError: the server's weights released by this engine (wake them first), its
                weight cache on, a tensor its model does not have as given (named with what was sent and
                what the model has), a set not complete without ``partial``, a checkpoint not readable
                here (nothing is sent in each case).
            RemoteError: the server refused (another client's session open).
        """
        pairs = list(named.items()) if isinstance(named, dict) else list(named)
        return self._update(pairs, partial=check_flag("partial", partial), check=check_flag("check", check))

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
        """``weights``' parameters (``names``: these only; after ``weights.sync()`` with ``sync``) through
        :meth:`update_weights_from_tensor`: checked against the checkpoint the server loaded, inside its
        weight-update session. ``pause`` is vLLM's; SGLang waits for the requests in flight itself.

        Raises:
            ValueError: ``weights`` not a SharedWeights, ``verify`` or another ``backend`` (vLLM's), a name
                not among the shared tensors, or any refusal of :meth:`update_weights_from_tensor`.
            RemoteError: the server refused.
        """
        if not isinstance(weights, SharedWeights):
            raise ValueError(f"weights must be a SharedWeights, got {type(weights).__name__}")
        if verify or backend != "rlmem":
            raise ValueError(
                "update_weights: verify and backend are vLLM's; SGLang takes the tensors by handle"
            )
        if sync:
            weights.sync()
        self._update_shared(weights, names, partial)

    def _update(self, pairs: list[tuple[str, torch.Tensor]], *, partial: bool, check: bool) -> dict[str, Any]:
        """:meth:`update_weights_from_tensor` for SGLang: checked before anything is sent, then loaded in a
        weight-update session that is always ended, under this engine's lock (no sleep or wake of it
        meanwhile; SGLang itself waits for the requests in flight, ``tokenizer_control_mixin.py:563-598``)."""
        ctl = self._sgl()
        with self._idle:
            if "weights" in self._released:  # a load into released memory would crash its scheduler
                raise ValueError("update_weights_from_tensor: the sglang server's weights are released")
            info = self._server_info()
            check_weight_cache(info, self.url, "update_weights_from_tensor")
            if check:
                check_update(
                    pairs,
                    ctl.checkpoint(),
                    partial,
                    f"the sglang server at {self.url}",
                    "update_weights_from_tensor",
                )
            flat = bucket(pairs)
            opened = ctl.begin()
            try:
                # each tensor-parallel rank reads its own entry; a handle is opened once (a host tensor's
                # descriptor is handed out once), so a dump per rank
                data = [serialize(flat) for _ in range(int(info.get("tp_size") or 1))]
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

    def _update_shared(self, weights: SharedWeights, names: Sequence[str] | None, partial: bool) -> None:
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
        self._update([(n, weights.tensors[n]) for n in names], partial=partial, check=True)
