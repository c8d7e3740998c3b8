"""No call of RemoteEngine(flavor="sglang") reaches a rule under which SGLang 0.5.23's scheduler raises and
the server dies, or loads weights it was not given: against ``_sglang_standin.py``, which answers as
SGLang's code does (each rule quoting its file and line) and dies where it would. SGLang itself cannot
run here (its wheel is CUDA-only)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from _sglang_standin import SGLangStandIn, tiny_model
from safetensors.torch import save_file
from torch import nn

from rlmem.colocate import RemoteError, SharedWeights
from rlmem.colocate.weight_check import read_checkpoint
from rlmem.rollout.remote import RemoteEngine

ALL = {"kv_cache", "weights", "cuda_graph"}


@pytest.fixture
def server():
    made: list[SGLangStandIn] = []

    def make(**kw) -> SGLangStandIn:
        made.append(SGLangStandIn(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def paths(srv: SGLangStandIn, since: int = 0) -> list[str]:
    return [p for _, p, _, _ in srv.requests[since:]]


def wait_until(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def outcome(fn, *args, **kw):
    """What a call returned, or the exception it raised (for calls in another thread)."""
    try:
        return fn(*args, **kw)
    except Exception as e:
        return e


def test_weights_are_loaded_inside_one_session_that_is_always_ended(server):
    srv = server()
    eng = RemoteEngine(srv.url, "sglang", timeout=10)
    new = tiny_model(seed=1)
    # weight_updater.py:232-239: outside a session the update is refused (a later revision asserts, and
    # its scheduler dies): the session is opened first and ended after
    assert eng.update_weights_from_tensor(new) == {"success": True, "message": "Success"}
    assert paths(srv) == [
        "/server_info",
        "/model_info",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
    ]
    assert not srv.session and all(torch.equal(srv.model[n], t) for n, t in new.items())
    # read once: the next update asks nothing but the session and the load
    n = len(srv.requests)
    eng.update_weights_from_tensor(tiny_model(seed=2))
    assert paths(srv, n) == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    # refused by the server: the session is still ended
    srv.derived_cache_error = "derived weights would go stale"
    n = len(srv.requests)
    with pytest.raises(RemoteError, match="derived weights would go stale"):
        eng.update_weights_from_tensor(new)
    assert paths(srv, n)[-1] == "/end_weight_update" and not srv.session
    srv.derived_cache_error = None
    # another client's session is open: refused, and that session is not ended by this engine
    srv.session = True
    n = len(srv.requests)
    with pytest.raises(RemoteError, match="already open"):
        eng.update_weights_from_tensor(new)
    assert paths(srv, n) == ["/begin_weight_update"] and srv.session
    assert srv.dead is None


def test_a_server_without_sessions_or_pause_is_driven_as_before(server):
    # 0.5.10: no /begin_weight_update, /ready nor /continue_generation's pause before it (404s)
    srv = server(sessions=False, ready=False, pause=False)
    eng = RemoteEngine(srv.url, "sglang", timeout=10, control_timeout=0.3)
    eng.update_weights_from_tensor(tiny_model(seed=1))
    eng.update_weights_from_tensor(tiny_model(seed=2))  # the 404 is asked once
    assert paths(srv).count("/begin_weight_update") == 1 and "/end_weight_update" not in paths(srv)
    assert torch.equal(srv.model["model.norm.weight"], tiny_model(seed=2)["model.norm.weight"])
    eng.sleep(2)
    eng.wake()
    assert srv.released == set() and "/continue_generation" not in paths(srv)
    # another client's request running: without a pause the flush says the scheduler is busy, and nothing
    # is released
    busy = RemoteEngine(srv.url, "sglang", timeout=10)
    srv.gen_s = 1.0
    t = threading.Thread(target=busy.generate, args=(["z"],))
    t.start()
    assert wait_until(lambda: srv.running == 1, 2)
    with pytest.raises(RemoteError, match=r"400.*idle"):
        eng.sleep(1)
    t.join(5)
    assert not srv.released and srv.dead is None


def test_bad_updates_are_refused_before_anything_is_sent(server):
    srv = server()
    eng = RemoteEngine(srv.url, "sglang", timeout=10)
    before = {n: t.clone() for n, t in srv.model.items()}
    good = tiny_model(seed=1)
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = [
        # another shape reaches default_weight_loader's assert (weight_utils.py:1582-1585): the server dies
        ({**good, q: torch.zeros(8, 4)}, rf"'{q}' was given with shape \[8, 4\], .* has \[8, 8\]"),
        # a name its model does not have is skipped (qwen3.py:753-760) or fails a lookup
        (
            {**good, "model.layers.0.self_attn.qq_proj.weight": torch.zeros(8, 8)},
            "'.*qq_proj.weight' is not a",
        ),
        # not the whole model, not said partial: the rest would stay old
        ({n: t for n, t in good.items() if n != "model.norm.weight"}, r"1 of the 7 .*'model.norm.weight'"),
        # integers are not cast into a bf16 parameter as weights
        ({**good, q: torch.zeros(8, 8, dtype=torch.int32)}, f"'{q}' was given as torch.int32, .* as BF16"),
    ]
    for named, match in bad:
        with pytest.raises(ValueError, match=match):
            eng.update_weights_from_tensor(named)
    with pytest.raises(ValueError, match="given twice"):
        eng.update_weights_from_tensor([*good.items(), (q, good[q])])
    assert not {"/begin_weight_update", "/update_weights_from_tensor"} & set(paths(srv))
    assert all(torch.equal(srv.model[n], t) for n, t in before.items()) and srv.dead is None
    # some of them, said partial: only those change
    eng.update_weights_from_tensor({q: good[q]}, partial=True)
    assert torch.equal(srv.model[q], good[q]) and torch.equal(
        srv.model["lm_head.weight"], before["lm_head.weight"]
    )
    with pytest.raises(ValueError, match="partial must be True or False"):
        eng.update_weights_from_tensor({q: good[q]}, partial=1)
    # unchecked, the same bad shape reaches the rule, and the server dies: what the check keeps from it
    with pytest.raises(ConnectionError):
        eng.update_weights_from_tensor({**good, q: torch.zeros(8, 4)}, check=False)
    assert srv.dead.startswith("Attempted to load weight")


def test_quantized_and_tied_checkpoints(server):
    model = tiny_model()
    up = "model.layers.0.mlp.up_proj.weight"
    model[up] = torch.randint(-8, 8, (12, 8), dtype=torch.int8)  # quantized data: a cast would corrupt it
    srv = server(model=model, config={"tie_word_embeddings": True})
    eng = RemoteEngine(srv.url, "sglang", timeout=10)
    new = {n: t for n, t in tiny_model(seed=1).items() if n != "lm_head.weight"}
    with pytest.raises(ValueError, match=f"'{up}' was given as torch.bfloat16, .* as I8"):
        eng.update_weights_from_tensor(new)
    new[up] = torch.ones(12, 8, dtype=torch.int8)
    # lm_head in the checkpoint, tied: loaded from the embedding (qwen3.py:705-712), not required
    eng.update_weights_from_tensor(new)
    assert torch.equal(srv.model[up], new[up]) and srv.dead is None
    # a checkpoint without lm_head, tied: it is not one of the model's tensors to send
    no_head = {n: t for n, t in tiny_model().items() if n != "lm_head.weight"}
    srv2 = server(model=no_head, config={"tie_word_embeddings": True})
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is not a .*tied to the embedding"):
        RemoteEngine(srv2.url, "sglang").update_weights_from_tensor(tiny_model(seed=1))


def test_the_checkpoint_is_read_where_the_server_loaded_it(server, tmp_path):
    srv = server()
    srv.model_path = "org/tiny"  # a Hugging Face name, not in this machine's cache
    eng = RemoteEngine(srv.url, "sglang", timeout=10)
    for _ in range(2):  # the reason is kept: /model_info is asked once
        with pytest.raises(
            ValueError, match=r"cannot be checked .*'org/tiny' is neither a directory here nor"
        ):
            eng.update_weights_from_tensor(tiny_model(seed=1))
    assert paths(srv).count("/model_info") == 1 and "/begin_weight_update" not in paths(srv)
    eng.update_weights_from_tensor(tiny_model(seed=1), check=False)  # unchecked, as asked
    assert torch.equal(srv.model["model.norm.weight"], tiny_model(seed=1)["model.norm.weight"])
    # in the cache the server downloaded into (its --download-dir): found as SGLang finds it
    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc")
    (snap / "model.safetensors").write_bytes(Path(srv.dir.name, "model.safetensors").read_bytes())
    srv.args["download_dir"] = str(tmp_path)
    eng2 = RemoteEngine(srv.url, "sglang", timeout=10)
    eng2.update_weights_from_tensor(tiny_model(seed=2))
    with pytest.raises(ValueError, match=r"has \[8, 8\]"):
        eng2.update_weights_from_tensor(
            {**tiny_model(seed=2), "model.layers.1.self_attn.q_proj.weight": torch.zeros(8)}
        )
    assert srv.dead is None


def test_sharded_checkpoints_are_read_through_their_index(tmp_path):
    a, b = {"x.weight": torch.zeros(2, 3)}, {"y.weight": torch.zeros(4, dtype=torch.bfloat16)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"z": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))  # not in the index
    index = {
        "weight_map": {
            "x.weight": "model-00001-of-00002.safetensors",
            "y.weight": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = read_checkpoint(str(tmp_path))
    assert ckpt.tensors == {"x.weight": ((2, 3), "F32"), "y.weight": ((4,), "BF16")} and not ckpt.tied


def test_no_generate_reaches_a_release(server):
    srv = server()
    eng = RemoteEngine(srv.url, "sglang", timeout=10)
    srv.gen_s = 1.0
    # A generate from another thread of this engine, started as the flush answers: held by the engine's
    # lock until the release is done, then refused (weight_updater.py:339-341 would assert, and the
    # server die, had it arrived between the two)
    raced: list = []

    def race() -> None:
        threading.Thread(target=lambda: raced.append(outcome(eng.generate, ["r"]))).start()
        wait_until(lambda: "/generate" in paths(srv), 0.5)

    srv.on_flush = race
    eng.sleep(2)
    assert wait_until(lambda: raced, 5) and isinstance(raced[0], RemoteError)
    assert "/generate" not in paths(srv) and srv.released == ALL and srv.dead is None
    eng.wake()
    # Another client's generate in the same window: SGLang's pause holds it at the server, and it runs
    # after the wake (tokenizer_manager.py:938-939)
    other = RemoteEngine(srv.url, "sglang", timeout=10)
    got: list = []

    def race_other() -> None:
        threading.Thread(target=lambda: got.append(outcome(other.generate, ["q"]))).start()
        assert wait_until(lambda: "/generate" in paths(srv, n), 2)

    n = len(srv.requests)
    srv.on_flush = race_other
    eng.sleep(1)
    assert srv.released == ALL and srv.running == 0 and not got and srv.dead is None
    eng.wake()
    assert wait_until(lambda: got, 5) and got == [["q!"]] and srv.dead is None


def test_a_second_engine_never_resumes_what_it_did_not_release(server):
    srv = server()
    first = RemoteEngine(srv.url, "sglang", timeout=10)
    first.sleep(2)
    # another engine on the same server (or this process's after a restart): it released nothing, and
    # no endpoint says what is released; a resume of a tag not released is a KeyError that kills the
    # server (weight_updater.py:389-390), a second release reads released memory
    second = RemoteEngine(srv.url, "sglang", timeout=10)
    n = len(srv.requests)
    with pytest.raises(RemoteError, match="503: paused, and not by this engine"):
        second.wake()
    with pytest.raises(RemoteError, match="503: paused, and not by this engine"):
        second.sleep(1)
    assert paths(srv, n) == ["/ready", "/server_info", "/ready"] and srv.released == ALL
    # its generate is held by the pause, not run over the released memory
    late = RemoteEngine(srv.url, "sglang", timeout=0.5)
    with pytest.raises(ConnectionError):
        late.generate(["x"])
    first.wake()
    assert not srv.released and srv.dead is None
    second.wake()  # nothing released now: nothing to do
    assert second.generate(["y"]) == ["y!"] and srv.dead is None


def test_a_weight_cache_is_refused_before_sending(server):
    srv = server()
    srv.args["weight_cache_mode"] = "daemon"
    eng = RemoteEngine(srv.url, "sglang", timeout=10)
    for call in (
        lambda: eng.sleep(2),
        lambda: eng.sleep(1),
        lambda: eng.update_weights_from_tensor(tiny_model(1)),
    ):
        with pytest.raises(ValueError, match="--weight-cache-mode daemon"):
            call()
    assert paths(srv) == ["/server_info"] and not srv.released and srv.dead is None


def test_shared_weights_go_through_the_same_checks(server):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    srv = server(model={n: p.detach().to(torch.bfloat16) for n, p in net.named_parameters()})
    shared = SharedWeights(net, torch.bfloat16, device="cpu")
    try:
        eng = RemoteEngine(srv.url, "sglang", timeout=10)
        with torch.no_grad():
            net[0].weight.add_(1)
        eng.update_weights(shared)  # synced first
        assert torch.equal(srv.model["0.weight"], shared.tensors["0.weight"])
        with pytest.raises(ValueError, match=r"3 of the 4 tensors"):
            eng.update_weights(shared, names=["1.bias"])
        eng.update_weights(shared, names=["1.bias"], partial=True)
        with pytest.raises(ValueError, match=r"names: '2\.weight' not among"):
            eng.update_weights(shared, names=["2.weight"], partial=True)
        assert srv.dead is None
    finally:
        shared.close()
