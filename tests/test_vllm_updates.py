"""Weight updates into the real vLLM server through rlmem's backend, compared with transformers: vLLM's CPU
build (``tests/_vllm_server.py``) serving, in fp32 (``--dtype float32``: its greedy tokens then equal
transformers'), a tied-embedding Qwen3, an untied Llama and a Qwen3-MoE, each made here.

For each model: greedy generation equals transformers' on the same weights; after training steps an update
(verified on the server) makes it equal transformers' on the new weights; every bad update (a larger
weight, a transposed one, a partial set, an unknown name, a tied head that differs from its embedding) is
refused, naming the parameter, with nothing loaded: the server generates what it did before and the next
good update loads; and an update sent while another client generates waits for that client's requests,
which finish on the old weights, unharmed. Skipped, saying why, only where the venv cannot be made.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

import torch  # noqa: E402
from _helpers import in_thread, read_text  # noqa: E402
from _vllm_server import Server, venv, with_rlmem  # noqa: E402
from torch import nn  # noqa: E402

from rlmem.benchmarks.assets import model_dir, tokenizer_and_data  # noqa: E402
from rlmem.colocate import RemoteError, SharedWeights  # noqa: E402
from rlmem.rollout.remote import RemoteEngine  # noqa: E402

PROMPTS = ["What is 1+2? Put the answer in \\boxed{}.", "What is 40+2?", "What is 17+25?"]
NEW = 8
# vLLM's CPU attention takes head dimensions from 32 up
HEADS = dict(
    hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=1, head_dim=64
)
MODELS = {
    # tied, as Qwen3-0.6B/1.7B/4B ship
    "qwen3-tied": ("qwen3", dict(HEADS, tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(HEADS, tie_word_embeddings=False)),
    "qwen3-moe": ("qwen3_moe", dict(HEADS, tie_word_embeddings=False)),
}


def _greedy(model, prompt_ids: list[list[int]], n: int = NEW) -> list[list[int]]:
    """transformers' greedy tokens, ``n`` each, EOS not stopping them (vLLM's ``ignore_eos``)."""
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            for _ in range(n):
                nxt = model(x).logits[0, -1].argmax()
                x = torch.cat([x, nxt.view(1, 1)], dim=1)
            out.append(x[0, len(ids) :].tolist())
    return out


def _module(named: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose parameters are ``named`` (dotted names, in order): a weight set of any shape."""
    root = nn.Module()
    for name, t in named.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, nn.Parameter(t.detach().clone(), requires_grad=False))
    return root


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tmp_path_factory):
    """(server, engine, model dir, tokenizer, the prompts' ids) of one of MODELS."""
    python, why = venv()
    if python is None:
        pytest.skip(why)
    why = with_rlmem(python)
    assert not why, why
    family, sizes = MODELS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    tok_dir, _ = tokenizer_and_data(d / "assets", rows=64)
    model = model_dir(family, d / "model", tok_dir, **sizes)
    plugins = d / "plugins"
    plugins.mkdir()
    shutil.copy(Path(__file__).with_name("_vllm_hold.py"), plugins)
    extra = ("--dtype", "float32", "--weight-transfer-config", '{"backend": "rlmem"}')
    extra += ("--logits-processors", "_vllm_hold:Hold")
    # vLLM 0.32 starts its structured-decisions API for Qwen3 by encoding label words, which this tiny
    # tokenizer (trained on sums) cannot: an IndexError at start. Logits as logprobs turn that API off
    # (entrypoints/generate/structured_decisions/strategies.py, select_read_strategy); none is read here.
    extra += ("--logprobs-mode", "raw_logits")
    server = Server(python, model, d / "vllm.log", *extra, path=plugins)
    engine = RemoteEngine(server.url, flavor="vllm", timeout=120.0, control_timeout=60.0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    try:
        yield server, engine, model, ids
    finally:
        engine.close()
        server.close()


def _hf(model: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)


def _gen(engine: RemoteEngine, ids: list[list[int]]) -> list[list[int]]:
    return engine.generate(ids, max_new_tokens=NEW, ignore_eos=True)


def _train(model, ids: list[list[int]], steps: int = 2) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    x = torch.tensor([ids[0] + ids[1][: len(ids[0])]])
    for _ in range(steps):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def test_generate_and_updates_equal_transformers(served):
    server, engine, path, ids = served
    hf = _hf(path)
    first = _greedy(hf, ids)  # transformers on the weights the server started from
    assert _gen(engine, ids) == first, server.tail()
    _train(hf, ids)
    weights = SharedWeights(hf, device="cpu")
    engine.update_weights(weights, verify=True)
    got = _gen(engine, ids)
    assert got != first  # the steps changed what it samples
    assert set(engine.last_update) >= {"pause_s", "load_s", "verify_s", "seconds"}
    _equal_unless_moe_reload(got, _greedy(hf, ids), path)
    # back to the first weights: the first outputs again (the module's server stays as it began)
    engine.update_weights(SharedWeights(_hf(path), device="cpu"), verify=True)
    _equal_unless_moe_reload(_gen(engine, ids), first, path)


# vLLM 0.32's CPU build prepacks MoE experts in place at load (fused_moe/experts/cpu_moe.py:208-218) and
# its layerwise reload leaves them as loaded, unpacked: the same weights sent back, every one verified equal
# to what its loader writes, compute other logits (0.6975 -> 0.6822 for a first token here; vLLM's
# /weight_checker checksums of w13_weight and w2_weight change). vLLM's, on the CPU only; it stays visible
# here (an expected failure, not a pass) until vLLM's reload processes them.
MOE_RELOAD = "vLLM 0.32 CPU: a reloaded MoE layer's experts are left unpacked"


def _equal_unless_moe_reload(got: list, want: list, path: Path) -> None:
    if got != want and "moe" in path.parent.name:
        pytest.xfail(MOE_RELOAD)
    assert got == want


def _bad_updates(named: dict[str, torch.Tensor], tied: bool) -> dict[str, tuple[dict, dict, str]]:
    """what -> (weights, update_weights' keywords, the refusal's words)."""
    big = dict(named)
    # a dense MLP's down projection, or (transformers 5 holds an MoE's experts fused) all experts' at once
    name = next(n for n in named if n.endswith(("mlp.down_proj.weight", "mlp.experts.down_proj")))
    w = named[name]
    big[name] = torch.cat([w, w[..., :64]], dim=-1)  # wider than the model's: vLLM would narrow it silently
    flipped = dict(named)
    flipped[name] = w.transpose(-1, -2).contiguous()  # transposed: vLLM would raise half way, then replay it
    partial = {n: t for n, t in named.items() if ".layers.1." not in n}
    unknown = dict(named, **{"model.layers.0.mlp.extra.weight": torch.zeros(4, 4)})
    out = {
        "larger": (big, {}, f"was given with shape {list(big[name].shape[-2:])}, the model of the vllm"),
        "transposed": (flipped, {}, f"was given with shape {list(w.transpose(-1, -2).shape[-2:])}"),
        "partial": (partial, {}, "tensors of the model of the vllm server"),
        "unknown": (
            unknown,
            {},
            "'model.layers.0.mlp.extra.weight' is not a tensor of the model of the vllm",
        ),
        "names-unknown": (named, {"names": ["nope.weight"]}, "names: not in the shared weights"),
    }
    if tied:
        odd = dict(named, **{"lm_head.weight": named["model.embed_tokens.weight"] + 1})
        out["tied-differs"] = (odd, {}, "its lm_head is tied to the embedding")
    return out


def test_bad_updates_are_refused_and_the_server_keeps_serving(served):
    server, engine, path, ids = served
    hf = _hf(path)
    engine.update_weights(SharedWeights(hf, device="cpu"))  # the module's server at its first weights
    before = _gen(engine, ids)
    named = {n: p.detach() for n, p in hf.named_parameters()}
    tied = hf.config.tie_word_embeddings
    for what, (weights, kw, words) in _bad_updates(named, tied).items():
        shared = SharedWeights(_module(weights), device="cpu")
        err = ValueError if "names" in kw else RemoteError
        with pytest.raises(err) as e:
            engine.update_weights(shared, **kw)
        assert words in str(e.value), (what, str(e.value)[:2000])
        assert engine.health(), (what, server.tail())
        assert _gen(engine, ids) == before, (what, server.tail())  # nothing loaded, nothing left broken
    # a partial set said to be partial loads: layer 0 new, layer 1 as it was
    _train(hf, ids)
    first = _hf(path)
    mixed = {
        n: (p if ".layers.1." not in n else dict(first.named_parameters())[n])
        for n, p in hf.named_parameters()
    }
    layer0 = {n: p for n, p in hf.named_parameters() if ".layers.1." not in n}
    engine.update_weights(SharedWeights(_module(layer0), device="cpu"), partial=True, verify=True)
    mixed_model = _hf(path)
    mixed_model.load_state_dict({n: t.detach() for n, t in mixed.items()}, strict=False)
    _equal_unless_moe_reload(_gen(engine, ids), _greedy(mixed_model, ids), path)
    # and a whole good update after all of it
    engine.update_weights(SharedWeights(hf, device="cpu"), verify=True)
    _equal_unless_moe_reload(_gen(engine, ids), _greedy(hf, ids), path)
    engine.update_weights(SharedWeights(first, device="cpu"))


def test_an_update_waits_for_another_clients_requests(served, tmp_path):
    # Another client's requests are held in flight (tests/_vllm_hold.py: 0.1 s a step until DIR/go);
    # the update pauses the server with mode=wait: they finish, on the old weights, then it loads.
    server, engine, path, ids = served
    first = _hf(path)
    engine.update_weights(SharedWeights(first, device="cpu"))
    long = dict(max_new_tokens=40, ignore_eos=True)
    full = engine.generate(ids, **long)
    hf = _hf(path)
    _train(hf, ids)
    weights = SharedWeights(hf, device="cpu")
    hold = tmp_path / "hold"
    hold.mkdir()
    other = RemoteEngine(server.url, flavor="vllm", timeout=120.0)
    th, box = in_thread(lambda: other.generate(ids, **long, vllm_xargs={"hold": str(hold)}))
    up = None
    try:
        t0 = time.monotonic()
        while read_text(hold / "running") != str(len(ids)):
            assert time.monotonic() - t0 < 60 and "t" not in box, box
            time.sleep(0.01)
        up, up_box = in_thread(lambda: engine.update_weights(weights, verify=True))
        time.sleep(1.0)
        assert "t" not in up_box, up_box  # waiting for the other client's requests
        (hold / "go").touch()
        th.join(120)
        up.join(120)
    finally:
        (hold / "go").touch()
        th.join(120)
        if up is not None:
            up.join(120)
        other.close()
    assert "error" not in box, box.get("error")  # no 500, nothing aborted
    assert box["out"] == full  # finished on the weights they started on
    assert "error" not in up_box, up_box.get("error")
    assert up_box["t"] >= box["t"] - 0.5
    _equal_unless_moe_reload(_gen(engine, ids), _greedy(hf, ids), path)
    engine.update_weights(SharedWeights(first, device="cpu"))
