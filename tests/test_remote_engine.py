"""RemoteEngine against stand-in servers speaking exactly the documented request shapes of vLLM's dev
endpoints (``/sleep?level``, ``/wake_up?tags``, ``/is_sleeping``, ``/v1/completions``), SGLang's
(``/release_memory_occupation``, ``/resume_memory_occupation`` with ``{"tags"}``, ``/generate`` with
``{"text", "sampling_params"}``, ``/flush_cache``) and rlmem's. The real vLLM and SGLang servers were not run
(they cannot run on the machines this project has). A stand-in holds shared memory while awake and lets it
go only after it has answered ``sleep``, so the fence is seen to wait for the memory, not the answer."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import pickle
import sys
import threading
import time
import types
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import torch
from _helpers import JSONHandler

from rlmem import Region
from rlmem.colocate import FenceError, RemoteError
from rlmem.rollout import _sglang
from rlmem.rollout.http_engine import RemoteEngine

MiB = 1 << 20


@dataclasses.dataclass
class _Metadata:
    """SGLang's FlattenedTensorMetadata's fields (weight_sync/tensor_bucket.py), under its module's name."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# sampling/sampling_params.py:54-82: the keyword arguments of SGLang's SamplingParams
_SGLANG_SAMPLING = {
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

_BUCKET = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
_BUCKET.FlattenedTensorMetadata = _Metadata
_Metadata.__module__ = _BUCKET.__name__


class _SGLangUnpickler(pickle.Unpickler):
    """SGLang's SafeUnpickler's allow-list (utils/common.py:2794-2866: torch., its bucket module); and
    multiprocessing's fd sharing, which a host tensor's handle (this test's; SGLang's are CUDA) needs."""

    ALLOWED = ("torch", "sglang.srt.weight_sync.tensor_bucket", "multiprocessing.resource_sharer")

    def find_class(self, module, name):
        if not any(module == a or module.startswith(a + ".") for a in self.ALLOWED):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")
        if module == _BUCKET.__name__:
            return getattr(_BUCKET, name)
        return super().find_class(module, name)


LATE = 0.3  # the stand-in frees its memory this long after answering


class StandIn:
    """One server of ``flavor``: requests recorded as (method, path, query, body)."""

    def __init__(self, flavor: str, *, late: float = LATE, token: str | None = None) -> None:
        self.flavor, self.late, self.token = flavor, late, token
        self.requests: list[tuple[str, str, dict, object]] = []
        self.kv: Region | None = None
        self.free_memory = True  # False: never gives its memory back (a stuck server)
        self.gen_s = 0.0  # how long a generation takes
        self.released: set[str] = set()  # vLLM's: the tags asleep; SGLang's: its offload_tags
        self.abort_next = False  # the next completions come back aborted
        # SGLang's: its server args, the generations running, why its scheduler died (None: alive), the
        # weights its last update loaded
        self.args = {"enable_memory_saver": True, "enable_weights_cpu_backup": True, "tp_size": 2}
        self.running = 0
        self.dead: str | None = None
        self.loaded: dict[str, torch.Tensor] = {}
        outer = self

        class Handler(JSONHandler):
            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def _route(self, method: str) -> None:
                u = urlparse(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                if outer.token and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._answer(401, {"error": "unauthorized"})
                outer.requests.append((method, u.path, parse_qs(u.query), body))
                code, out = outer.route(method, u.path, parse_qs(u.query), body)
                if code is None:  # a server that died: the connection closes without an answer
                    self.close_connection = True
                    return
                self._answer(code, out)

        if flavor == "sglang":  # it starts with its memory taken, and says nothing of it
            self._take()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take(self) -> None:
        if self.kv is None:
            self.kv = Region(32 * MiB, "cpu", shareable=True, name="standin-kv")
            self.kv.empty(self.kv.nbytes, torch.uint8).fill_(1)

    def _let_go(self) -> None:
        kv, self.kv = self.kv, None
        if kv is not None and self.free_memory:
            threading.Timer(self.late, kv.close).start()

    def route(self, method, path, query, body):
        f = self.flavor
        gen = [f"{p}!" for p in (body or {}).get({"sglang": "text", "rlmem": "prompts"}.get(f, "prompt"), [])]
        if f == "vllm":
            # As vLLM 0.32's dev endpoints (vllm/entrypoints/serve/dev/sleep/api_router.py): it starts awake,
            # sleeps by tag, and is sleeping while any tag is released.
            if (method, path) == ("POST", "/sleep"):
                if query.get("level") not in (["1"], ["2"]):
                    return 400, {"error": "level must be 1 or 2"}
                self.released = {"weights", "kv_cache"}
                self._let_go()
                return 200, {"status": "sleeping", "level": int(query["level"][0])}
            if (method, path) == ("POST", "/wake_up"):
                self.released -= set(query.get("tags") or self.released)
                self._take()
                return 200, {"status": "sleeping" if self.released else "awake"}
            if (method, path) == ("GET", "/is_sleeping"):
                return 200, {"is_sleeping": bool(self.released)}
            if (method, path) == ("GET", "/v1/models"):
                return 200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
            if (method, path) == ("POST", "/v1/completions"):
                if body.get("model") != "tiny":
                    return 404, {"error": f"model {body.get('model')!r} not found"}
                # a sleep with mode="abort" (vLLM's default) ends what runs with finish_reason "abort"
                reason = "abort" if self.abort_next else "length"
                self.abort_next = False
                choices = [{"index": i, "text": t[:1], "finish_reason": reason} for i, t in enumerate(gen)]
                if reason == "length":
                    choices = [{**c, "text": t} for c, t in zip(choices, gen, strict=True)]
                return 200, {"object": "text_completion", "choices": choices[::-1]}
        if f == "sglang":
            return self._sglang(method, path, query, body)
        if f == "rlmem":
            if (method, path) == ("POST", "/sleep"):
                self._let_go()
                return 200, {"level": body["level"]}
            if (method, path) == ("POST", "/wake"):
                self._take()
                return 200, {}
            if (method, path) == ("POST", "/generate"):
                return 200, {"completions": gen}
            if (method, path) == ("GET", "/health"):
                return 200, {"sleeping": self.kv is None}
        if path == "/health":
            return 200, {}
        return 404, {"error": f"no {method} {path}"}

    def _sglang(self, method, path, query, body):
        """As SGLang's server code behaves (sglang main cf7923615; paths under python/sglang/srt). A
        scheduler that dies takes the whole server with it: no answer, then none to anything."""
        if self.dead:
            return None, None
        die = self._sglang_die

        if path == "/server_info":  # http_server.py:771-806: the server args as top-level keys
            return 200, dict(self.args)
        if path == "/release_memory_occupation":
            # weight_updater.py:203-205: assert self.is_fully_idle(); null or [] means every tag (209-210)
            if self.running:
                return die("release_memory_occupation while requests run (assert is_fully_idle)")
            self.released |= set((body or {}).get("tags") or ("kv_cache", "weights", "cuda_graph"))
            if "kv_cache" in self.released:
                self._let_go()
            return 200, None  # http_server.py:1468-1471: the handler returns nothing
        if path == "/resume_memory_occupation":
            for tag in (body or {}).get("tags") or ("kv_cache", "weights", "cuda_graph"):
                if tag not in self.released:  # weight_updater.py:254-255: offload_tags.remove(tag)
                    return die(f"KeyError {tag!r} resuming a tag not released")
                self.released.remove(tag)
            self._take()
            return 200, None
        if path in ("/health", "/generate") and self.released & {"kv_cache", "weights"}:
            # /health generates a token by default (http_server.py:646-720): over unmapped memory
            return die(f"{path} ran over released memory")
        if path == "/health":
            return 200, None
        if path == "/generate":
            params = body.get("sampling_params") or {}
            unknown = (
                set(params) - _sglang.SAMPLING_KEYS
            )  # SamplingParams(**kwargs), tokenizer_manager.py:1339
            if unknown:
                return 500, {"error": f"unexpected keyword argument {sorted(unknown)[0]!r}"}
            n = int(params.get("n", 1))
            self.running += 1
            try:
                time.sleep(self.gen_s)
                reason = {"type": "abort", "message": "aborted"} if self.abort_next else {"type": "length"}
                self.abort_next = False
                rows = []
                for p in body.get("input_ids") or body.get("text") or []:
                    for k in range(n):  # prompt-major (tokenizer_manager.py:1850-1870)
                        done = {"meta_info": {"finish_reason": reason}}
                        if "input_ids" in body:
                            rows.append({**done, "output_ids": [*p, 100 + k], "text": ""})
                        else:
                            rows.append({**done, "text": f"{p}!" + "*" * k, "output_ids": []})
                return 200, rows
            finally:
                self.running -= 1
        if path == "/flush_cache":  # http_server.py:946-961: 400 unless idle within ?timeout=
            deadline = time.monotonic() + float((query.get("timeout") or ["0"])[0])
            while self.running and time.monotonic() < deadline:
                time.sleep(0.01)
            return (400, "Timed out waiting for idle state.") if self.running else (200, "Cache flushed.")
        if path == "/update_weights_from_tensor":
            return self._sglang_update(body)
        return 404, {"error": f"no {method} {path}"}

    def _sglang_update(self, body):
        """What SGLang reads of a flattened_bucket update (tp_worker.py:198-209: each rank its entry;
        utils/common.py:2744-2866: base64, a ForkingPickler dump unpickled with an allow-list;
        weight_sync/tensor_bucket.py:7-107: byte offsets into one uint8 tensor)."""
        if body.get("load_format") != "flattened_bucket":  # weight_updater.py:344-352: NotImplementedError
            return self._sglang_die(f"load_format {body.get('load_format')!r}")
        entries = body["serialized_named_tensors"]
        if len(entries) < self.args["tp_size"]:
            return self._sglang_die("IndexError: a tensor-parallel rank without its entry")
        for rank in range(self.args["tp_size"]):
            obj = _SGLangUnpickler(io.BytesIO(base64.b64decode(entries[rank], validate=True))).load()
            flat = obj["flattened_tensor"]
            for m in obj["metadata"]:
                self.loaded[m.name] = flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape).clone()
        return 200, {"success": True, "message": "Success"}

    def _sglang_die(self, why: str):
        # scheduler.py:4957-4960: SIGQUIT to its parent, whose handler kills the server's process tree
        # (tokenizer_manager.py:3753-3762): the request gets no answer, and nothing after it does
        self.dead = why
        return None, None

    def close(self) -> None:
        self.server.shutdown()
        if self.kv is not None:
            self.kv.close()


@pytest.fixture
def standin(request):
    servers: list[StandIn] = []

    def make(flavor: str, **kw) -> StandIn:
        servers.append(StandIn(flavor, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.mark.parametrize("flavor", ["rlmem", "vllm", "sglang"])
def test_each_flavor_speaks_its_servers_endpoints(flavor, standin):
    srv = standin(flavor)
    eng = RemoteEngine(srv.url, flavor, device="cpu", timeout=20)
    assert eng.health()
    eng.wake(["weights"])
    eng.wake(["kv_cache"])
    assert eng.generate(["a", "b", "c"], max_new_tokens=4) == ["a!", "b!", "c!"]
    for level in (2, 1):
        t0 = time.monotonic()
        eng.sleep(level)  # the answer comes before the memory is free: the release counts once it is
        # (SGLang's first: this engine never woke it, so it has no measure of what to wait for)
        if flavor != "sglang" or level == 1:
            assert time.monotonic() - t0 >= LATE * 0.9 and eng.last_fence["free_rise_bytes"] >= 24 * MiB
        if level == 2:
            if flavor == "sglang":  # that release still going on would count in the next one
                time.sleep(LATE * 1.5)
            eng.wake()
    sent = [(m, p, q, b) for m, p, q, b in srv.requests if p not in ("/health", "/v1/models")]
    shapes = {
        "vllm": [
            ("POST", "/wake_up", {"tags": ["weights"]}, None),
            ("POST", "/wake_up", {"tags": ["kv_cache"]}, None),
            ("GET", "/is_sleeping", {}, None),  # a sleeping vLLM would queue the request, not refuse it
            (
                "POST",
                "/v1/completions",
                {},
                {"max_tokens": 4, "temperature": 0.0, "prompt": ["a", "b", "c"], "model": "tiny"},
            ),
            ("POST", "/sleep", {"level": ["2"], "mode": ["wait"]}, None),  # not "abort": they finish
            ("POST", "/wake_up", {}, None),
            ("POST", "/sleep", {"level": ["1"], "mode": ["wait"]}, None),
        ],
        "sglang": [
            # nothing to resume on a server this engine has not released: SGLang's scheduler would die
            (
                "POST",
                "/generate",
                {},
                {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
            ),
            ("GET", "/server_info", {}, None),  # whether it gives memory back, and keeps the weights
            ("POST", "/flush_cache", {"timeout": ["20.0"]}, None),  # idle, or no release
            ("POST", "/release_memory_occupation", {}, {"tags": ["kv_cache", "weights", "cuda_graph"]}),
            ("POST", "/resume_memory_occupation", {}, {"tags": ["kv_cache", "weights", "cuda_graph"]}),
            ("POST", "/flush_cache", {"timeout": ["20.0"]}, None),
            ("POST", "/release_memory_occupation", {}, {"tags": ["kv_cache", "weights", "cuda_graph"]}),
        ],
        "rlmem": [
            ("POST", "/wake", {}, {"tags": ["weights"]}),
            ("POST", "/wake", {}, {"tags": ["kv_cache"]}),
            ("POST", "/generate", {}, {"prompts": ["a", "b", "c"], "max_new_tokens": 4, "temperature": 0.0}),
            ("POST", "/sleep", {}, {"level": 2}),
            ("POST", "/wake", {}, {"tags": None}),
            ("POST", "/sleep", {}, {"level": 1}),
        ],
    }
    assert sent == shapes[flavor]
    eng.close()


def test_errors_are_clear(standin):
    srv = standin("vllm", token="s3cret")
    with pytest.raises(RemoteError, match="401"):
        RemoteEngine(srv.url, "vllm").wake()
    eng = RemoteEngine(srv.url, "vllm", token="s3cret", device="cpu", timeout=1)
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        eng.sleep(3)
    with pytest.raises(ValueError, match="unknown tag"):
        eng.wake(["cuda_graph_x"])
    with pytest.raises(RemoteError, match=r"404.*not found"):
        RemoteEngine(srv.url, "vllm", token="s3cret", model="other").generate(["x"])
    srv.abort_next = True  # cut short by the server: raised, never returned as completions
    with pytest.raises(RemoteError, match="2 of 2 completions came back aborted"):
        eng.generate(["xy", "zw"])
    # A server that never gives its memory back: the release does not count, and says so.
    eng.wake()
    srv.free_memory = False
    with pytest.raises(FenceError, match=r"rose 0\.00 GiB of the 0\.03 GiB"):
        eng.sleep(1)
    for bad in ({"url": "127.0.0.1:1"}, {"flavor": "trt"}, {"timeout": 0}):
        kw = {"url": srv.url, "flavor": "vllm", **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            RemoteEngine(kw.pop("url"), **kw)
    with pytest.raises(ConnectionError):
        RemoteEngine("http://127.0.0.1:9", "rlmem", timeout=2).wake()


def test_no_call_of_the_sglang_engine_kills_its_server(standin):
    srv = standin("sglang")
    eng = RemoteEngine(srv.url, "sglang", timeout=5)
    sent = lambda: [(p, b) for _, p, _, b in srv.requests]  # noqa: E731
    eng.wake()  # awake: a resume of a tag not released would kill it, so nothing is sent
    eng.wake(["weights"])
    assert sent() == [] and not eng.is_sleeping()
    eng.sleep(2)
    assert srv.released == {"kv_cache", "weights", "cuda_graph"} and eng.is_sleeping()
    eng.sleep(2)  # released already: nothing more to release
    with pytest.raises(RemoteError, match=r"released .* wake it before generating"):
        eng.generate(["a"])  # its scheduler would run over released memory
    assert eng.health() and eng.health_info() == {"status": "ok"}  # not /health: it would generate
    eng.wake(["weights"])
    eng.wake()  # after a partial wake: only what is still released
    assert sent()[-2:] == [
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
    ]
    eng.sleep(2)
    eng.wake(["kv_cache"])  # its CUDA graphs come with the cache
    assert sent()[-1] == ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    eng.wake(["weights"])
    assert not srv.released and not eng.is_sleeping()
    # A sleep waits for this engine's generations to end (a release while they run kills the server)
    srv.gen_s = 0.4
    out: list = []
    t = threading.Thread(target=lambda: out.append(eng.generate(["x", "y"], n=2, seed=3)))
    t.start()
    time.sleep(0.1)
    eng.sleep(1)
    t.join(5)
    assert out == [[["x!", "x!*"], ["y!", "y!*"]]] and srv.released
    body = next(b for _, p, _, b in reversed(srv.requests) if p == "/generate")
    assert body["sampling_params"]["sampling_seed"] == 3 and "seed" not in body["sampling_params"]
    eng.wake()
    # Another client's request running: the flush before the release times out, and nothing is released
    busy = RemoteEngine(srv.url, "sglang", timeout=5)
    srv.gen_s = 1.5
    t = threading.Thread(target=lambda: busy.generate(["z"]))
    t.start()
    time.sleep(0.1)
    eng.timeout = 0.3
    with pytest.raises(RemoteError, match=r"400.*idle"):
        eng.sleep(1)
    t.join(5)
    assert not srv.released and srv.dead is None
    srv.gen_s, eng.timeout = 0.0, 5.0
    # token ids give token ids back; a completion cut short raises; a key SGLang does not take is refused
    assert eng.generate([[5, 6], [7]], max_new_tokens=1) == [[5, 6, 100], [7, 100]]
    srv.abort_next = True
    with pytest.raises(RemoteError, match="1 of 1 completions came back aborted"):
        eng.generate(["a"])
    with pytest.raises(ValueError, match="'best_of' is not one SGLang takes"):
        eng.generate(["a"], best_of=2)
    assert srv.dead is None


def test_sglang_levels_follow_what_the_server_backs_up(standin):
    srv = standin("sglang")
    srv.args["enable_weights_cpu_backup"] = False
    eng = RemoteEngine(srv.url, "sglang", timeout=5)
    with pytest.raises(ValueError, match="--enable-weights-cpu-backup"):
        eng.sleep(1)  # level 1 keeps the weights, which this server would discard
    eng.sleep(2)
    assert srv.released == {"kv_cache", "weights", "cuda_graph"}
    srv2 = standin("sglang")
    srv2.args["enable_memory_saver"] = False
    with pytest.raises(ValueError, match="--enable-memory-saver"):
        RemoteEngine(srv2.url, "sglang").sleep(2)
    assert not srv2.released and srv.dead is None and srv2.dead is None


def test_sglang_weights_go_in_its_flattened_bucket_format(standin):
    srv = standin("sglang")
    eng = RemoteEngine(srv.url, "sglang", timeout=10)
    g = torch.Generator().manual_seed(0)
    named = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(3, 4, generator=g, dtype=torch.float64),
    }
    assert eng.update_weights_from_tensor(named) == {"success": True, "message": "Success"}
    body = next(b for _, p, _, b in srv.requests if p == "/update_weights_from_tensor")
    assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 2  # tp_size
    assert set(srv.loaded) == set(named)
    for k, v in named.items():
        got = srv.loaded[k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v)
    assert "sglang.srt.weight_sync.tensor_bucket" not in sys.modules  # nothing of SGLang's name left behind
    eng.sleep(2)
    with pytest.raises(ValueError, match="weights are released"):
        eng.update_weights_from_tensor(named)
    assert srv.dead is None


def test_update_weights_is_vllms_and_takes_shared_weights(standin):
    srv = standin("sglang")
    with pytest.raises(ValueError, match="update_weights: the vllm flavor"):
        RemoteEngine(srv.url, "sglang").update_weights(None)
    eng = RemoteEngine(standin("vllm").url, "vllm")
    with pytest.raises(ValueError, match="weights must be a SharedWeights, got dict"):
        eng.update_weights({"w": torch.zeros(2)})
    from torch import nn

    from rlmem.colocate import SharedWeights

    shared = SharedWeights(nn.Linear(4, 4), torch.bfloat16)  # on the host here
    with pytest.raises(ValueError, match="backend must be one of 'rlmem', 'ipc'"):
        eng.update_weights(shared, backend="nccl")
    with pytest.raises(
        ValueError, match="backend 'ipc': CUDA IPC needs the weights on one GPU, they are on cpu"
    ):
        eng.update_weights(shared, backend="ipc")
    assert not [p for _, p, _, _ in srv.requests if "weight" in p]  # refused before any call
    shared.close()
