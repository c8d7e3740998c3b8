"""Activation offloading and checkpointing: gradients bit-equal with and without, on the host backend and
on a GPU, for dense and MoE models and every name; views, in-place ops, tuple outputs, races, soak."""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings

import pytest
import torch
from torch import nn

import rlmem
from rlmem.activations import ActivationOffloader
from rlmem.activations import _budget as _actplan

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", message=".*bos_token_id.*")

KW = dict(
    hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
)
DENSE = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def make(kind: str, device: str = "cpu", layers: int = KW["num_hidden_layers"]) -> nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":
        kw = {**KW, "num_hidden_layers": layers}
        m = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**kw, vocab_size=97, attn_implementation="sdpa")
        )
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(
            **KW, vocab_size=97, num_local_experts=4, num_experts_per_tok=2, attn_implementation="sdpa"
        )
        m = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **KW,
            vocab_size=97,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            attn_implementation="sdpa",
        )
        m = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=97)
        m = transformers.GPT2LMHeadModel(cfg)  # dropout on: the checkpoint must replay the RNG
    return m.to(device).train()


def run(model: nn.Module, ctx=None, steps: int = 1, seed: int = 5, length: int = 24):
    dev = next(model.parameters()).device
    ids = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(1)).to(dev)
    torch.manual_seed(seed)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


CASES = [("qwen2", [n]) for n in DENSE if n != "attn_proj"] + [
    ("qwen2", ["core_attn", "attn_proj"]),
    ("qwen2", DENSE),
    ("mixtral", ["expert_fc1"]),
    ("mixtral", ["moe_act"]),
    ("mixtral", [*DENSE, "expert_fc1", "moe_act"]),
    ("qwen2_moe", ["expert_fc1", "moe_act"]),
    ("gpt2", DENSE),
]


@pytest.mark.parametrize("kind,names", CASES, ids=[f"{k}-{'+'.join(n)}" for k, n in CASES])
def test_gradients_bit_equal_per_name(kind, names, device):
    ref = run(make(kind, device))
    model = make(kind, device)
    off = rlmem.offload_activations(model, names, min_bytes=0)
    got = run(model, off)
    assert_same(ref, got)
    st = off.stats()
    assert st.offloaded_bytes > 0
    # attn_proj's input may be core_attn's output (one storage, counted once, under core_attn).
    assert set(names) - {"attn_proj"} <= set(st.by_name) <= set(names)
    used = st.reloaded_prefetched + st.reloaded_on_demand + st.served_resident
    assert used >= st.offloaded_tensors
    assert st.held_elsewhere_bytes == 0  # every offloaded storage was really let go on the device


def test_moe_routing_and_expert_scopes_offload_the_expert_inputs():
    model = make("mixtral")
    off = rlmem.offload_activations(model, ["expert_fc1"], min_bytes=0)
    run(model, off)
    st = off.stats()
    # One gathered token block per expert hit per layer: the routed inputs of the first expert matmul.
    assert st.offloaded_tensors >= 3
    assert st.by_name["expert_fc1"] > 0


class Views(nn.Module):
    """Saves two views of one storage, an in-place-modified tensor, and returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        h.mul_(1.5)  # in place before anything saves it: legal
        a, b = h[..., :16], h[..., 16:]
        y = a * b  # saves both views of h's storage
        return self.out(torch.tanh(y)), a.sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Views() for _ in range(2)])

    def forward(self, x):
        total = 0
        for b in self.blocks:
            x, s = b(x)
            total = total + s
        return x.square().mean() + total


MAP = rlmem.ModuleMap(layers="blocks.*", modules={"core_attn": "blocks.*"})


def _net_grads(device, ctx=None):
    torch.manual_seed(0)
    net = Net().to(device)
    x = torch.randn(4, 8, 16, device=device, requires_grad=True)
    with ctx(net) if ctx else contextlib.nullcontext():
        net(x).backward()
    return [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]


def test_views_in_place_and_tuple_outputs(device):
    ref = _net_grads(device)
    holder = {}

    def ctx(net):
        holder["off"] = rlmem.offload_activations(net, ["core_attn"], min_bytes=0, module_map=MAP)
        return holder["off"]

    got = _net_grads(device, ctx)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    st = holder["off"].stats()
    assert st.dedup_hits >= 2  # a and b: one copy of h's storage per block


def _modified_after_forward(device, ctx_fn, slow=False):
    torch.manual_seed(0)
    net = Net().to(device)
    ctx = ctx_fn(net)
    x = torch.randn(4, 8, 16, device=device, requires_grad=True)
    h = {}
    net.blocks[0].lin.register_forward_hook(lambda m, i, o: h.setdefault("h", o))
    with ctx:
        loss = net(x)
        h["h"].add_(1.0)  # h's views were saved by a * b
        loss.backward()
    return [p.grad.clone() for p in net.parameters()]


def test_in_place_change_after_save(device):
    """Autograd refuses it; once rlmem's copy exists the copy holds the saved value, so the gradient is the
    one of the forward pass as it ran. A change while the copy is in flight is refused (CUDA test below)."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _modified_after_forward(device, lambda net: contextlib.nullcontext())
    ref = _net_grads(device)
    got = _modified_after_forward(
        device, lambda net: rlmem.offload_activations(net, ["core_attn"], min_bytes=0, module_map=MAP)
    )
    if device == "cpu":
        for a, b in zip(ref, got[: len(ref)], strict=False):
            assert torch.equal(a, b)


