"""HFSampler: a Hugging Face model sampling into a static KV cache that lives in a Region."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _models import PROMPTS, grouped_model, near_greedy, reference, tiny_qwen2  # noqa: E402

from rlmem import OffloadConfig, PhaseManager  # noqa: E402
from rlmem.rollout.sampler import HFSampler, kv_bytes_per_token  # noqa: E402


def test_batched_greedy_matches_unbatched_generate(device):
    model = tiny_qwen2(device)
    s = HFSampler(model, max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2)
    got = s.generate(PROMPTS, max_new_tokens=10, temperature=0)
    assert got == [reference(model, p, 10) for p in PROMPTS]
    assert len({tuple(g) for g in got}) > 1  # not a degenerate model
    assert s.tokens_generated == sum(len(g) for g in got)


def test_a_model_left_training_samples_as_in_eval_and_stays_training(device):
    # TRL hands its model over in training mode with gradient checkpointing on: sampling must see neither
    # dropout nor the checkpointing that makes transformers' layers drop the KV cache.
    model = tiny_qwen2(device)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    want = [reference(model, p, 10) for p in PROMPTS]  # eval mode
    model.gradient_checkpointing_enable()
    model.train()
    s = HFSampler(model, max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2)
    assert s.generate(PROMPTS, max_new_tokens=10, temperature=0) == want
    assert all(m.training for m in model.modules())


def test_cache_lives_in_the_region_and_sleeps(device):
    model = tiny_qwen2(device)
    s = HFSampler(model, max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2)
    r = s.region
    ptrs = [t.data_ptr() for layer in s.cache.layers for t in (layer.keys, layer.values)]
    assert all(r.data_ptr <= p < r.data_ptr + r.nbytes for p in ptrs)
    first = s.generate(PROMPTS, max_new_tokens=6, temperature=0)
    s.sleep()
    assert r.paused and r.resident_bytes == 0
    with pytest.raises(RuntimeError, match="asleep"):
        s.generate(PROMPTS, max_new_tokens=6)
    s.wake()
    assert [t.data_ptr() for layer in s.cache.layers for t in (layer.keys, layer.values)] == ptrs
    assert s.generate(PROMPTS, max_new_tokens=6, temperature=0) == first


def test_sampling_is_reproducible_with_a_seed(device):
    s = HFSampler(tiny_qwen2(device), max_len=24, batch_size=3, pad_token_id=0, eos_token_id=2)
    a = s.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    torch.rand(5)  # the global RNG does not matter
    b = s.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    c = s.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=4)
    assert a == b != c


def test_tiny_top_p_is_greedy_and_temperature_follows_the_softmax(device):
    model = tiny_qwen2(device)
    s = HFSampler(model, max_len=24, batch_size=5, pad_token_id=0, eos_token_id=2)
    greedy = s.generate(PROMPTS, max_new_tokens=6, temperature=0)
    assert s.generate(PROMPTS, max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=1) == greedy
    # The first sampled token's frequencies over many draws follow softmax(logits / T).
    prompt = PROMPTS[2]
    with torch.no_grad():
        logits = model(torch.tensor([prompt], device=device)).logits[0, -1].float().cpu()
    draws = s.generate([prompt] * 2000, max_new_tokens=1, temperature=2.0, seed=0)
    freq = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=logits.numel()).double() / 2000
    assert (freq - torch.softmax(logits.double() / 2.0, -1)).abs().max() < 0.04


def test_bad_sampling_arguments():
    s = HFSampler(tiny_qwen2("cpu"), max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2)
    for kwargs, name in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 2, "top_p": 0.0}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=name):
            s.generate(PROMPTS, **kwargs)
    with pytest.raises(ValueError, match="at least one token"):
        s.generate([[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="sync_every"):
        HFSampler(tiny_qwen2("cpu"), max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2, sync_every=0)
    with pytest.raises(ValueError, match=r"event must be a torch\.cuda\.Event, got object"):
        s.order_after(object())


@pytest.mark.cuda
def test_bf16_autocast_cache_is_half_the_bytes():
    model = tiny_qwen2("cuda")
    s32 = HFSampler(model, max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2)
    s16 = HFSampler(
        model, max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, compute_dtype=torch.bfloat16
    )
    assert s16.cache.layers[0].keys.dtype == torch.bfloat16

    def cache_bytes(s):
        return sum(
            t.numel() * t.element_size() for layer in s.cache.layers for t in (layer.keys, layer.values)
        )

    assert 2 * cache_bytes(s16) == cache_bytes(s32)
    out = s16.generate(PROMPTS, max_new_tokens=6, temperature=0)
    assert len(out) == len(PROMPTS) and all(1 <= len(o) <= 6 for o in out)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_autocast_over_fp32_weights_writes_the_cache_in_the_compute_dtype(family, device):
    """Under autocast Qwen3's key RMSNorm (an fp32 weight times bf16) gives fp32 keys beside bf16 values: the
    static cache took the keys' dtype and a bf16 write failed, or kept fp32 keys. Every layer now holds both
    in the compute dtype, and the model computes as in training: greedy tokens are ``generate()``'s under
    the same autocast (fp16: bf16 leaves near-ties on these random models), or with the fused projections
    (whose GEMM rounds its own way: on an H200 one near-tie of qwen2 flipped) each a near-greedy choice."""
    model = grouped_model(family, device)
    prompts = [[5, 9, 3], [7, 1, 4, 4, 8], [11, 12], [20]]
    for dtype in (torch.bfloat16, torch.float16):
        for fused in ("off", "on"):
            kw = dict(compute_dtype=dtype, fused=fused)
            s = HFSampler(model, max_len=32, batch_size=4, pad_token_id=0, eos_token_id=2, **kw)
            got = s.generate(prompts, max_new_tokens=10, temperature=0)
            dtypes = {t.dtype for layer in s.cache.layers for t in (layer.keys, layer.values)}
            assert dtypes == {dtype}, (dtype, fused)
            if dtype == torch.float16:
                with torch.autocast(device, dtype=dtype):
                    if fused == "off":
                        assert got == [reference(model, p, 10) for p in prompts]
                    else:  # a fused GEMM rounds its own way: a near-tie may flip, no far token is chosen
                        assert all(not near_greedy(model, p, g) for p, g in zip(prompts, got, strict=True))


class _NoCacheLM(torch.nn.Module):
    """Logits from embeddings alone: its forward never writes the cache it is given."""

    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.config = tiny_qwen2("cpu").config
        self.embed = torch.nn.Embedding(14, 8)
        self.head = torch.nn.Linear(8, 14)
        self.broken = broken

    def forward(self, input_ids, **kwargs):
        if self.broken:
            raise TypeError("forward() got an unexpected keyword argument 'logits_to_keep'")
        return transformers.modeling_outputs.CausalLMOutput(logits=self.head(self.embed(input_ids)))


def test_a_model_it_cannot_sample_from_is_refused_at_start():
    with pytest.raises(ValueError, match=r"_NoCacheLM: its layer 0 wrote no keys and values"):
        HFSampler(_NoCacheLM(), max_len=16, batch_size=2, pad_token_id=0, eos_token_id=2)
    with pytest.raises(ValueError, match=r"cannot sample from _NoCacheLM: .*TypeError: .*logits_to_keep"):
        HFSampler(_NoCacheLM(broken=True), max_len=16, batch_size=2, pad_token_id=0, eos_token_id=2)


def test_size_from_a_budget_and_bad_sizes():
    model = tiny_qwen2("cpu")
    per_seq = kv_bytes_per_token(model.config, torch.float32) * 20
    assert per_seq == 2 * 2 * 2 * 16 * 4 * 20
    s = HFSampler(model, max_len=20, kv_budget_bytes=3 * per_seq + 7, pad_token_id=0, eos_token_id=2)
    assert s.batch_size == 3
    with pytest.raises(ValueError, match="kv_budget_bytes must hold at least one sequence"):
        HFSampler(model, max_len=20, kv_budget_bytes=per_seq - 1, pad_token_id=0, eos_token_id=2)
    with pytest.raises(ValueError, match="max_len"):
        HFSampler(model, max_len=1, batch_size=1, pad_token_id=0, eos_token_id=2)
    with pytest.raises(ValueError, match="exceeds max_len=20"):
        s.generate([[1] * 15], max_new_tokens=8)


def test_phase_manager_sleeps_it_in_train_and_wakes_it_for_rollout(device):
    model = tiny_qwen2(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True, params="keep"))
    s = HFSampler(model, max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2)
    pm.add_engine(s)
    with pm.rollout():
        out = s.generate(PROMPTS[:2], max_new_tokens=4, temperature=0)
    with pm.train():
        assert s.region.paused and s.region.resident_bytes == 0
        ids = torch.tensor([PROMPTS[0] + out[0]], device=device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    with pm.rollout():
        assert not s.region.paused
        s.generate(PROMPTS[:2], max_new_tokens=4, temperature=0)


@pytest.mark.cuda
def test_the_cache_is_never_held_twice():
    # The cache goes straight into the Region: PyTorch's allocator never holds a full-batch copy.
    model = tiny_qwen2("cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s = HFSampler(model, max_len=512, batch_size=256, pad_token_id=0, eos_token_id=2)
    assert s.kv_bytes >= 256 * 512 * kv_bytes_per_token(model.config, torch.float32)
    assert torch.cuda.max_memory_allocated() - base < s.kv_bytes / 20


def test_sampler_follows_the_engine_protocol(device):
    model = tiny_qwen2(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True, params="keep"))
    s = HFSampler(model, max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2)
    pm.add_engine(s)
    s.sleep(level=2)
    seen = []
    with pm.rollout(sync_weights=lambda: seen.append((s.region.paused, pm.state.paused("optimizer")))):
        assert not s.region.paused
        assert s.generate(PROMPTS[:2], max_new_tokens=4, temperature=0)
    assert seen == [(True, False)]  # synced before the train state left and before the cache woke
    with pm.train():
        assert s.region.paused
    with pytest.raises(ValueError, match="unknown tag"):
        s.wake(tags=["gpu"])
    with pytest.raises(ValueError, match="tags must be None or a non-empty list"):
        s.wake(tags="kv_cache")
    with pytest.raises(ValueError, match="level must be one of 1, 2"):
        s.sleep(level=0)
    s.wake(tags=["weights"])  # the caller's model: nothing to take
    assert s.region.paused
    s.wake(tags=["kv_cache"])
    assert not s.region.paused


def test_cuda_graphs_config_is_checked():
    with pytest.raises(ValueError, match="cuda_graphs must be one of 'auto', 'on', 'off'"):
        HFSampler(
            tiny_qwen2("cpu"), max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2, cuda_graphs="yes"
        )
    with pytest.raises(ValueError, match="cuda_graphs='on' needs a model on a CUDA device"):
        HFSampler(
            tiny_qwen2("cpu"), max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2, cuda_graphs="on"
        )
    s = HFSampler(tiny_qwen2("cpu"), max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2)
    assert not s.cuda_graphs  # auto: off on the host
    assert s.kv_block == 64  # max_len / 8 rounded up to a multiple of 64: one bucket, the whole cache
    assert s.capture() == 0.0 and s.captures == 0  # nothing to capture without graphs
    for bad in (0, 12, 2.5):
        with pytest.raises(ValueError, match="kv_block must be a positive multiple of 8"):
            HFSampler(
                tiny_qwen2("cpu"), max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2, kv_block=bad
            )


def test_decode_attends_over_its_length_bucket_only(device):
    # A step reads the cache columns of its length bucket, not the whole cache; tokens stay generate()'s.
    model = tiny_qwen2(device)
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8)
    s = HFSampler(model, cuda_graphs="off", **kw)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(s.cache.layers[0].keys.shape[2]))
    got = s.generate(PROMPTS[:4], max_new_tokens=12, temperature=0)
    hook.remove()
    assert got == [reference(model, p, 12) for p in PROMPTS[:4]]
    width = max(len(p) for p in PROMPTS[:4])
    # the prefill over the whole cache, then each step over the bucket that holds its new column
    assert seen[0] == 24 and len(seen) > 2
    assert seen[1:] == [min(24, -(-(width + t + 1) // 8) * 8) for t in range(len(seen) - 1)]
    assert 8 in seen and 16 in seen


@pytest.mark.cuda
def test_cuda_graph_decode_is_eager_decode_and_survives_sleep_and_train():
    model = tiny_qwen2("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True))
    # one batch at a time (kept-full batches: test_slots), a full batch and a partial one
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8, refill=False)
    eager = HFSampler(model, cuda_graphs="off", fused="on", **kw)
    graphs = HFSampler(model, cuda_graphs="on", **kw)
    pm.add_engine(graphs)

    def both(s):
        return (
            s.generate(PROMPTS, max_new_tokens=10, temperature=0),
            s.generate(PROMPTS, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7),
        )

    want = both(eager)
    assert both(graphs) == want  # 5 prompts: a batch of 4 and a partial batch of 1 (buckets 4 and 1)
    captured = graphs.captures  # per rows bucket, one graph per cache-length bucket the steps reached
    assert captured == sum(len(d.graphs) for d in graphs._decoders.values())
    assert sorted(graphs._decoders) == [1, 4] and all(len(d.graphs) >= 2 for d in graphs._decoders.values())
    for _ in range(3):  # the train phase between rollouts: the cache sleeps, the weights leave and come back
        with pm.train():
            pm.state.synchronize()
        with pm.rollout():
            pass
        with pm.train():
            pm.state.synchronize()
        graphs.wake()
        assert both(graphs) == want
        graphs.sleep()
    assert graphs.captures == captured  # nothing re-captured
    graphs.wake()
    pm.state.close()  # the weights move back to PyTorch's allocator: the graphs are stale and re-captured
    assert both(graphs) == want and graphs.captures == 2 * captured


@pytest.mark.cuda
def test_capture_up_front_covers_every_bucket():
    model = tiny_qwen2("cuda")
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8)
    want = HFSampler(model, cuda_graphs="off", fused="on", **kw).generate(
        PROMPTS, max_new_tokens=10, temperature=0
    )
    s = HFSampler(model, cuda_graphs="on", **kw)
    assert s.capture() > 0
    assert s.captures == 3 * 3  # rows 1, 2 and 4 over lengths 8, 16 and 24
    assert s.generate(PROMPTS, max_new_tokens=10, temperature=0) == want
    assert s.captures == 9 and s.graph_pool_bytes > 0
    one = HFSampler(model, cuda_graphs="on", **kw)
    one.generate([[1, 5]], max_new_tokens=3, temperature=0)
    assert one.captures == 1
    # The graphs share their pool's memory (one capture stream: freed blocks are reused across graphs).
    assert s.graph_pool_bytes <= 2 * one.graph_pool_bytes
    s.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        s.capture()
    pool = tuple(s._pool)
    s.wake()
    s.sleep(level=2)  # the graphs stay through either level
    s.wake()
    assert s.generate(PROMPTS, max_new_tokens=10, temperature=0) == want and s.captures == 9
    assert s.drop_graphs() > 0  # the graphs and their pool go
    assert s.graph_pool_bytes == 0
    assert not [g for g in torch.cuda.memory_snapshot() if tuple(g.get("segment_pool_id", ())) == pool]
    s.wake()
    assert s.generate(PROMPTS, max_new_tokens=10, temperature=0) == want and s.captures > 9


@pytest.mark.cuda
@pytest.mark.parametrize("refill", [False, True])
def test_cuda_graphs_follow_weights_that_move_during_the_prefill(refill):
    # As FSDP2 does: the first forward of a rollout gathers the weights into new storage. Graphs captured
    # over last rollout's storage must not replay over this one's.
    model = tiny_qwen2("cuda")
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, refill=refill)
    want = HFSampler(model, cuda_graphs="off", fused="on", **kw).generate(
        PROMPTS, max_new_tokens=10, temperature=0
    )
    graphs = HFSampler(model, cuda_graphs="on", **kw)
    keep = []  # the old storage stays allocated (and unchanged): a stale graph would read it silently

    def move(module, args):
        if getattr(module, "moved", False):
            return
        module.moved = True
        for p in module.parameters():
            keep.append(p.data)
            p.data = p.data.clone()

    hook = model.register_forward_pre_hook(move)
    for _ in range(3):
        model.moved = False
        with torch.no_grad():
            for old in keep:
                old.zero_()  # stale reads would now see zeros
        assert graphs.generate(PROMPTS, max_new_tokens=10, temperature=0) == want
    hook.remove()
    # captured again each time the weights moved: two buckets of rows one batch at a time (4 and 1), one
    # kept full (4)
    assert graphs.captures == (3 if refill else 6)
    assert graphs.graph_pool_bytes > 0  # the pool of the graphs alive now, counted for the timeline


def test_rollout_copy_in_its_own_dtype_and_region(device):
    model = tiny_qwen2(device)
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2)
    s = HFSampler(model, rollout_dtype=torch.bfloat16, **kw)
    # the model's parameters themselves in bf16 (buffers such as the rotary table stay fp32, as the copy
    # leaves them), run as the copy is: under bf16 autocast
    bf16 = tiny_qwen2(device)
    for p in bf16.parameters():
        p.data = p.data.to(torch.bfloat16)
    ref = HFSampler(bf16, compute_dtype=torch.bfloat16, **kw)
    want = ref.generate(PROMPTS, max_new_tokens=8, temperature=0)
    assert s.generate(PROMPTS, max_new_tokens=8, temperature=0) == want
    assert all(w.dtype == torch.bfloat16 for w in s.weights.values())
    assert s.weights_region.resident_bytes > 0
    s.sleep(level=1)  # copy kept in host memory
    assert s.weights_region.resident_bytes == 0 and s.region.resident_bytes == 0
    s.wake(tags=["weights"])
    s.wake(tags=["kv_cache"])
    assert s.generate(PROMPTS, max_new_tokens=8, temperature=0) == want
    s.sleep(level=2)  # copy discarded: sampling refuses until synced again
    s.wake()
    with pytest.raises(RuntimeError, match="discarded"):
        s.generate(PROMPTS, max_new_tokens=8)
    with torch.no_grad():  # a training step moved the weights: the copy follows at the next sync
        for p in model.parameters():
            p.mul_(-1)
    s.sync_weights()
    with torch.no_grad():
        for p in ref.model.parameters():
            p.mul_(-1)
    assert s.generate(PROMPTS, max_new_tokens=8, temperature=0) == ref.generate(
        PROMPTS, max_new_tokens=8, temperature=0
    )
    s.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        s.sync_weights()
    with pytest.raises(ValueError, match=r"rollout_dtype must be a floating torch\.dtype"):
        HFSampler(model, rollout_dtype=torch.int8, **kw)


def test_fused_pieces_are_the_models_own_arithmetic():
    # Off a GPU the fused functions run uncompiled: op for op the model's own, so logits are bit-equal;
    # inside the block the known modules are swapped, outside nothing is left of it.
    from rlmem.rollout.sampler import _fused

    model = tiny_qwen2("cpu")
    modeling = transformers.models.qwen2.modeling_qwen2
    rope = modeling.apply_rotary_pos_emb
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want = model(ids).logits
        with _fused.fused(model, _fused.kernels(torch.device("cpu"))) as swapped:
            assert swapped == 2 * 3 + 1 + 1  # two norms and an MLP per layer, the final norm, one rotary file
            assert modeling.apply_rotary_pos_emb is _fused.rotary
            got = model(ids).logits
    assert torch.equal(got, want)
    assert modeling.apply_rotary_pos_emb is rope
    assert all("forward" not in vars(m) for m in model.modules())
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2)
    assert not HFSampler(model, **kw).fused  # auto: with CUDA graphs only
    on = HFSampler(model, fused="on", **kw)
    assert on.generate(PROMPTS, max_new_tokens=8, temperature=0) == [reference(model, p, 8) for p in PROMPTS]
    with pytest.raises(ValueError, match="fused must be one of 'auto', 'on', 'off'"):
        HFSampler(model, fused="yes", **kw)


def test_fused_leaves_other_models_alone():
    from rlmem.rollout.sampler import _fused

    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=14, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with _fused.fused(model, _fused.kernels(torch.device("cpu"))) as swapped:
        assert swapped == 0
    assert all("forward" not in vars(m) for m in model.modules())


@pytest.mark.cuda
def test_an_overlapped_switch_samples_while_the_optimizer_states_are_copied():
    def run(overlap: bool):
        model = tiny_qwen2("cuda")
        # 1 GiB of optimizer states beside the model: their copies to host memory take tens of ms
        model.register_parameter("ballast", torch.nn.Parameter(torch.zeros(128 << 20, device="cuda")))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = OffloadConfig(offload_during_rollout=True, params="keep", overlap_offload=overlap)
        pm = PhaseManager(model, opt, config)
        s = HFSampler(model, max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2)
        pm.add_engine(s)
        outs, overlapped = [], []
        for step in range(3):
            with pm.train():
                ids = torch.tensor([PROMPTS[0]], device="cuda")
                model(input_ids=ids, labels=ids).loss.backward()
                model.ballast.grad = torch.full_like(model.ballast, 1e-3)
                opt.step()
                opt.zero_grad()
            with pm.rollout():
                overlapped.append(pm.stats().switches.overlapped)
                outs.append(s.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=step))
        pm.state.synchronize()
        return outs, overlapped, opt.state[model.ballast]["exp_avg"].clone()

    plain, never, kept = run(False)
    got, overlapped, kept_overlapped = run(True)
    assert got == plain and torch.equal(kept, kept_overlapped)
    assert never == [False] * 3
    # the first rollout has taken no measure of its memory yet and waits; the later ones start at once
    assert overlapped == [False, True, True]


def _fsdp_sampler(tmp_path, backend: str, device: str, world: int) -> dict:
    import json
    from pathlib import Path

    from _helpers import run_ranks

    out = tmp_path / "out.json"
    proc = run_ranks(Path(__file__).parent / "_fsdp_sampler.py", backend, device, str(out), str(world))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check_fsdp_copy(res: dict) -> None:
    # three rollouts, a training step of both models before the second and third
    assert res["same"] == [True, True, True]  # the sharded model's copy samples as the unsharded model's
    assert res["params_equal"]  # the training itself went the same way on both
    assert res["fsdp_forwards"] == [0, 0, 0]  # FSDP's forward (and its all-gathers) never ran to sample
    assert res["copy_is_bf16"] and res["copy_bytes"] >= res["full_bytes_bf16"]  # the full weights per rank
    assert res["copy_bits_equal"] and res["gathered_dtypes"] == ["torch.bfloat16"]  # cast, then gathered
    assert 0 < res["gathers"] < res["params"]  # many parameters in one all-gather


def test_fsdp2_rollout_copy_samples_the_full_weights_without_fsdp(tmp_path):
    res = _fsdp_sampler(tmp_path, "gloo", "cpu", 2)
    _check_fsdp_copy(res)
    assert res["captures"] == [0, 0, 0]


@pytest.mark.cuda
def test_fsdp2_rollout_copy_keeps_its_graphs_through_training(tmp_path):
    # Without the copy, FSDP's gathered weights land at new addresses each rollout and every graph would be
    # captured again; the copy's Region keeps its addresses through a level-2 sleep and the re-sync.
    res = _fsdp_sampler(tmp_path, "nccl", "cuda", 1)
    _check_fsdp_copy(res)
    assert res["captures"][0] > 0 and len(set(res["captures"])) == 1


# three Gloo ranks (rows left over), and a rank per GPU (named world<n>, as the other GPU runs: -k world4)
_COPY_FULL_RANKS = [
    pytest.param(("gloo", "cpu", 3), id="cpu-world3"),
    *(pytest.param(("nccl", "cuda", n), marks=pytest.mark.gpus(n), id=f"world{n}") for n in (2, 4)),
]


@pytest.mark.parametrize("ranks", _COPY_FULL_RANKS)
def test_copy_full_buckets_are_bit_for_bit_the_gathers_one_by_one(tmp_path, ranks):
    # FSDP2's shards (on dim 0, over a one-dimensional mesh) are gathered many to an all-gather; uneven rows,
    # fewer rows than ranks and no rows at all land where one gather per parameter puts them. A DTensor
    # replicated or sharded on another dim is gathered alone, and a plain tensor copied.
    import json
    from pathlib import Path

    from _helpers import run_ranks

    out = tmp_path / "out.json"
    script = Path(__file__).parent / "_copy_full.py"
    backend, device, world = ranks
    proc = run_ranks(script, backend, device, str(out), str(world), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 6 and all(c["same"] for c in cases), cases
    assert {c["dtypes"][0] for c in cases} == {"torch.bfloat16", "torch.float32"}  # cast before the gather
    assert all(len(c["dtypes"]) == 1 for c in cases)
    by_size = {(c["dtype"], c["bucket_bytes"]): c["gathers"] for c in cases}
    for dtype in ("torch.bfloat16", "torch.float32"):
        # a bucket per parameter (9 sharded on dim 0, one of them without rows), then fewer, then one bucket
        assert by_size[dtype, 1] == 9 and 1 < by_size[dtype, 96] < 9 and by_size[dtype, 1 << 20] == 1
