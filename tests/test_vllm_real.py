"""``RemoteEngine(flavor="vllm")`` against the real vLLM server: vLLM's CPU build in a venv of its own
(``tests/_vllm_server.py``: made once per machine, ~2 minutes and ~3.5 GB the first time) serving a tiny
Llama made here. On the CPU platform vLLM refuses ``--enable-sleep-mode``, but its dev endpoints
(``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``) answer and keep their states: the
protocol is the real one, the memory is not. Skipped, saying why, only where the venv cannot be made (no
package index, Python < 3.11)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from _helpers import in_thread, read_text  # noqa: E402
from _vllm_server import Server, venv, with_rlmem  # noqa: E402

from rlmem.benchmarks.assets import model_dir, tokenizer_and_data  # noqa: E402
from rlmem.colocate import RemoteError  # noqa: E402
from rlmem.rollout.remote import RemoteEngine  # noqa: E402

PROMPTS = ["What is 1+2? Put the answer in \\boxed{}.", "What is 40+2?"]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """(server, engine, tokenizer); the server takes weights through rlmem's backend too (rlmem installed in
    its venv), and its model's directory is ``server.model``."""
    python, why = venv()
    if python is None:
        pytest.skip(why)
    why = with_rlmem(python)
    assert not why, why  # on a machine that made the venv, installing rlmem there must work
    d = tmp_path_factory.mktemp("vllm")
    tok, _ = tokenizer_and_data(d / "assets", rows=64)
    # vLLM's CPU attention takes head dimensions from 32 up (the families' tiny models have 16)
    heads = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    model = model_dir("llama", d / "llama", tok, **heads)
    # _vllm_hold.Hold in a folder of its own on the server's path: it holds a generation in flight on request
    plugins = d / "plugins"
    plugins.mkdir()
    shutil.copy(Path(__file__).with_name("_vllm_hold.py"), plugins)
    extra = ("--weight-transfer-config", '{"backend": "rlmem"}', "--logits-processors", "_vllm_hold:Hold")
    server = Server(python, model, d / "vllm.log", *extra, path=plugins)
    server.model, server.python = model, python
    engine = RemoteEngine(server.url, flavor="vllm", timeout=60.0)
    from transformers import AutoTokenizer

    try:
        yield server, engine, AutoTokenizer.from_pretrained(str(model))
    finally:
        engine.close()
        server.close()


def test_the_engine_protocol_against_the_real_server(vllm):
    server, engine, _ = vllm
    assert engine.health() and engine.health_info() == {"status": "ok"}  # 200, no body
    first = engine.generate(PROMPTS, max_new_tokens=8)
    assert len(first) == 2 and all(isinstance(t, str) for t in first), server.tail()
    assert engine.is_sleeping() is False
    engine.sleep(1)
    assert engine.is_sleeping() is True
    engine.wake(["weights"])
    assert engine.is_sleeping() is True  # the KV cache still released
    engine.wake(["kv_cache"])
    assert engine.is_sleeping() is False
    engine.flush_cache()  # idle: the server flushes
    # greedy, and (on the CPU) the weights never left: the same completions as before the sleep
    assert engine.generate(PROMPTS, max_new_tokens=8) == first


LONG = dict(max_new_tokens=200, ignore_eos=True)  # vLLM's: no early end, 200 tokens each
# what vLLM's engine core logs when a sleep finds requests running and waits for them
WAITED = "Waiting for in-flight requests to complete before sleeping"


def _until(what, timeout: float, why: str) -> None:
    t0 = time.monotonic()
    while not what():
        assert time.monotonic() - t0 < timeout, why
        time.sleep(0.01)