@pytest.mark.cuda
def test_in_place_change_while_the_copy_is_in_flight_is_an_error(monkeypatch):
    torch.manual_seed(0)
    net = Net().cuda()
    off = rlmem.offload_activations(net, ["core_attn"], min_bytes=0, module_map=MAP)
    x = torch.randn(4, 8, 16, device="cuda", requires_grad=True)
    with off:
        net(x).backward()  # warm: the host pool exists, so the next step allocates nothing pinned
    orig = ActivationOffloader._offload

    def slow(self, *a, **k):
        with torch.cuda.stream(self._copies._d2h):
            torch.cuda._sleep(1_000_000_000)  # about half a second before each copy
        return orig(self, *a, **k)

    monkeypatch.setattr(ActivationOffloader, "_offload", slow)
    h = {}
    net.blocks[0].lin.register_forward_hook(lambda m, i, o: h.setdefault("h", o))
    with off:
        loss = net(x)
        assert off._inflight, "the copies should still be in flight"
        h["h"].add_(1.0)  # h's views were saved by a * b and are being copied
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_backward_after_the_context_ended_is_an_error():
    model = make("qwen2")
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    ids = torch.randint(0, 97, (2, 24))
    with off:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    with pytest.raises(RuntimeError, match="one `with` block"):
        loss.backward()


def test_retain_graph_second_backward_matches():
    def twice(ctx):
        model = make("qwen2")
        ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
        with ctx(model) if ctx else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward(retain_graph=True)
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = twice(None)
    got = twice(lambda m: rlmem.offload_activations(m, DENSE, min_bytes=0))
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


def test_defers_to_torch_checkpoint_hooks():
    from torch.utils.checkpoint import checkpoint

    def grads(off_names):
        model = make("qwen2")
        for layer in model.model.layers:
            f = layer.forward
            layer.forward = lambda *a, _f=f, **k: checkpoint(_f, *a, use_reentrant=False, **k)
        off = rlmem.offload_activations(model, off_names, min_bytes=0) if off_names else None
        out = run(model, off)
        return out, off

    ref, _ = grads(None)
    got, off = grads(DENSE)
    assert_same(ref, got)
    assert off.stats().deferred_scopes > 0
    assert off.stats().offloaded_bytes == 0


def test_min_bytes_keeps_small_tensors():
    model = make("qwen2")
    off = rlmem.offload_activations(model, DENSE, min_bytes=1 << 30)
    run(model, off)
    st = off.stats()
    assert st.offloaded_bytes == 0 and st.kept_small > 0


def test_disabled_handle_is_a_no_op():
    model = make("qwen2")
    ref = run(make("qwen2"))
    off = rlmem.offload_activations(model, DENSE, enabled=False)
    assert_same(ref, run(model, off))
    assert off.stats().offloaded_bytes == 0
    assert not model.model.layers[0].input_layernorm._forward_pre_hooks


def test_remove_detaches_hooks():
    model = make("qwen2")
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    off.remove()
    assert not model.model.layers[0].self_attn._forward_pre_hooks
    with off:
        pass


@pytest.mark.parametrize("kw", [{"every": 1}, {"every": 2}, {"layers": [1]}])
@pytest.mark.parametrize("kind", ["qwen2", "gpt2", "mixtral"])
def test_checkpoint_bit_equal(kind, kw, device):
    ref = run(make(kind, device))
    model = make(kind, device)
    ck = rlmem.checkpoint(model, **kw)
    assert_same(ref, run(model))
    ck.remove()
    assert "forward" not in model.get_submodule(_layers_path(kind))[0].__dict__


def _layers_path(kind):
    return "transformer.h" if kind == "gpt2" else "model.layers"


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_checkpoint_with_offload_offloads_inputs(kind, device):
    ref = run(make(kind, device))
    model = make(kind, device)
    rlmem.checkpoint(model, every=1)
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    assert_same(ref, run(model, off))
    st = off.stats()
    assert st.by_name == {"checkpoint_input": st.offloaded_bytes}
    assert st.offloaded_tensors == 3  # one hidden state per layer
    assert st.held_elsewhere_bytes == 0  # nothing else (the replay closure) keeps the inputs


def test_checkpoint_drops_the_kv_cache_in_training():
    ref = run(make("qwen2"))
    model = make("qwen2")
    rlmem.checkpoint(model, every=1)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    cache = transformers.DynamicCache()
    # the cache's keyword: "cache" in transformers releases that renamed it, "past_key_values" before
    kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with pytest.warns(UserWarning, match="KV cache"):
        loss = model(input_ids=ids, labels=ids, use_cache=True, **{kw: cache}).loss
    loss.backward()
    assert torch.equal(loss.detach(), ref[0])
    assert cache.get_seq_length() == 0  # the checkpointed layers ran without it


def test_soak_pool_and_memory_do_not_grow(device):
    model = make("qwen2", device)
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    pools, mem = [], []
    for _ in range(200):
        run(model, off)
        pools.append(off.stats().pool_bytes)
        if device == "cuda":
            mem.append(torch.cuda.memory_allocated())
    assert len(set(pools[1:])) == 1
    if mem:
        assert max(mem[10:]) <= mem[10]
    assert off.stats().totals.steps == 200


def _hooks_seen(model: nn.Module) -> list:
    """The saved-tensor hooks on top of the stack while each step's first decoder layer runs."""
    seen: list = []
    model.model.layers[1].register_forward_pre_hook(
        lambda m, a: seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
    )
    return seen


