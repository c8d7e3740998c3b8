"""``rlmem serve`` in a process of its own, driven through :class:`rlmem.RemoteEngine` (rlmem's flavor) on a
Unix socket: generation (text and token ids, greedy identical to the same sampler in this process),
sleep and wake, weight updates by handle (shared memory on the host, CUDA IPC on a GPU), every bad
request a 4xx with a message and the server alive after it (types strict: a bool is not an int, a float
not a count), a request without ``max_new_tokens`` fitting ``max_len``, the token on TCP, SIGTERM ending
it cleanly.
Every process started is killed at the end whatever happens; every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from _helpers import free_port

from rlmem.colocate import RemoteError
from rlmem.models import CharTokenizer, load_model
from rlmem.recipes.config import GRPOConfig
from rlmem.recipes.policy import build_policy
from rlmem.rollout import HFSampler
from rlmem.rollout.remote import RemoteEngine

TOK = CharTokenizer()
MAX_LEN = 48


def _start(argv: list[str], ready: RemoteEngine, proc_list: list) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-m", "rlmem", "serve", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    proc_list.append(p)
    deadline = time.monotonic() + 120
    while not ready.health():
        assert p.poll() is None, p.stdout.read()
        assert time.monotonic() < deadline, "rlmem serve did not answer in 120 s"
        time.sleep(0.1)
    return p


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _local(device: str, seed: int) -> HFSampler:
    # the recipe's policy: `rlmem serve tiny` must sample what `rlmem train`'s own model would
    model = build_policy(
        GRPOConfig(model="tiny", seed=seed), torch.device(device), _dtype(device), 14, MAX_LEN
    )
    return HFSampler(model.eval(), max_len=MAX_LEN, batch_size=16, pad_token_id=0, eos_token_id=2)


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def test_serve_generate_sleep_wake_update_and_bad_requests(device, tmp_path, procs):
    sock = tmp_path / "run" / "serve.sock"
    eng = RemoteEngine(f"unix://{sock}", timeout=60)
    p = _start(["tiny", "--uds", str(sock), "--device", device, "--max-len", str(MAX_LEN)], eng, procs)
    prompts = ["3142=", "90210="]
    ids = [TOK.encode(x, bos=True) for x in prompts]

    # Greedy completions are those of the same sampler over the same weights in this process.
    local = _local(device, 0)
    want = local.generate(ids, max_new_tokens=12, temperature=0.0)
    assert eng.generate(ids, max_new_tokens=12) == want
    assert eng.generate(prompts, max_new_tokens=12) == [TOK.decode(w) for w in want]
    # Seeded sampling is reproducible from one request to the next.
    a = eng.generate(ids, max_new_tokens=12, temperature=1.0, seed=7)
    assert a == eng.generate(ids, max_new_tokens=12, temperature=1.0, seed=7)

    # Asleep it refuses to generate (409), gives its cache back, and after waking answers as before.
    eng.sleep(1)
    assert eng.is_sleeping()
    with pytest.raises(RemoteError, match=r"409.*asleep"):
        eng.generate(ids, max_new_tokens=4)
    assert eng.stats()["memory"]["kv_cache"] == 0
    eng.wake()
    assert not eng.is_sleeping() and eng.stats()["memory"]["kv_cache"] > 0
    assert eng.generate(ids, max_new_tokens=12) == want

    # Weights by handle: after the update it samples as a model of another seed does here.
    other = _local(device, 1)
    got = eng.update_weights_from_tensor(dict(other.model.named_parameters()))
    assert got["updated"] == len(dict(other.model.named_parameters()))
    assert eng.generate(ids, max_new_tokens=12) == other.generate(ids, max_new_tokens=12, temperature=0.0)

    http = httpx.Client(base_url="http://rlmem", transport=httpx.HTTPTransport(uds=str(sock)), timeout=60)
    # Without max_new_tokens: the room the longest prompt leaves within this server's max_len (48, less
    # than the default of 256 a request would otherwise be refused for).
    r = http.post("/generate", json={"input_ids": ids})
    assert r.status_code == 200, r.text
    room = MAX_LEN - max(len(x) for x in ids)
    assert r.json()["output_ids"] == other.generate(ids, max_new_tokens=room, temperature=0.0)

    # Bad requests: a 4xx naming what is wrong; nothing changed; the server keeps serving. Types are
    # strict: a bool is not an int, a float not a count, a string not a number.
    full = [1] + [3] * (MAX_LEN - 1)
    h = {"name": "x", "dtype": "float32", "shape": [2], "stride": [1], "offset": 0, "kind": "shm"}
    bad = [
        ("/generate", {"prompts": ["12="], "bogus": 1}, 422, "bogus"),
        ("/generate", {"input_ids": [[1, 99999]]}, 400, "outside the vocabulary"),
        ("/generate", {"prompts": ["12a="]}, 400, "not in the vocabulary"),
        ("/generate", {"prompts": ["12="], "input_ids": [[1]]}, 400, "exactly one"),
        ("/generate", {"input_ids": [[1, 3]], "max_new_tokens": 500}, 400, "max_len"),
        ("/generate", {"input_ids": [[1, 3]], "top_p": 0}, 422, "top_p"),
        ("/sleep", {"level": 3}, 422, "level"),
        ("/wake", {"tags": ["kv"]}, 422, "tags"),
        ("/update_weights_from_tensor", {"tensors": [{"name": "x"}]}, 400, "dtype"),
        ("/generate", {"input_ids": [full]}, 400, f"{MAX_LEN} tokens leaves no room"),
        ("/generate", {"input_ids": [full]}, 400, f"max_len={MAX_LEN}"),
        ("/generate", {"input_ids": [[1, 3]], "max_new_tokens": 3.0}, 422, "max_new_tokens"),
        ("/generate", {"input_ids": [[1, 3]], "max_new_tokens": True}, 422, "max_new_tokens"),
        ("/generate", {"input_ids": [[1, 3]], "max_new_tokens": "3"}, 422, "max_new_tokens"),
        ("/generate", {"input_ids": [[1, True]]}, 422, "input_ids"),
        ("/generate", {"input_ids": [[1, 3.0]]}, 422, "input_ids"),
        ("/generate", {"prompts": [12]}, 422, "prompts"),
        ("/generate", {"input_ids": [[1, 3]], "temperature": True}, 422, "temperature"),
        ("/generate", {"input_ids": [[1, 3]], "temperature": "1"}, 422, "temperature"),
        ("/generate", {"input_ids": [[1, 3]], "top_p": True}, 422, "top_p"),
        ("/generate", {"input_ids": [[1, 3]], "seed": 7.0}, 422, "seed"),
        ("/generate", {"input_ids": [[1, 3]], "seed": True}, 422, "seed"),
        ("/generate", {"input_ids": [[1, 3]], "seed": 2**64}, 422, "seed"),
        ("/sleep", {"level": True}, 422, "level"),
        ("/sleep", {"level": 1.0}, 422, "level"),
        ("/sleep", {"level": "1"}, 422, "level"),
        ("/wake", {"tags": "weights"}, 422, "tags"),
        ("/update_weights_from_tensor", {"tensors": [{**h, "shape": [True]}]}, 422, "shape"),
        ("/update_weights_from_tensor", {"tensors": [{**h, "offset": 0.0}]}, 422, "offset"),
        ("/update_weights_from_tensor", {"tensors": [{**h, "storage_bytes": 8.0}]}, 422, "storage_bytes"),
        ("/flush_cache", {"bogus": 1}, 422, "bogus"),
    ]
    for path, body, code, words in bad:
        r = http.post(path, json=body)
        assert r.status_code == code, (path, body, r.text)
        assert words in r.text, (path, r.text)
        assert eng.health() and not eng.is_sleeping(), (path, body)
    # Well-typed requests that pydantic's lax mode would also take still do: an int temperature, a
    # flush with no body or an empty one.
    assert eng.generate(ids, max_new_tokens=12, temperature=1, seed=7) == eng.generate(
        ids, max_new_tokens=12, temperature=1.0, seed=7
    )
    assert http.post("/flush_cache").json() == {"flushed": True}
    assert http.post("/flush_cache", json={}).json() == {"flushed": True}
    wrong = {"model.no_such.weight": torch.zeros(2, device=device)}
    with pytest.raises(RemoteError, match=r"400.*no weight named"):
        eng.update_weights_from_tensor(wrong)
    first = next(iter(other.model.named_parameters()))
    with pytest.raises(RemoteError, match=r"400.*shape"):
        eng.update_weights_from_tensor({first[0]: torch.zeros(3, device=device)})
    assert eng.generate(ids, max_new_tokens=12) == other.generate(ids, max_new_tokens=12, temperature=0.0)
    assert eng.health()

    # SIGTERM: a graceful stop, the socket removed.
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    assert "stopped" in p.stdout.read()
    assert not sock.exists()


def test_serve_default_max_new_tokens_fits_max_len(device, monkeypatch):
    """Without ``max_new_tokens`` a request gets the room its longest prompt leaves within ``max_len``, at
    most the one default (256, ``rollout.engine.generation_length``), and a 400 naming the prompt's length
    and ``max_len`` when there is none (the app in this process: what the sampler is asked for is the
    point, and an EOS would hide it in the answer)."""
    from fastapi.testclient import TestClient

    from rlmem.rollout.engine import DEFAULT_MAX_NEW_TOKENS
    from rlmem.serve.app import make_app
    from rlmem.serve.core import ServedModel

    max_len = DEFAULT_MAX_NEW_TOKENS + 40
    model = load_model("tiny", torch.device(device), _dtype(device), max_len=max_len)
    kw = dict(max_len=max_len, batch_size=4, pad_token_id=0, eos_token_id=2, cuda_graphs="off")
    core = ServedModel(model.eval(), sampler=kw, name="tiny")
    asked: list[int] = []
    real = core.sampler.generate

    def spy(prompts, **kw):
        asked.append(kw["max_new_tokens"])
        return real(prompts, **kw)

    monkeypatch.setattr(core.sampler, "generate", spy)
    try:
        http = TestClient(make_app(core))
        for lengths, want in [
            ([6, 3], DEFAULT_MAX_NEW_TOKENS),  # room for more: capped at the one default
            ([60, 3], max_len - 60),  # the longest prompt leaves less
            ([max_len - 1], 1),
        ]:
            r = http.post("/generate", json={"input_ids": [[1] * n for n in lengths]})
            assert r.status_code == 200, r.text
            assert asked[-1] == want and all(len(o) <= want for o in r.json()["output_ids"])
        r = http.post("/generate", json={"input_ids": [[1] * 6], "max_new_tokens": 5})
        assert r.status_code == 200 and asked[-1] == 5
        r = http.post("/generate", json={"input_ids": [[1] * 3, [1] * max_len]})
        assert r.status_code == 400 and f"{max_len} tokens" in r.text and f"max_len={max_len}" in r.text
        assert len(asked) == 4  # refused before sampling
        assert http.get("/health").json()["ready"]
    finally:
        core.close()


def test_serve_on_tcp_needs_its_token(tmp_path, procs):
    port = free_port()
    eng = RemoteEngine(f"http://127.0.0.1:{port}", token="s3cret", timeout=60)
    _start(["tiny", "--device", "cpu", "--port", str(port), "--token", "s3cret"], eng, procs)
    assert eng.generate(["12="], max_new_tokens=2)
    r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"prompts": ["12="]}, timeout=30)
    assert r.status_code == 401 and "token" in r.text
    r = httpx.post(
        f"http://127.0.0.1:{port}/sleep",
        json={"level": 1},
        headers={"Authorization": "Bearer nope"},
        timeout=30,
    )
    assert r.status_code == 401
    assert not eng.is_sleeping()


def test_serve_refuses_bad_arguments(tmp_path, capsys):
    # In this process: each refusal comes before anything is loaded, bound or started (as the command line's)
    from rlmem.serve.main import main

    def run(*argv: str) -> tuple[int, str]:
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        return e.value.code, capsys.readouterr().err

    code, err = run("tiny", "--host", "0.0.0.0", "--device", "cpu")
    assert code == 2 and "--token" in err
    sock = str(tmp_path / "a" / "s")
    code, err = run(str(tmp_path), "--weights", "shared", "--device", "cpu", "--uds", sock)
    assert code == 2 and "config.json" in err
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    code, err = run("tiny", "--device", "cpu", "--uds", str(open_dir / "s.sock"))
    assert code == 2 and "other users" in err
    code, err = run("tiny", "--device", "cpu", "--batch-size", "0")
    assert code == 2 and "--batch-size" in err


@pytest.mark.gpus(2)
def test_serve_on_a_second_gpu_opens_no_context_on_the_first(tmp_path, procs):
    # A server per GPU (engine=server under torchrun) must hold memory on its own GPU only: a context it
    # opened on GPU 0 as well costs GPU 0 some 500 MiB per other server. NVML lists each process's contexts.
    import shutil

    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not here to list the processes on each GPU")
    sock = tmp_path / "run" / "serve.sock"
    eng = RemoteEngine(f"unix://{sock}", timeout=60)
    p = _start(["tiny", "--uds", str(sock), "--device", "cuda:1", "--max-len", str(MAX_LEN)], eng, procs)
    assert len(eng.generate([TOK.encode("3142=", bos=True)], max_new_tokens=12)[0]) > 0
    eng.sleep(1)  # the cache given back and taken again: the paths that allocate after loading
    eng.wake()

    def smi(*query: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True, text=True)
        return [[x.strip() for x in line.split(",")] for line in out.stdout.splitlines() if line.strip()]

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    uuids = dict(smi("--query-gpu=index,uuid"))
    names = visible.split(",")[:2] if visible else ["0", "1"]
    first, second = (uuids.get(n, n) for n in names)
    on = {uuid for pid, uuid in smi("--query-compute-apps=pid,gpu_uuid") if pid == str(p.pid)}
    assert on == {second}, f"rlmem serve --device cuda:1 (pid {p.pid}) holds contexts on {on}"
    assert first not in on

    # A device this process cannot see is refused, naming the argument
    n = torch.cuda.device_count()
    argv = ["tiny", "--device", f"cuda:{n}", "--uds", str(tmp_path / "x")]
    r = subprocess.run(
        [sys.executable, "-m", "rlmem", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and f"--device cuda:{n}" in r.stderr and f"sees {n} CUDA device" in r.stderr


@pytest.mark.parametrize("share", [False, True])
def test_serve_n_completions_per_prompt_come_grouped_and_equal_repeats(share):
    """``n`` per prompt, prompt-major, each prompt's in a row: what the same prompts repeated give (greedy),
    with the prompt held once in the cache (``--share-prompts``) or per row."""
    from fastapi.testclient import TestClient

    from rlmem.serve.app import make_app
    from rlmem.serve.core import ServedModel

    model = load_model("tiny", torch.device("cpu"), torch.float32, max_len=48)
    kw = dict(
        max_len=48, batch_size=8, pad_token_id=0, eos_token_id=2, cuda_graphs="off", share_prompts=share
    )
    core = ServedModel(model.eval(), sampler=kw, name="tiny")
    try:
        http = TestClient(make_app(core))
        ids = [[1, 5, 6, 7], [1, 9, 4]]
        r = http.post("/generate", json={"input_ids": ids, "n": 3, "max_new_tokens": 6})
        assert r.status_code == 200, r.text
        got = r.json()["output_ids"]
        rep = http.post(
            "/generate", json={"input_ids": [x for x in ids for _ in range(3)], "max_new_tokens": 6}
        )
        assert got == rep.json()["output_ids"] and len(got) == 6
        assert got[0] == got[1] == got[2] and got[3] == got[4] == got[5]  # greedy: a group alike
        assert http.post("/generate", json={"input_ids": ids, "n": 0}).status_code == 422
    finally:
        core.close()
