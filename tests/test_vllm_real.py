"""``RemoteEngine(flavor="vllm")`` against the real vLLM server: vLLM's CPU build in a venv of its own
(``tests/_vllm_server.py``: made once per machine, ~2 minutes and ~3.5 GB the first time) serving a tiny
Llama made here. On the CPU platform vLLM refuses ``--enable-sleep-mode``, but its dev endpoints
(``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``) answer and keep their states: the
protocol is the real one, the memory is not. Skipped, saying why, only where the venv cannot be made (no
package index, Python < 3.11)."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")
pytest.importorskip("transformers")

from _vllm_server import Server, venv

from rlmem.benchmarks.assets import model_dir, tokenizer_and_data
from rlmem.colocate.remote import RemoteEngine

PROMPTS = ["What is 1+2? Put the answer in \\boxed{}.", "What is 40+2?"]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    python, why = venv()
    if python is None:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("vllm")
    tok, _ = tokenizer_and_data(d / "assets", rows=64)
    # vLLM's CPU attention takes head dimensions from 32 up (the families' tiny models have 16)
    heads = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    model = model_dir("llama", d / "llama", tok, **heads)
    server = Server(python, model, d / "vllm.log")
    engine = RemoteEngine(server.url, flavor="vllm", timeout=60.0)
    try:
        yield server, engine
    finally:
        engine.close()
        server.close()


def test_the_engine_protocol_against_the_real_server(vllm):
    server, engine = vllm
    assert engine.health()
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