def test_budget_auto_measures_then_offloads():
    model = make("qwen2")
    ref = run(make("qwen2"), steps=2)
    off = rlmem.offload_activations(model, budget="auto", min_bytes=0, max_overhead=0.5)
    assert off.names == DENSE
    seen = _hooks_seen(model)
    first = run(model, off)  # measured: what each scope saves and when; nothing offloaded
    assert off.stats().offloaded_bytes == 0 and off.plan is None and not off.settled
    assert seen[-1] is not None
    for _ in range(3):  # the reference: the same step with the offloader out of it (the median counts)
        assert off.plan is None
        run(model, off)
        assert seen[-1] is None  # no saved-tensor hooks while it ran
    plan = off.plan
    assert plan is not None and plan.baseline_s > 0 and not plan.trials
    assert "budget=auto" in str(plan) and plan.reasons and "without offloading" in str(plan)
    assert plan.chosen  # on this model everything fits under 50%
    got = run(model, off)  # a pair's first half: the step without offloading, just before the plan's
    assert_same(ref, got)
    assert off.stats().offloaded_bytes == 0 and seen[-1] is None
    got = run(model, off)  # the plan runs and is measured against the step before it
    assert_same(ref, got)
    assert first[0] == got[0]
    assert off.stats().offloaded_bytes > 0
    for _ in range(100):
        if off.settled:
            break
        assert_same(ref, run(model, off))
    assert off.settled and off.plan.settled
    plan = off.plan
    assert len(plan.measured_overhead) >= 1 and "measured overhead" in str(plan)
    assert off.stats().offloaded_bytes >= plan.offload_bytes
    assert_same(ref, run(model, off))
    assert off.plan is plan  # settled: nothing measured any more


def test_layers_with_nothing_chosen_run_without_hooks():
    model = make("qwen2")
    ref = run(make("qwen2"))
    only0 = rlmem.ModuleMap(layers="model.layers.*", modules={"attn_norm": "model.layers.0.input_layernorm"})
    off = rlmem.offload_activations(model, ["attn_norm"], min_bytes=0, module_map=only0)
    seen = {i: [] for i in range(3)}
    for i, layer in enumerate(model.model.layers):
        layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: seen[i].append(torch._C._autograd._top_saved_tensors_default_hooks(False))
        )
    assert_same(ref, run(model, off))
    assert off.stats().offloaded_bytes > 0
    # Layer 0 has a chosen module: its other tensors pass the hooks (they may share an offloaded storage).
    assert seen[0][-1] is not None and seen[1][-1] is None and seen[2][-1] is None
    # Nothing unpacks through the hooks above layer 0, yet its tensors were reloaded ahead of its backward
    # (when backward left layer 2), not when they were needed.
    st = off.stats()
    assert st.reloaded_on_demand == 0 and st.reloaded_prefetched > 0


