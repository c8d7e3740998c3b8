"""RemoteEngine against stand-in servers speaking exactly the documented request shapes of vLLM's dev
endpoints (``/sleep?level``, ``/wake_up?tags``, ``/is_sleeping``, ``/v1/completions``), SGLang's
(``/release_memory_occupation``, ``/resume_memory_occupation`` with ``{"tags"}``, ``/generate`` with
``{"text", "sampling_params"}``, ``/flush_cache``; SGLang 0.5.23's stand-in is ``_sglang_standin.py``) and
rlmem's. The real vLLM and SGLang servers were not run (they cannot run on the machines this project has).
A stand-in holds shared memory while awake and lets it go only after it has answered ``sleep``, so the
fence is seen to wait for the memory, not the answer."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from _helpers import serve_routes
from _sglang_standin import SGLangStandIn, tiny_model

from rlmem import Region
from rlmem.colocate import FenceError, RemoteError
from rlmem.rollout.remote import RemoteEngine

MiB = 1 << 20


LATE = 0.3  # the stand-in frees its memory this long after answering


class StandIn:
    """One server of ``flavor``: requests recorded as (method, path, query, body)."""

    def __init__(self, flavor: str, *, late: float = LATE, token: str | None = None) -> None:
        self.flavor, self.late, self.token = flavor, late, token
        self.requests: list[tuple[str, str, dict, object]] = []
        self.kv: Region | None = None
        self.free_memory = True  # False: never gives its memory back (a stuck server)
        self.gen_s = 0.0  # how long a generation takes
        self.released: set[str] = set()  # vLLM's: the tags asleep
        self.abort_next = False  # the next completions come back aborted
        self.server, self.url = serve_routes(self)

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
        gen = [f"{p}!" for p in (body or {}).get({"rlmem": "prompts"}.get(f, "prompt"), [])]
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

    def close(self) -> None:
        self.server.shutdown()
        if self.kv is not None:
            self.kv.close()


@pytest.fixture
def standin(request):
    servers: list[StandIn | SGLangStandIn] = []

    def make(flavor: str, **kw) -> StandIn | SGLangStandIn:
        servers.append(SGLangStandIn(**kw) if flavor == "sglang" else StandIn(flavor, **kw))
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
            # nothing to resume on a server this engine has not released (SGLang's scheduler would die):
            # only whether another client paused it, having released what no endpoint says
            ("GET", "/ready", {}, None),
            ("GET", "/ready", {}, None),
            (
                "POST",
                "/generate",
                {},
                {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
            ),
            ("GET", "/server_info", {}, None),  # whether it gives memory back, and keeps the weights
            ("GET", "/ready", {}, None),
            ("POST", "/pause_generation", {}, {"mode": "retract"}),  # others' requests held, none lost
            ("POST", "/flush_cache", {"timeout": ["20.0"]}, None),  # idle, or no release
            ("POST", "/release_memory_occupation", {}, {"tags": ["kv_cache", "weights", "cuda_graph"]}),
            ("POST", "/resume_memory_occupation", {}, {"tags": ["kv_cache", "weights", "cuda_graph"]}),
            ("POST", "/continue_generation", {}, {}),
            ("GET", "/ready", {}, None),
            ("POST", "/pause_generation", {}, {"mode": "retract"}),
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


def test_a_frozen_server_fails_a_control_call_within_its_own_time_out():
    # A server that accepts and never answers (as one stopped with SIGSTOP): each control call raises after
    # control_timeout, not after the generation's timeout (120 s by default); vLLM's sleep, which waits for
    # the generations in flight (mode=wait), after the control time-out and a generation's.
    import socket

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    url = f"http://127.0.0.1:{lst.getsockname()[1]}"
    try:
        eng = RemoteEngine(url, "vllm", timeout=120.0, control_timeout=0.5)
        assert eng.timeout == 120.0 and RemoteEngine(url, "vllm", timeout=5.0).control_timeout == 5.0
        for call in (eng.wake, eng.flush_cache, eng.is_sleeping, eng.health_info):
            t0 = time.monotonic()
            with pytest.raises(ConnectionError, match="timed out"):
                call()
            assert time.monotonic() - t0 < 5.0
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="timed out"):
            RemoteEngine(url, "vllm", timeout=1.0, control_timeout=0.5).sleep(1)
        assert 1.5 <= time.monotonic() - t0 < 6.0
        t0 = time.monotonic()
        assert eng.health() is False and time.monotonic() - t0 < 2.0
        with pytest.raises(ValueError, match="control_timeout must be a positive number"):
            RemoteEngine(url, "vllm", control_timeout=0)
    finally:
        lst.close()


def test_no_call_of_the_sglang_engine_kills_its_server(standin):
    srv = standin("sglang")
    eng = RemoteEngine(srv.url, "sglang", timeout=5)
    sent = lambda: [(p, b) for _, p, _, b in srv.requests]  # noqa: E731
    eng.wake()  # awake: a resume of a tag not released would kill it, so none is sent
    eng.wake(["weights"])
    assert sent() == [("/ready", None)] * 2 and not eng.is_sleeping()  # not paused by another client
    eng.sleep(2)
    assert srv.released == {"kv_cache", "weights", "cuda_graph"} and eng.is_sleeping()
    eng.sleep(2)  # released already: nothing more to release
    with pytest.raises(RemoteError, match=r"released .* wake it before generating"):
        eng.generate(["a"])  # its scheduler would run over released memory
    assert eng.health() and eng.health_info() == {"status": "ok"}  # not /health: it would generate
    eng.wake(["weights"])
    eng.wake()  # after a partial wake: only what is still released, then the requests held may run
    assert sent()[-3:] == [
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
        ("/continue_generation", {}),
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
    # Another client's request running: SGLang's pause moves it back to its queue (none lost), the
    # release finds the scheduler idle, and the request runs again once the wake lets it
    busy = RemoteEngine(srv.url, "sglang", timeout=10)
    srv.gen_s = 0.5
    got: list = []
    t = threading.Thread(target=lambda: got.append(busy.generate(["z"])))
    t.start()
    time.sleep(0.1)
    eng.sleep(1)
    assert srv.released and srv.waiting == 1 and not got
    eng.wake()
    t.join(5)
    assert got == [["z!"]] and not srv.released and srv.dead is None
    srv.gen_s = 0.0
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
    named = tiny_model(seed=1)  # the server's model's names and shapes, new values, in dtypes it casts
    named["model.norm.weight"] = named["model.norm.weight"].float()
    named["lm_head.weight"] = named["lm_head.weight"].double()
    assert eng.update_weights_from_tensor(named) == {"success": True, "message": "Success"}
    body = next(b for _, p, _, b in srv.requests if p == "/update_weights_from_tensor")
    assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 2  # tp_size
    assert set(srv.loaded) == set(named)
    for k, v in named.items():
        got = srv.loaded[k]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v)
        assert torch.equal(srv.model[k], v.to(torch.bfloat16))  # loaded, cast as its loader casts
    assert "sglang.srt.weight_sync.tensor_bucket" not in sys.modules  # nothing of SGLang's name left behind
    eng.sleep(2)
    with pytest.raises(ValueError, match="weights are released"):
        eng.update_weights_from_tensor(named)
    assert srv.dead is None


def test_update_weights_is_vllms_and_takes_shared_weights(standin):
    srv = standin("sglang")
    with pytest.raises(ValueError, match="update_weights: the vllm and sglang flavors, not 'rlmem'"):
        RemoteEngine(standin("rlmem").url, "rlmem").update_weights(None)
    with pytest.raises(ValueError, match="weights must be a SharedWeights"):
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


@pytest.mark.parametrize("flavor", ["rlmem", "vllm", "sglang"])
def test_without_max_new_tokens_each_flavor_sends_the_one_default(flavor, standin):
    from rlmem.rollout.engine import DEFAULT_MAX_NEW_TOKENS

    srv = standin(flavor)
    eng = RemoteEngine(srv.url, flavor, timeout=20)
    eng.generate(["ab"])
    body = [b for m, p, _, b in srv.requests if p in ("/generate", "/v1/completions")][-1]
    if flavor == "rlmem":  # rlmem's server applies the same default, bounded by the room its cache leaves
        assert "max_new_tokens" not in body
    elif flavor == "vllm":
        assert body["max_tokens"] == DEFAULT_MAX_NEW_TOKENS
    else:
        assert body["sampling_params"]["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS
    eng.close()


@pytest.mark.parametrize("flavor", ["rlmem", "vllm", "sglang"])
@pytest.mark.parametrize(
    "kw", [{"temperature": -0.1}, {"temperature": float("inf")}, {"top_p": 0}, {"max_new_tokens": 0}]
)
def test_a_bad_sampling_setting_is_refused_before_any_request(flavor, kw, standin):
    srv = standin(flavor)
    eng = RemoteEngine(srv.url, flavor, timeout=20)
    with pytest.raises(ValueError, match=next(iter(kw))):
        eng.generate(["ab"], **kw)
    assert not [p for _, p, _, _ in srv.requests if p in ("/generate", "/v1/completions")]
    eng.close()


def test_the_flavor_registry_gives_one_class_per_server():
    from rlmem.rollout.remote import FLAVORS, SGLangRemote, VLLMRemote, engine_class

    assert FLAVORS == ("rlmem", "vllm", "sglang")
    assert [engine_class(f).flavor for f in FLAVORS] == list(FLAVORS)
    eng = RemoteEngine("http://127.0.0.1:9", "vllm")
    assert type(eng) is VLLMRemote and isinstance(eng, RemoteEngine)
    assert type(SGLangRemote("http://127.0.0.1:9")) is SGLangRemote
    with pytest.raises(ValueError, match="SGLangRemote speaks 'sglang', not 'vllm'"):
        SGLangRemote("http://127.0.0.1:9", "vllm")
    with pytest.raises(ValueError, match="flavor must be one of rlmem, vllm, sglang, got 'tgi'"):
        RemoteEngine("http://127.0.0.1:9", "tgi")
    with pytest.raises(ValueError, match="stats: the rlmem flavor only, not 'vllm'"):
        eng.stats()