def test_a_sleep_lets_the_generations_in_flight_finish(vllm, tmp_path):
    # vLLM's /sleep aborts what runs unless told otherwise: the completions came back cut short, as text.
    # The generations in flight are another client's: the sleeping engine waits for its own generate calls
    # before it sends /sleep, so only another's can still run on the server when the sleep reaches it. They
    # are held in flight (_vllm_hold: each of their steps takes 0.1 s, their 200 tokens 20 s) until the
    # server's log says the sleep found them running; then they go on at full speed.
    server, engine, _ = vllm
    full = engine.generate(PROMPTS, **LONG)
    hold = tmp_path / "hold"
    hold.mkdir()

    def waits() -> int:  # the sleeps that found requests running, so far
        return server.log.read_text(errors="replace").count(WAITED)

    def timed_sleep() -> tuple[float, float]:
        sent = time.monotonic()
        engine.sleep(1)
        return sent, time.monotonic()

    waited = waits()
    other = RemoteEngine(server.url, flavor="vllm", timeout=120.0)
    th, box = in_thread(lambda: other.generate(PROMPTS, **LONG, vllm_xargs={"hold": str(hold)}))
    sleeper = None
    try:
        _until(lambda: read_text(hold / "running") == str(len(PROMPTS)), 60, f"never both running: {box}")
        assert "t" not in box, box  # both running, and held there, as the sleep goes out
        sleeper, slept_box = in_thread(timed_sleep)
        _until(lambda: waits() > waited, 60, f"the sleep never found them running:\n{server.tail()}")
    finally:
        (hold / "go").touch()  # never left held
        if sleeper is not None:
            sleeper.join(120)
        th.join(120)
        other.close()
        engine.wake()
    assert "error" not in slept_box, slept_box.get("error")
    assert "error" not in box, box.get("error")  # none came back aborted
    assert waits() == waited + 1  # the premise, as the server saw it: the sleep found them running
    sent, slept = slept_box["out"]
    assert sent < box["t"] <= slept + 0.5  # in flight when the sleep came, done before it returned
    assert box["out"] == full


def test_generate_on_a_sleeping_server_raises_at_once(vllm):
    # vLLM queues it until a wake (past our time-out, and then it runs)
    _, engine, _ = vllm
    engine.sleep(1)
    t0 = time.monotonic()
    try:
        with pytest.raises(RemoteError, match="is asleep: wake it"):
            engine.generate(PROMPTS, max_new_tokens=4)
        assert time.monotonic() - t0 < 5
    finally:
        engine.wake()
    assert engine.generate(PROMPTS, max_new_tokens=4)


def test_token_id_prompts_and_samples_grouped_per_prompt(vllm):
    _, engine, tok = vllm
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    got = engine.generate(ids, max_new_tokens=8)
    assert all(isinstance(t, int) for c in got for t in c) and all(0 < len(c) <= 8 for c in got)
    assert [tok.decode(c) for c in got] == engine.generate(PROMPTS, max_new_tokens=8)
    groups = engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, n=3, seed=1)
    assert len(groups) == 2 and all(len(g) == 3 and all(isinstance(t, str) for t in g) for g in groups)


def test_weights_through_rlmems_backend_equal_vllm_from_a_checkpoint(vllm, tmp_path):
    # The trainer's SharedWeights mapped by vLLM's worker (rlmem's "rlmem" weight-transfer backend, loaded
    # through vLLM's plugin entry point) after optimizer steps: vLLM's greedy output equals vLLM's own from
    # a checkpoint of the same weights; and the first weights sent back give the first outputs again.
    import torch
    from transformers import AutoModelForCausalLM

    from rlmem import OffloadConfig, PhaseManager
    from rlmem.colocate import SharedWeights

    server, _, tokenizer = vllm
    engine = RemoteEngine(server.url, flavor="vllm", timeout=120.0)
    try:
        before = engine.generate(PROMPTS, max_new_tokens=8)
        model = AutoModelForCausalLM.from_pretrained(str(server.model), dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        batch = tokenizer(["What is 40+2? 42", "What is 1+2? 3"], return_tensors="pt", padding=True)
        weights = SharedWeights(model, device="cpu")
        # As a trainer runs it: the train state offloaded through every rollout, vLLM asleep through every
        # train phase, and at each rollout the frameworks' order (wake the weights, update them from the
        # shared copy, offload the train state, wake the KV cache)
        pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True))
        pm.add_engine(engine)
        for _ in range(3):
            with pm.train():
                model(**batch, labels=batch["input_ids"]).loss.backward()
                opt.step()
                opt.zero_grad()
            with pm.rollout(sync_weights=lambda: engine.update_weights(weights)):
                after = engine.generate(PROMPTS, max_new_tokens=8)
        with pm.train():
            pass
        ckpt = tmp_path / "ckpt"
        model.save_pretrained(str(ckpt))
        tokenizer.save_pretrained(str(ckpt))
        # back to the first weights (the server is the module's): its first outputs again
        engine.wake()
        first = AutoModelForCausalLM.from_pretrained(str(server.model), dtype=torch.float32)
        engine.update_weights(SharedWeights(first, device="cpu"))
        assert engine.generate(PROMPTS, max_new_tokens=8) == before
    finally:
        engine.close()
    ref_server = Server(server.python, ckpt, tmp_path / "vllm-ckpt.log")
    try:
        ref = RemoteEngine(ref_server.url, flavor="vllm", timeout=120.0).generate(PROMPTS, max_new_tokens=8)
    finally:
        ref_server.close()
    assert after != before  # the steps changed what it samples
    assert after == ref, (after, ref, server.tail())