class _Blocks(nn.Module):
    """Layers of three blocks: ``a``'s output (saved by its tanh) is ``b``'s input; ``c`` takes a new one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "a": nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
                    "b": nn.Sequential(nn.Linear(16, 16)),
                    "c": nn.Sequential(nn.Linear(16, 16), nn.Sigmoid()),
                }
            )
            for _ in range(2)
        )
        for layer in self.layers:
            layer.forward = lambda x, m=layer: m["c"](m["b"](m["a"](x)) * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_blocks_of_a_chosen_layer_skip_the_hooks_unless_they_take_an_offloaded_storage():
    def grads(off=None):
        torch.manual_seed(0)
        model = _Blocks()
        x = torch.randn(8, 16, requires_grad=True)
        seen = {}
        for name in "bc":
            model.layers[0][name][0].register_forward_pre_hook(
                lambda m, a, name=name: seen.__setitem__(
                    name, torch._C._autograd._top_saved_tensors_default_hooks(False)
                )
            )
        with off(model) if off else contextlib.nullcontext():
            model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()], seen, model

    ref, _, _ = grads()
    mmap = rlmem.ModuleMap(layers="layers.*", modules={"attn_norm": "layers.0.a"})
    handles = []

    def off(model):
        handles.append(rlmem.offload_activations(model, ["attn_norm"], min_bytes=0, module_map=mmap))
        return handles[-1]

    got, seen, _ = grads(off)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    st = handles[-1].stats()
    assert st.offloaded_bytes > 0
    # b saves a's offloaded output again: through the hooks, one copy shared (dedup), none kept twice.
    assert seen["b"] is not None and st.dedup_hits >= 1
    assert seen["c"] is None  # c takes a new tensor and holds nothing chosen: no hooks inside it


def test_budget_auto_shrinks_a_plan_measured_over_its_overhead(monkeypatch):
    from rlmem.activations import _transfer

    model = make("qwen2")
    ref = run(make("qwen2"), steps=1)
    off = rlmem.offload_activations(model, budget="auto", min_bytes=0, max_overhead=0.9)
    seen = _hooks_seen(model)
    run(model, off)  # measured, nothing offloaded
    run(model, off, steps=3)  # the reference steps
    chosen = len(off.plan.chosen)
    assert chosen >= 2
    slow = _transfer.HostCopies.copy_out

    def slow_copy(*a, **k):  # a link far slower than the one the plan was made for
        time.sleep(0.05)
        return slow(*a, **k)

    monkeypatch.setattr(_transfer.HostCopies, "copy_out", staticmethod(slow_copy))
    sizes = []
    for _ in range(60):  # each prefix is measured three times or more, each after a step without it
        got = run(model, off)
        assert_same(ref, got)  # gradients bit-equal whatever the plan is at each step
        sizes.append(off.stats().offloaded_tensors)
    plan = off.plan
    assert plan.settled and plan.shrunk >= 2 and plan.chosen == ()
    assert [k for k, _ in plan.trials][:2] == [chosen, chosen // 2]  # the whole plan, then half of it
    assert all(m > 0.9 for m in plan.measured_overhead)
    assert "nothing is offloaded" in str(plan) and "shrunk" in str(plan)
    assert sizes[-1] == 0 and seen[-1] is None  # settled on nothing: the offloader stays out of the step


def _one_per_layer_plan() -> tuple[tuple, _actplan.OffloadPlan]:
    """22 layers with one candidate each, chosen by an auto plan at a 5% limit but for the last two (the
    forward pass never frees them): 20 chosen."""
    c = tuple(_actplan.Candidate("core_attn", i, 100, produced_s=float(i)) for i in range(22))
    plan = _actplan.choose(
        list(c),
        budget="auto",
        d2h_bytes_per_s=1e9,
        forward_s=100.0,
        step_s=200.0,
        activation_bytes=2200,
        max_overhead=0.05,
        tail=2,
    )
    assert plan.chosen == c[:20] and "2 candidates of the last 2 layers" in str(plan)
    return c, plan


def test_prefix_search_keeps_the_longest_prefix_within_the_limit():
    c, plan = _one_per_layer_plan()
    assert len(plan.chosen) == 20
    search = _actplan.PrefixSearch(plan, 1.0, 0.05)
    steps = 0
    while not search.done:
        search.record(1.0 + 0.0099 * search.k)  # each candidate adds ~1% to a 1 s step
        steps += 1
    assert len(search.plan.chosen) == 5 and search.plan.chosen == c[:5]  # one per layer: in layer order
    assert len(search.plan.trials) <= 8 and steps == 3 * len(search.plan.trials)
    assert search.plan.trials[0] == (20, pytest.approx(0.198))
    assert "kept the first 5 of 20" in str(search.plan)
    # A plan measured within the limit at once is kept whole once checked in a row.
    search = _actplan.PrefixSearch(plan, 1.0, 0.05)
    search.record(1.5)  # the first step of a plan pays for what it allocates: the median counts
    search.record(1.01)
    search.record(1.02)
    assert not search.done  # three steps 49% apart: three more before the median counts
    for t in (1.01, 1.03, 1.02):
        search.record(t)
    assert not search.done and search.checking  # kept: now three steps in a row, none between them
    assert not search.wants_reference
    for t in (1.03, 1.04, 1.02):
        search.record(t)
    assert search.done and len(search.plan.chosen) == 20
    assert search.plan.trials == ((20, pytest.approx(0.02)), (20, pytest.approx(0.03)))


def test_prefix_search_pairs_each_step_with_one_without_offloading():
    _, plan = _one_per_layer_plan()
    # The step drifts 10% slower over the search (the reference of 1.0 s was taken before): the whole plan
    # adds 3% to the steps around it and is kept; against the old reference it would have been shrunk.
    search = _actplan.PrefixSearch(plan, 1.0, 0.05)
    for _ in range(3):
        assert search.wants_reference
        search.record_reference(1.1)
        assert not search.wants_reference
        search.record(1.1 * 1.03)
    assert search.checking and not search.done
    # In a row, the plan costs more than between reference steps: the search goes on below it.
    for _ in range(3):
        search.record(1.1 * 1.10)
    assert not search.done and search.plan.trials[-1] == (20, pytest.approx(1.1 * 1.1 / 1.1 - 1))
    assert "in a row" in str(search.plan)
    while not search.done:  # below it, each candidate adds 0.5%, paired or in a row
        if search.wants_reference:
            search.record_reference(1.1)
        else:
            search.record(1.1 * (1 + 0.005 * search.k))
    assert 0 < len(search.plan.chosen) < 20 and search.plan.trials[-1][1] <= 0.05
    # Pairs whose ratios spread over twice the limit: more pairs (up to 6), then the median counts.
    search = _actplan.PrefixSearch(plan, 1.0, 0.05)
    for i, ratio in enumerate([1.0, 1.3, 1.02, 1.01, 1.04, 1.2]):
        search.record_reference(1.0)
        search.record(ratio)
        assert search.checking == (i == 5)
    assert search.plan.trials == ((20, pytest.approx((1.02 + 1.04) / 2 - 1)),)
    for _ in range(3):
        search.record(1.02)
    assert search.done and len(search.plan.chosen) == 20


def test_prefix_search_spreads_over_the_layers():
    c = [_actplan.Candidate(n, i, 100, produced_s=i + k / 10) for i in range(3) for k, n in enumerate(DENSE)]
    order = _actplan.balanced(tuple(c))
    assert [(x.layer, x.name) for x in order[:4]] == [
        (0, "attn_norm"),
        (1, "attn_norm"),
        (2, "attn_norm"),
        (0, "qkv_linear"),
    ]
    # A layer's core_attn always comes before its attn_proj (which shares its input).
    for i in range(3):
        names = [x.name for x in order if x.layer == i]
        assert names.index("core_attn") < names.index("attn_proj")
    assert sorted(order, key=c.index) == c


def test_budget_auto_measures_a_cold_step_again(monkeypatch):
    """On a GPU (copies asynchronous), a measured step far slower than the reference steps after it was a
    cold start: its times per layer are not the step's, so the step is measured again (at most twice)."""
    from rlmem.activations import _autoplan

    times = iter([5.0, 1.0, 1.0, 1.0, 1.2, 1.0, 1.0, 1.0])  # measured, 3 references, measured, 3 references
    monkeypatch.setattr(_autoplan, "_step_s", lambda off, end=None: next(times))
    model = make("qwen2")
    ref = run(make("qwen2"))
    off = rlmem.offload_activations(model, budget="auto", min_bytes=0, max_overhead=0.5)
    off._copies = _asynchronous(True)(off.device)
    modes = []
    for _ in range(8):
        assert off.plan is None
        assert_same(ref, run(model, off))
        modes.append(off._control.mode)
    assert modes == ["profile", "baseline", "baseline", "baseline"] * 2
    assert off.plan is not None and "measured again 1x" in str(off.plan)


