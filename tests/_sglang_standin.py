"""A stand-in of SGLang 0.5.23's HTTP server, for RemoteEngine's tests: its endpoints answer as its code
does (read from its PyPI wheel; paths under ``sglang/srt``, each rule quoting its file and line), including
the rules under which its scheduler raises and the whole server dies (``managers/scheduler.py:6370-6373``
sends SIGQUIT to the parent, whose handler kills the process tree, ``managers/tokenizer_manager.py:2458,
4072-4081``): the stand-in then closes the connection without an answer and answers nothing after.

The model is a dict of tensors under their checkpoint names (SGLang's own stacks q/k/v and gate/up into
one parameter, which changes no rule modelled here), written as a safetensors checkpoint whose directory
``/model_info`` names. It holds 32 MiB of shared memory while its KV cache is mapped and lets it go
``late`` seconds after answering a release, so a fence is seen to wait for the memory."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import pickle
import tempfile
import threading
import time
import types
from pathlib import Path

import torch
from _helpers import serve_routes
from safetensors.torch import save_file

from rlmem import Region

MiB = 1 << 20
HOLD_S = 30.0  # a request held by the pause waits at most this long here (the real one waits on)
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")  # constants.py:6-10, GPU_MEMORY_ALL_TYPES


@dataclasses.dataclass
class _Metadata:
    """FlattenedTensorMetadata's fields (weight_sync/tensor_bucket.py:7-16), under its module's name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_BUCKET = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
_BUCKET.FlattenedTensorMetadata = _Metadata
_Metadata.__module__ = _BUCKET.__name__

# utils/common.py:3144-3370: SafeUnpickler allows exact (module, name) pairs only; these are the ones of a
# bucket of host or CUDA tensors (every torch dtype name is in its list too)
_ALLOWED = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _ALLOWED and not dtype:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        if module == _BUCKET.__name__:
            return getattr(_BUCKET, name)
        return super().find_class(module, name)


# sampling/sampling_params.py:149-181: the API fields of SamplingParams, which /generate's
# sampling_params is built into (an unknown key is an error)
SAMPLING_FIELDS = frozenset(
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
        "beam_width",
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
        "watermark",
    }
)


def tiny_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A two-layer decoder's tensors under their checkpoint names, in bf16."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,), "lm_head.weight": (16, 8)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (8, 8), p + "mlp.up_proj.weight": (12, 8)}
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


