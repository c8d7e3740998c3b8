"""RemoteEngine against stand-in servers speaking exactly the documented request shapes of vLLM's dev
endpoints (``/sleep?level``, ``/wake_up?tags``, ``/is_sleeping``, ``/v1/completions``), SGLang's
(``/release_memory_occupation``, ``/resume_memory_occupation`` with ``{"tags"}``, ``/generate`` with
``{"text", "sampling_params"}``, ``/flush_cache``) and rlmem's. The real vLLM and SGLang servers were not run
(they cannot run on the machines this project has). A stand-in holds shared memory while awake and lets it
go only after it has answered ``sleep``, so the fence is seen to wait for the memory, not the answer."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import torch

from rlmem import Region
from rlmem.colocate import FenceError, RemoteError
from rlmem.colocate.remote import RemoteEngine

MiB = 1 << 20
LATE = 0.3  # the stand-in frees its memory this long after answering


class StandIn:
    """One server of ``flavor``: requests recorded as (method, path, query, body)."""

    def __init__(self, flavor: str, *, late: float = LATE, token: str | None = None) -> None:
        self.flavor, self.late, self.token = flavor, late, token
        self.requests: list[tuple[str, str, dict, object]] = []
        self.kv: Region | None = None
        self.free_memory = True  # False: never gives its memory back (a stuck server)
        self.released: set[str] = set()  # vLLM's: the tags asleep
        self.abort_next = False  # vLLM's: the next completions come back aborted
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _answer(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
                self._answer(code, out)

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
            if (method, path) == ("POST", "/release_memory_occupation"):
                self._let_go()
                return 200, {"success": True}
            if (method, path) == ("POST", "/resume_memory_occupation"):
                self._take()
                return 200, {"success": True}
            if (method, path) == ("POST", "/generate"):
                return 200, [{"text": t, "meta_info": {}} for t in gen]
            if (method, path) == ("POST", "/flush_cache"):
                return 200, {}
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
        assert time.monotonic() - t0 >= LATE * 0.9 and eng.last_fence["free_rise_bytes"] >= 24 * MiB
        if level == 2:
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
            ("POST", "/resume_memory_occupation", {}, {"tags": ["weights"]}),
            ("POST", "/resume_memory_occupation", {}, {"tags": ["kv_cache"]}),
            (
                "POST",
                "/generate",
                {},
                {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}},
            ),
            ("POST", "/release_memory_occupation", {}, {"tags": None}),
            ("POST", "/resume_memory_occupation", {}, {"tags": None}),
            ("POST", "/release_memory_occupation", {}, {"tags": None}),
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