def _module_hooks(model: nn.Module, off: ActivationOffloader) -> int:
    """Forward hooks on the model's modules other than its decoder layers (the scopes' hooks)."""
    layers = {id(m) for _, m in off.layer_map.layers}
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules() if id(m) not in layers
    )


def test_budget_auto_hooks_only_the_modules_it_offloads(monkeypatch):
    """A hook is a Python call at every forward, which a small model's step pays in full: the reference
    steps run with no scope hook (so the plan is measured against a step without the offloader at all), a
    trial with its prefix's alone, and a plan that settles empty leaves none."""
    from rlmem.activations import _autoplan

    model = make("qwen2")
    ref = run(make("qwen2"))
    off = rlmem.offload_activations(model, budget="auto", min_bytes=0, max_overhead=0.5)
    full = _module_hooks(model, off)
    # Every step with something offloaded takes twice the reference's: each prefix adds too much.
    monkeypatch.setattr(
        _autoplan, "_step_s", lambda m, end=None: 2.0 if off._control.mode == "trial" else 1.0
    )
    seen = []
    for _ in range(60):
        assert_same(ref, run(model, off))
        seen.append((off._control.mode, _module_hooks(model, off)))
        if off.settled:
            break
    assert seen[0] == ("profile", full) and full > 0
    assert {n for mode, n in seen if mode in ("baseline", "reference", "idle")} == {0}
    trials = [n for mode, n in seen if mode == "trial"]
    assert trials and all(0 < n <= full for n in trials) and min(trials) < full
    assert off.settled and not off.plan.chosen
    assert_same(ref, run(model, off))  # the plan settled empty: the next step runs out of the offloader
    assert off._control.mode == "idle" and _module_hooks(model, off) == 0
    assert sum(len(m._forward_pre_hooks) for _, m in off.layer_map.layers) == len(off.layer_map.layers)
    off.remove()
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0


def test_budget_auto_allows_less_for_a_small_saving():
    """A prefix that offloads under a tenth of the activation bytes may add 2% at most, whatever the
    max_overhead; a larger one up to max_overhead."""

    def search(nbytes: int) -> _actplan.PrefixSearch:
        c = (_actplan.Candidate("mlp_norm", 0, nbytes, 1e-3),)
        plan = _actplan.OffloadPlan(
            budget="auto", chosen=c, candidates=c, d2h_bytes_per_s=1e9, forward_s=1.0, step_s=2.0,
            activation_bytes=200, allowance_s=0.0, finish_s=0.0,
        )  # fmt: skip
        return _actplan.PrefixSearch(plan, 1.0, 0.05, repeats=1, max_repeats=1)

    small = search(10)  # 5% of the activations: 3% is too much
    plan = small.record(1.03)
    assert plan.settled and not plan.chosen and any("over the allowed 2.0%" in r for r in plan.reasons)
    large = search(40)  # 20%: 3% is within max_overhead, checked in a row too
    large.record(1.03)
    plan = large.record(1.03)
    assert plan.settled and len(plan.chosen) == 1


def test_forward_scale_takes_the_forward_pass_from_the_reference_steps():
    from rlmem.activations._autoplan import forward_scale

    # The measured step's forward pass ran 0.6 s of its 1.0 s (its hooks stretched it), the reference
    # steps' 0.3 s of 0.7 s: the forward pass scales by 0.3 / 0.6 (not by the step's 0.7), the step is 0.7.
    prof = {"step_s": 1.0, "layers_end_s": 0.6}
    assert forward_scale(prof, 0.7, [0.31, 0.3, 0.2]) == (pytest.approx(0.5), 0.7)
    # No mark of the forward pass's end (in the measured step or the references): the whole step scales.
    assert forward_scale({"step_s": 1.0, "layers_end_s": None}, 0.7, [0.3]) == (pytest.approx(0.7), 0.7)
    assert forward_scale(prof, 0.7, []) == (pytest.approx(0.7), 0.7)
    # A byte budget has no reference: the measured step stands as it is.
    assert forward_scale(prof, 0.0, []) == (1.0, 1.0)


def test_budget_auto_plans_with_the_reference_steps_forward_pass(monkeypatch):
    """The reference steps mark the end of the last decoder layer's forward pass (the offloader's hooks
    out of the step), and the plan's forward pass is the measured step's, scaled to theirs."""
    from rlmem.activations import _autoplan

    model = make("qwen2")
    ref = run(make("qwen2"))
    off = rlmem.offload_activations(model, budget="auto", min_bytes=0, max_overhead=0.5)
    seen = {}
    plan_fn = _autoplan.BudgetControl._plan

    def spy(self, off, key, baseline_s):
        s = self.shapes[key]
        seen.update(profile=dict(s.profile), forward=list(s.reference_forward), baseline=baseline_s)
        return plan_fn(self, off, key, baseline_s)

    monkeypatch.setattr(_autoplan.BudgetControl, "_plan", spy)
    for _ in range(4):
        assert_same(ref, run(model, off))
    plan, prof = off.plan, seen["profile"]
    assert plan is not None and len(seen["forward"]) == 3
    assert 0 < prof["layers_end_s"] <= prof["forward_s"] < prof["step_s"]
    # each reference step's forward pass is part of it; the baseline is their median step, so it is the
    # forward passes' median that lies under it (one noisy step's forward may outlast the median step)
    assert all(f > 0 for f in seen["forward"])
    assert _autoplan._budget.median(seen["forward"]) < seen["baseline"]
    scale = _autoplan._budget.median(seen["forward"]) / prof["layers_end_s"]
    assert plan.forward_s == pytest.approx(prof["forward_s"] * scale)
    assert plan.step_s == pytest.approx(seen["baseline"])