class SGLangStandIn:
    """SGLang 0.5.23's server (``version``: what ``/server_info`` says). ``sessions``, ``ready``, ``pause``:
    whether it has ``/begin_weight_update`` and ``/end_weight_update``, ``/ready``, ``/pause_generation``
    and ``/continue_generation`` (0.5.10 has only the pause: FastAPI answers 404 to the others).
    Requests are recorded as (method, path, query, body)."""

    def __init__(
        self,
        *,
        late: float = 0.3,
        token: str | None = None,
        model: dict[str, torch.Tensor] | None = None,
        config: dict | None = None,
        sessions: bool = True,
        ready: bool = True,
        pause: bool = True,
    ) -> None:
        self.late, self.token = late, token
        self.sessions, self.has_ready, self.has_pause = sessions, ready, pause
        self.requests: list[tuple[str, str, dict, object]] = []
        self.args = {
            "enable_memory_saver": True,
            "enable_weights_cpu_backup": True,
            "tp_size": 2,
            "weight_cache_mode": "off",
            "version": "0.5.23",
        }
        self.kv: Region | None = None
        self.free_memory = True  # False: never gives its memory back
        self.gen_s = 0.0  # how long a generation takes
        self.abort_next = False  # the next completions come back aborted
        self.on_flush = None  # called once, when a /flush_cache has flushed, before it answers (a race)
        self.released: set[str] = set()  # weight_updater.py:96, offload_tags
        self.session = False  # weight_updater.py:99, _session is not None
        self.paused: str | None = None  # the pause's mode while paused (tokenizer is_pause, _engine_paused)
        self.running = 0  # requests in its running batch
        self.waiting = 0  # requests retracted to its waiting queue
        self.dead: str | None = None  # why its scheduler raised (None: alive)
        self.loaded: dict[str, torch.Tensor] = {}  # the tensors the last update sent, as sent
        self.warnings: list[str] = []
        self.derived_cache_error: str | None = None  # a model whose derived weights an update cannot refresh
        self.cond = threading.Condition()
        self.model = {n: t.clone() for n, t in (tiny_model() if model is None else model).items()}
        self.dir = tempfile.TemporaryDirectory(prefix="sglang-ckpt-")
        save_file(
            {n: t.contiguous() for n, t in self.model.items()}, str(Path(self.dir.name, "model.safetensors"))
        )
        Path(self.dir.name, "config.json").write_text(json.dumps(config or {"tie_word_embeddings": False}))
        self.model_path = self.dir.name
        self._take()  # it starts with its memory taken, and says nothing of it
        self.server, self.url = serve_routes(self)

    # -- memory ----------------------------------------------------------------------------------------
    def _take(self) -> None:
        if self.kv is None:
            self.kv = Region(32 * MiB, "cpu", shareable=True, name="sglang-standin-kv")
            self.kv.empty(self.kv.nbytes, torch.uint8).fill_(1)

    def _let_go(self) -> None:
        kv, self.kv = self.kv, None
        if kv is not None and self.free_memory:
            threading.Timer(self.late, kv.close).start()

    # -- the scheduler's rules -------------------------------------------------------------------------
    def _die(self, why: str):
        # scheduler.py:6370-6373: the exception ends the scheduler, SIGQUIT kills the server
        with self.cond:
            self.dead = why
            self.cond.notify_all()
        return None, None

    def _idle(self) -> bool:
        # scheduler.py:5337-5360: nothing running, and nothing waiting unless paused (ignore_waiting is
        # _engine_paused for the flush, 5518-5520, and the release, weight_updater.py:339-341)
        return self.running == 0 and (self.paused is not None or self.waiting == 0)

    def _over_released(self) -> bool:
        return bool(self.released & {"kv_cache", "weights"})

    def route(self, method, path, query, body):
        if self.dead:
            return None, None
        body = body or {}
        if path == "/server_info":  # http_server.py:863-895: the server args as top-level keys, version
            return 200, dict(self.args)
        if path == "/model_info":  # http_server.py:812-850
            return 200, {"model_path": self.model_path, "is_generation": True, "weight_version": "default"}
        if path == "/ready" and self.has_ready:  # http_server.py:714-718: 503 unless is_ready()
            # tokenizer_manager.py:732-734: is_ready is not is_pause and healthy
            return (503, None) if self.paused else (200, None)
        if path == "/pause_generation" and self.has_pause:
            return self._pause(body.get("mode", "abort"))  # io_struct.py:1946, mode defaults to "abort"
        if path == "/continue_generation" and self.has_pause:
            with self.cond:  # tokenizer_manager.py:2282-2286, scheduler.py:5934-5957
                self.paused = None
                self.cond.notify_all()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/health":
            if self.paused:  # tokenizer_manager.py:938-939 holds its generation; http_server.py:780-800
                return 503, None  # answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s), not waited here
            if self._over_released():  # it generates a token (http_server.py:721-760, environ.py:344)
                return self._die("/health generated over released memory")
            return 200, None
        if path == "/generate":
            return self._generate(body)
        if path == "/flush_cache":
            return self._flush(float((query.get("timeout") or ["0"])[0]))
        if path == "/release_memory_occupation":
            return self._release(body.get("tags"))
        if path == "/resume_memory_occupation":
            return self._resume(body.get("tags"))
        if path == "/begin_weight_update" and self.sessions:
            # weight_updater.py:309-321: one session at a time; http_server.py:1458-1470: 400 if refused
            if self.session:
                msg = "a weight-update session is already open; call end_weight_update() first"
                return 400, {"success": False, "message": msg}
            self.session = True
            return 200, {"success": True, "message": "Success"}
        if path == "/end_weight_update" and self.sessions:
            if not self.session:  # weight_updater.py:323-329
                msg = "no weight-update session is open; call begin_weight_update() first"
                return 400, {"success": False, "message": msg}
            self.session = False
            return 200, {"success": True, "message": "Success"}
        if path == "/update_weights_from_tensor":
            return self._update(body)
        return 404, {"detail": "Not Found"}  # FastAPI's answer to a path it has no route for

    def _pause(self, mode: str):
        with self.cond:  # tokenizer_manager.py:2267-2280: new requests held from now on
            if mode == "abort":
                self.abort_next = self.running > 0  # abort_request(abort_all=True): the running end aborted
                self.paused = mode
                return 200, {"message": "Generation paused successfully.", "status": "ok"}
            if mode not in ("in_place", "retract"):  # scheduler.py:5818: assert mode in (in_place, retract)
                return self._die(f"pause_generation mode {mode!r}")
            # scheduler.py:5820-5832: in_place leaves the running batch as it is; 5868-5910: retract moves
            # the running requests back to the waiting queue (they run again after the continue)
            self.paused = mode
            self.cond.notify_all()
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _generate(self, body):
        params = body.get("sampling_params") or {}
        unknown = set(params) - SAMPLING_FIELDS
        if unknown:  # SamplingParams's constructor refuses the key
            return 400, {"error": {"message": f"unexpected keyword argument {sorted(unknown)[0]!r}"}}
        with self.cond:
            # tokenizer_manager.py:938-939: a new request waits while the generation is paused
            if not self.cond.wait_for(lambda: not self.paused or self.dead, timeout=HOLD_S):
                return 503, {"error": {"message": "held by the pause"}}
            if self.dead:
                return None, None
            if self._over_released():  # its batch would run over unmapped memory
                return self._die("/generate ran over released memory")
            self.running += 1
        left = self.gen_s
        try:
            while left > 0:
                time.sleep(min(0.01, left))
                left -= 0.01
                with self.cond:
                    if self.paused == "retract":  # retracted, run again from the start after the continue
                        self.running, self.waiting = self.running - 1, self.waiting + 1
                        self.cond.wait_for(lambda: not self.paused or self.dead, timeout=HOLD_S)
                        self.running, self.waiting = self.running + 1, self.waiting - 1
                        if self.dead:
                            return None, None
                        if self._over_released():
                            return self._die("a retracted request ran over released memory")
                        left = self.gen_s
                    elif self.paused == "in_place":  # stays in the running batch, not stepped
                        self.cond.wait_for(lambda: not self.paused or self.dead, timeout=HOLD_S)
                    if self.dead:
                        return None, None
        finally:
            with self.cond:
                self.running -= 1
        aborted, self.abort_next = self.abort_next, False
        reason = {"type": "abort", "message": "aborted"} if aborted else {"type": "length"}
        rows = []
        for p in body.get("input_ids") or body.get("text") or []:
            for k in range(int(params.get("n", 1))):  # prompt-major (tokenizer_manager.py:1850-1870)
                done = {"meta_info": {"finish_reason": reason}}
                if "input_ids" in body:
                    rows.append({**done, "output_ids": [*p, 100 + k], "text": ""})
                else:
                    rows.append({**done, "text": f"{p}!" + "*" * k, "output_ids": []})
        return 200, rows

    def _flush(self, timeout: float):
        deadline = time.monotonic() + timeout  # deferred until idle within ?timeout= (http_server.py:1025)
        with self.cond:
            while not self._idle() and time.monotonic() < deadline:
                self.cond.wait(0.01)
            if not self._idle():  # http_server.py:1033-1040: 400 with the reason
                return 400, "Timed out waiting for idle state."
        if self.on_flush is not None:  # flushed: what arrives now finds the scheduler busy again
            hook, self.on_flush = self.on_flush, None
            hook()
        return 200, "Cache flushed."

    def _release(self, tags):
        with self.cond:
            if not self._idle():  # weight_updater.py:339-341: assert is_fully_idle(...)
                return self._die("release_memory_occupation while a request runs (assert is_fully_idle)")
            tags = tags or ALL_TAGS  # weight_updater.py:345-346
            self.released |= set(tags)  # 348-349
            if "weights" in tags and self.args["weight_cache_mode"] != "off":  # 368-369, 293-307
                return self._die("release of the weights with the weight cache on (RuntimeError)")
            if "kv_cache" in tags:
                self._let_go()
        return 200, None  # http_server.py:1575-1584: the handler returns nothing

    def _resume(self, tags):
        with self.cond:
            for tag in tags or ALL_TAGS:  # weight_updater.py:386-387
                if tag not in self.released:  # 389-390: self.offload_tags.remove(tag)
                    return self._die(f"KeyError {tag!r}: resumed, not released")
                self.released.remove(tag)
            if "weights" in (tags or ALL_TAGS) and self.args["weight_cache_mode"] != "off":  # 395-396
                return self._die("resume of the weights with the weight cache on (RuntimeError)")
            self._take()
        return 200, None

    def _update(self, body):
        if self.sessions and not self.session:  # weight_updater.py:232-239; http_server.py:1436-1455: 400
            msg = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            return 400, {"success": False, "message": msg}
        if self.derived_cache_error:  # model_executor/.../weight_updater.py:43-60, 348-350: refused, 400
            return 400, {"success": False, "message": self.derived_cache_error}
        if self.args["weight_cache_mode"] != "off":  # model_executor/.../weight_updater.py:159-171, 353
            return self._die("update_weights_from_tensor with the weight cache on (RuntimeError)")
        if body.get("load_format") != "flattened_bucket":  # weight_updater.py:343-381, another loader
            return self._die(f"load_format {body.get('load_format')!r}")
        if "weights" in self.released:  # a copy into unmapped memory
            return self._die("update_weights_from_tensor into released weights")
        entries = body["serialized_named_tensors"]
        if len(entries) < self.args["tp_size"]:  # tp_worker.py:194-201: each rank reads entries[tp_rank]
            return self._die("IndexError: a tensor-parallel rank without its entry")
        ranks = []
        for rank in range(self.args["tp_size"]):
            obj = _Unpickler(io.BytesIO(base64.b64decode(entries[rank], validate=True))).load()
            flat = obj["flattened_tensor"]  # tensor_bucket.py:118-135: flat[start:end].view(dtype).reshape
            ranks.append(
                [
                    (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
                    for m in obj["metadata"]
                ]
            )
        # model_executor/.../weight_updater.py:383-413: load_weights with no try around it
        for name, t in ranks[0]:
            self.loaded[name] = t.clone()
            if name not in self.model:  # models/qwen3.py:753-760: skipped, with a warning
                self.warnings.append(f"Parameter {name} not found in params_dict")
                continue
            if self.model[name].shape != t.shape:  # model_loader/weight_utils.py:1582-1585: assert
                return self._die(
                    f"Attempted to load weight ({t.shape}) into parameter ({self.model[name].shape})"
                )
            self.model[name].copy_(t)  # weight_utils.py:1586: copy_, which casts
        with self.cond:
            if not self._idle():  # weight_updater.py:120-133: flush_cache=True needs the scheduler idle
                msg = "Weights were updated, but the cache was not flushed because requests are still running"
                return 400, {"success": False, "message": msg}
        return 200, {"success": True, "message": "Success"}

    def close(self) -> None:
        with self.cond:
            self.dead = self.dead or "closed"
            self.cond.notify_all()
        self.server.shutdown()
        if self.kv is not None:
            self.kv.close()
        self.dir.cleanup()