def test_budget_auto_plans_each_input_shape_apart():
    model = make("qwen2")
    ref_short, ref_long = run(make("qwen2")), run(make("qwen2"), length=100)
    off = rlmem.offload_activations(model, budget="auto", min_bytes=0, max_overhead=0.99)
    for _ in range(100):
        run(model, off)
        if off.settled:
            break
    assert off.settled and off.plan.chosen
    short = off.plan
    got = run(model, off, length=100)  # a new length bucket: measured, not offloaded with the short plan
    assert_same(ref_long, got)
    assert off.stats().offloaded_bytes == 0 and len(off.plans) == 1 and off.plan is None
    run(model, off, length=100, steps=3)  # its reference steps
    assert off.plan is not short and off.plan.baseline_s > 0 and len(off.plans) == 2
    # Back to the short shape. This step was entered as the long shape's next reference step (the offloader
    # out of it), which a step cannot leave halfway: it runs as it is, and the next one runs the short plan.
    assert_same(ref_short, run(model, off))
    assert off.plan is short and off.stats().offloaded_bytes == 0
    got = run(model, off)
    assert_same(ref_short, got)
    assert off.plan is short and off.stats().offloaded_bytes >= short.offload_bytes > 0


def test_budget_bytes_offloads_until_it_fits():
    model = make("qwen2")
    off = rlmem.offload_activations(model, budget=1, min_bytes=0, max_overhead=0.0)
    run(model, off)
    run(model, off)
    plan = off.plan
    # Every candidate but the last two layers' (still on the device when backward starts, so offloading
    # them would lower nothing).
    assert plan.offload_bytes == sum(c.nbytes for c in plan.candidates if c.layer < 1) > 0
    assert any("budget" in r for r in plan.reasons) and any("last 2 layers" in r for r in plan.reasons)


def test_plan_counts_a_fixed_cost_per_copy():
    # Same bytes, produced together: one scope as 1 tensor, the other as 1000 small ones.
    c = [
        _actplan.Candidate("attn_norm", 0, 100, produced_s=0.0, count=1),
        _actplan.Candidate("mlp_norm", 0, 100, produced_s=0.0, count=1000),
    ]
    link = dict(d2h_bytes_per_s=100.0, forward_s=3.0, step_s=20.0, activation_bytes=200, max_overhead=0)
    link["layer_starts"] = {0: 0.0, 1: 1.0, 2: 2.5, 3: 2.8}
    assert len(_actplan.choose(c, budget="auto", **link).chosen) == 2  # 2 s of copies hide under 3 s
    plan = _actplan.choose(c, budget="auto", per_copy_s=0.002, **link)  # 1000 copies cost 2 s more
    assert [x.name for x in plan.chosen] == ["attn_norm"]


def test_plan_queue_respects_the_link():
    c = [_actplan.Candidate("core_attn", i, 100, produced_s=i * 1.0) for i in range(4)]
    # 100 bytes/s: each copy takes 1 s; the forward pass ends at 4 s: layers 0-3 drain at 1, 2, 3, 4 s.
    link = dict(d2h_bytes_per_s=100.0, forward_s=3.5, step_s=10.0, activation_bytes=400, max_overhead=0)
    plan = _actplan.choose(c, budget="auto", **link)
    assert [x.layer for x in plan.chosen] == [0, 1, 2]
    assert plan.expected_overhead_s == 0
    fits = _actplan.choose(c, budget=350, **link)
    assert [x.layer for x in fits.chosen] == [0]  # 50 bytes needed: the first hidden copy is enough
    over = _actplan.choose(c, budget=50, **link)
    # Layer 3's copy ends after the forward pass: no forward layer waits for it, but the backward pass,
    # which starts with layer 3, waits 1 s for its reload.
    assert len(over.chosen) == 4 and over.expected_overhead_s == 1.0


def test_plan_models_the_backward_waits_for_reloads():
    # Backward (6 s over 4 layers: 1.5 s each) starts with the last layer: a 200-byte reload of layer 3 at
    # 100 bytes/s would hold it 2 s; layer 2's is prefetched while layer 3 runs and hides.
    c = [_actplan.Candidate("core_attn", i, 200 if i == 3 else 100, produced_s=i * 0.1) for i in range(4)]
    link = dict(d2h_bytes_per_s=1e6, h2d_bytes_per_s=100.0, forward_s=4.0, step_s=10.0, activation_bytes=500)
    plan = _actplan.choose(c, budget="auto", max_overhead=0.1, **link)  # 1 s allowed
    assert [x.layer for x in plan.chosen] == [0, 1, 2]
    assert plan.expected_overhead_s == 0
    assert "reloads" in str(plan)


def test_plan_takes_attn_proj_only_with_core_attn():
    # attn_proj's input is core_attn's output: alone it would copy a storage core_attn keeps on the device.
    c = [
        _actplan.Candidate("core_attn", 0, 1000, produced_s=0.0),
        _actplan.Candidate("attn_proj", 0, 10, produced_s=0.1),
        _actplan.Candidate("attn_proj", 1, 10, produced_s=1.1),
    ]
    link = dict(d2h_bytes_per_s=100.0, forward_s=5.0, step_s=10.0, activation_bytes=1020, max_overhead=0)
    plan = _actplan.choose(c, budget="auto", **link)
    assert plan.chosen == ()  # core_attn 0 cannot hide (10 s), so neither attn_proj may go
    over = _actplan.choose(c, budget=10, **link)
    assert [(x.name, x.layer) for x in over.chosen] == [("core_attn", 0), ("attn_proj", 0)]


def test_unchosen_scopes_share_what_chosen_ones_offloaded():
    model = make("qwen2")
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    # What the budget mode may pick: core_attn of a layer without its attn_proj, which then saves
    # core_attn's output again.
    off._selected = {(n, layer) for n in ("attn_norm", "core_attn", "mlp_norm") for layer in range(3)}
    assert_same(run(make("qwen2")), run(model, off))
    assert off.stats().held_elsewhere_bytes == 0


def test_plan_models_the_waits_two_layers_behind():
    c = [_actplan.Candidate("core_attn", i, 100, produced_s=i * 1.0) for i in range(4)]
    # 50 bytes/s: each copy takes 2 s. Layer 3 starts at 3 s and waits for layer 1's copy (2 -> 4 s): 1 s.
    # (Reloads are made instant: this is the forward side alone.)
    link = dict(d2h_bytes_per_s=50.0, h2d_bytes_per_s=1e12, forward_s=10.0, step_s=10.0, activation_bytes=400)
    plan = _actplan.choose(c, budget="auto", max_overhead=0, **link)
    assert [x.layer for x in plan.chosen] == [0, 2, 3]
    assert any("wait" in r for r in plan.reasons)
    assert _actplan._stall(c[:2], 50.0, {i: float(i) for i in range(4)}, 2) == pytest.approx(1.0)
    lenient = _actplan.choose(c, budget="auto", max_overhead=0.1, **link)
    assert [x.layer for x in lenient.chosen] == [0, 1, 2, 3]
    assert lenient.expected_overhead_s == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"modules": []}, "must not be empty"),
        ({"modules": ["mlp"]}, "valid names: attn_norm, qkv_linear, core_attn"),
        ({"modules": ["attn_proj"]}, "'attn_proj' requires 'core_attn'"),
        ({"modules": ["expert_fc1"]}, "Qwen2ForCausalLM has no expert_fc1"),
        ({"modules": "core_attn"}, "list of names"),
        ({"modules": None}, "must list at least one"),
        ({"modules": DENSE, "min_bytes": -1}, "min_bytes"),
        ({"modules": DENSE, "budget": "lots"}, "budget"),
        ({"modules": DENSE, "budget": 0}, "budget"),
        ({"modules": DENSE, "max_overhead": 1.5}, "max_overhead"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rlmem.offload_activations(make("qwen2"), **kwargs)


def test_unknown_model_names_its_class():
    with pytest.raises(ValueError, match="Sequential: no decoder layers"):
        rlmem.offload_activations(nn.Sequential(nn.Linear(2, 2)), ["core_attn"])
    with pytest.raises(ValueError, match="matched no module"):
        rlmem.offload_activations(
            Net(), ["core_attn"], module_map=rlmem.ModuleMap(layers="nope.*", modules={})
        )
    with pytest.raises(ValueError, match="unknown name"):
        rlmem.ModuleMap(layers="blocks.*", modules={"mlp": "x"})


def test_module_map_globs_match_one_path_component():
    from rlmem.activations.modmap import find_module_map

    lm = find_module_map(Net(), MAP)
    assert [p for p, _ in lm.layers] == ["blocks.0", "blocks.1"]  # not blocks.0.lin
    assert [(t.layer, t.path) for t in lm.targets["core_attn"]] == [(0, "blocks.0"), (1, "blocks.1")]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({}, "exactly one"),
        ({"every": 1, "layers": [0]}, "exactly one"),
        ({"every": 0}, "every must be"),
        ({"layers": [7]}, r"not layer indices of Qwen2ForCausalLM \(0..2\)"),
        ({"layers": [1, 1]}, "repeated"),
    ],
)
def test_checkpoint_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rlmem.checkpoint(make("qwen2"), **kwargs)


def test_checkpoint_twice_is_refused():
    model = make("qwen2")
    rlmem.checkpoint(model, layers=[0])
    with pytest.raises(ValueError, match="already checkpointed"):
        rlmem.checkpoint(model, every=1)


@pytest.mark.cuda
def test_forced_stream_races_give_equal_gradients(monkeypatch):
    """Copies delayed on their streams (a device-side sleep queued first) must still be waited for."""
    ref = run(make("qwen2", "cuda"), steps=2)
    orig_off, orig_re = ActivationOffloader._offload, ActivationOffloader._reload

    def slow_off(self, *a, **k):
        with torch.cuda.stream(self._copies._d2h):
            torch.cuda._sleep(2_000_000)
        return orig_off(self, *a, **k)

    def slow_re(self, e):
        with torch.cuda.stream(self._copies._h2d):
            torch.cuda._sleep(2_000_000)
        return orig_re(self, e)

    monkeypatch.setattr(ActivationOffloader, "_offload", slow_off)
    monkeypatch.setattr(ActivationOffloader, "_reload", slow_re)
    model = make("qwen2", "cuda")
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    assert_same(ref, run(model, off, steps=2))
    assert off.stats().reloaded_bytes > 0


@pytest.mark.cuda
def test_copies_follow_the_users_stream_and_leave_it_current():
    """Forward and backward on a stream of the user's, each layer's kernels held back by a device-side
    sleep queued first: a copy ordered after any other stream would read its tensor before it is written.
    After every copy the user's stream is current again."""
    ref = run(make("qwen2", "cuda"), steps=2)
    model = make("qwen2", "cuda")
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(2_000_000))
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    user = torch.cuda.Stream()
    current = []
    copy_out = off._copies.copy_out

    def spy(src, host):
        done = copy_out(src, host)
        current.append(torch.cuda.current_stream() == user)
        return done

    off._copies.copy_out = spy
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        got = run(model, off, steps=2)
        assert torch.cuda.current_stream() == user
    torch.cuda.current_stream().wait_stream(user)
    torch.cuda.synchronize()
    assert_same(ref, got)
    assert current and all(current)
    assert off.stats().reloaded_bytes > 0


@pytest.mark.cuda
def test_device_memory_is_freed_during_forward():
    from rlmem.activations.offloader import RELEASE_LAG

    layers = 6
    model = make("qwen2", "cuda", layers)
    ids = torch.randint(0, 97, (8, 512), device="cuda")

    def fwd_mem(ctx):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with ctx:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            torch.cuda.synchronize()
            if isinstance(ctx, ActivationOffloader):
                ctx._poll()
            held = torch.cuda.memory_allocated() - base
            loss.backward()
        return held

    plain = fwd_mem(contextlib.nullcontext())
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    fwd_mem(off)
    held = fwd_mem(off)
    # All but the last layers' (kept for backward, which needs them first).
    assert held <= plain - 0.8 * off.stats().offloaded_bytes * (layers - RELEASE_LAG) / layers


def _asynchronous(completed: bool) -> type:
    """The host backend's copies, reporting each one in flight or completed as a GPU's would."""
    from rlmem.activations._transfer import HostCopies

    class Asynchronous(HostCopies):
        asynchronous = True

        @staticmethod
        def done(event):
            return completed

    return Asynchronous


@pytest.mark.parametrize("completed", [False, True], ids=["copies-in-flight", "copies-completed"])
def test_in_place_change_of_a_tensor_kept_on_the_device(completed):
    """The last layers' tensors stay on the device until backward: changed in place after their copy was
    seen complete, the copy serves the saved value; changed while in flight, it is an error."""

    def offloader(net):
        off = rlmem.offload_activations(net, ["core_attn"], min_bytes=0, module_map=MAP)
        off._copies = _asynchronous(completed)(off.device)
        return off

    if not completed:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _modified_after_forward("cpu", offloader)
        return
    ref = _net_grads("cpu")
    got = _modified_after_forward("cpu", offloader)
    for a, b in zip(ref, got[: len(ref)], strict=False):
        assert torch.equal(a, b)


@pytest.mark.parametrize("completed", [False, True], ids=["copies-in-flight", "copies-completed"])
def test_the_last_layers_are_used_where_they_are_not_reloaded(completed):
    """Asynchronous copies (the host backend's, reporting each copy in flight or completed): the forward pass
    lets go of a layer's device tensors two layers later, or once seen copied, but never of the last two
    layers', which backward needs first; it uses them where they are and reloads the others."""
    from rlmem.activations.offloader import RELEASE_LAG

    layers = 6
    ref = run(make("qwen2", layers=layers))
    model = make("qwen2", layers=layers)
    off = rlmem.offload_activations(model, ["core_attn"], min_bytes=0)
    off._copies = _asynchronous(completed)(off.device)
    assert_same(ref, run(model, off))
    st = off.stats()
    per_layer = st.offloaded_bytes // layers
    assert st.reloaded_bytes == (layers - RELEASE_LAG) * per_layer
    assert st.served_resident > 0 and st.reloaded_prefetched > 0 and st.reloaded_on_demand == 0


@pytest.mark.cuda
def test_memory_is_freed_in_stream_order_while_the_host_runs_ahead():
    """The allocator counts in host order and the host runs ahead of the device: copies must be released
    by stream-ordered waits, not when the host happens to see them complete."""
    from rlmem.activations.offloader import RELEASE_LAG

    layers = 6
    model = make("qwen2", "cuda", layers)
    ids = torch.randint(0, 97, (8, 512), device="cuda")

    def forward_held(ctx):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda._sleep(500_000_000)  # the device starts late: the host issues the whole forward first
        with ctx:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            held = torch.cuda.memory_allocated() - base  # no sync: what the allocator sees now
            loss.backward()
        torch.cuda.synchronize()
        return held

    plain = forward_held(contextlib.nullcontext())
    off = rlmem.offload_activations(model, ["core_attn"], min_bytes=0)
    forward_held(off)
    held = forward_held(off)
    st = off.stats()
    per_layer = st.offloaded_bytes / layers
    assert st.offloaded_bytes > 0
    assert st.copying_at_backward_bytes <= RELEASE_LAG * per_layer
    assert st.held_elsewhere_bytes == 0
    assert held <= plain - (layers - RELEASE_LAG) * per_layer
    # The last layers' tensors were never let go in the forward pass: backward uses them where they are
    # (it needs them first; a reload would hold it up), and reloads the others one layer ahead.
    assert st.reloaded_bytes == pytest.approx(st.offloaded_bytes - RELEASE_LAG * per_layer)
    assert st.served_resident > 0 and st.reloaded_on_demand == 0


@pytest.mark.cuda
def test_cuda_graph_capture_is_refused():
    model = make("qwen2", "cuda")
    off = rlmem.offload_activations(model, DENSE, min_bytes=0)
    ids = torch.randint(0, 97, (2, 24), device="cuda")
    run(model)  # warm up kernels outside the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with (
        torch.cuda.stream(s),
        pytest.raises(RuntimeError, match="CUDA graph"),
        torch.cuda.graph(g, stream=s),
        off,
    ):
        model(input_ids=ids, use_cache=False)
