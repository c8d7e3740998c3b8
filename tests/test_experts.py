"""HFSampler over mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE): greedy tokens equal to
transformers' own at every precision the recipe offers; the experts' capturable form
(``rollout/sampler/_experts.py``) computes what transformers' grouped dispatch computes; a decode step that
cannot be captured runs eagerly with one warning and leaves the process as it was
(``rollout/sampler/_graphs.py``); on a GPU the captured steps equal the eager ones at every precision."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _models import near_greedy, reference  # noqa: E402

from rlmem.rollout.sampler import (  # noqa: E402
    HFSampler,
    _experts,
    _graphs,
)
from rlmem.rollout.sampler._graphs import CaptureError  # noqa: E402

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 8], [11, 12], [20], [3, 3, 3, 3]]
_SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


def moe_model(family: str, device: str = "cpu") -> torch.nn.Module:
    """A 2-layer ``family`` model with 8 experts (4 for Mixtral), 2 per token, its weights scaled up so that
    its logits (and its routers' choices) are far from ties."""
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, **_SIZES
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **_SIZES
        )
        cls = transformers.MixtralForCausalLM
    else:
        sizes = {k: v for k, v in _SIZES.items() if k != "head_dim"}
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            **sizes,
        )
        cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.eval()


def _dense() -> torch.nn.Module:
    """A dense Qwen2 of the same sizes."""
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**dict(_SIZES, intermediate_size=64))
    ).eval()


@contextlib.contextmanager
def _no_fallback() -> Iterator[None]:
    """The block says nothing of a decode step it could not capture."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if "cannot be captured" in str(w.message)]


def _autocast(device: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


# The recipe's settings (precision, rollout_dtype) as the sampler gets them: the weights' dtype, the sampler's
# arguments, and what transformers' generate() runs for the same arithmetic (a model in the copy's dtype,
# under the same autocast).
SETTINGS = {
    "fp32": (torch.float32, {}, None, None),
    "bf16-mixed/none": (torch.float32, dict(compute_dtype=torch.bfloat16), None, torch.bfloat16),
    "fp16-mixed/none": (torch.float32, dict(compute_dtype=torch.float16), None, torch.float16),
    "bf16-mixed/bf16": (torch.float32, dict(rollout_dtype=torch.bfloat16), torch.bfloat16, torch.bfloat16),
    "fp16-mixed/fp16": (torch.float32, dict(rollout_dtype=torch.float16), torch.float16, torch.float16),
    "bf16": (torch.bfloat16, {}, None, None),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_samples_as_generate_at_every_precision(family):
    """Prompts through rows kept full (5 prompts, 3 rows): greedy tokens are ``generate()``'s for the same
    weights under the same autocast; in bf16 a batch's padding may round a near-tie its own way, so there
    each token is a greedy choice of the model fed its own tokens."""
    base = moe_model(family)
    for name, (weights, kw, copy_dtype, amp) in SETTINGS.items():
        model = base if weights == torch.float32 else copy.deepcopy(base).to(weights)
        s = HFSampler(model, max_len=32, batch_size=3, pad_token_id=0, eos_token_id=2, **kw)
        assert not s.cuda_graphs and not s._moe  # off a GPU: the model's own dispatch, eagerly
        got = s.generate(PROMPTS, max_new_tokens=10, temperature=0)
        ref = model if copy_dtype is None else copy.deepcopy(model).to(copy_dtype)
        with _autocast("cpu", amp):
            if torch.bfloat16 not in (weights, amp):
                assert got == [reference(ref, p, 10) for p in PROMPTS], name
            else:
                assert all(not near_greedy(ref, p, g) for p, g in zip(PROMPTS, got, strict=True)), name
        assert len({tuple(g) for g in got}) > 1, name  # not a degenerate model


class _Ungated(torch.nn.Module):
    """Experts without a gate, one activation between the projections (as NemotronH's)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = 4
        self.up_proj = torch.nn.Parameter(torch.randn(4, 24, 16))
        self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 24))
        self.act_fn = torch.nn.ReLU()


def _gpt_oss() -> torch.nn.Module:
    """GPT-OSS: transposed expert weights with biases, gate and up interleaved, its own clamped gate."""
    cfg = transformers.GptOssConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def test_the_capturable_form_is_the_grouped_dispatch():
    """``dense_forward`` against the experts' own (grouped) forward on random routings: bit for bit in bf16
    and fp16, within the rounding of a GEMM in fp32; over every layout transformers' experts take (gated,
    ungated, transposed with biases)."""
    from transformers.integrations.moe import use_experts_implementation

    cfg = transformers.PretrainedConfig()
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    ungated = use_experts_implementation(has_gate=False)(_Ungated)(cfg)
    modules = [_experts.experts_modules(moe_model(f))[0] for f in FAMILIES]
    modules += [ungated, _experts.experts_modules(_gpt_oss())[0]]
    assert [type(m).__name__ for m in modules[-2:]] == ["_Ungated", "GptOssExperts"]
    gen = torch.Generator().manual_seed(1)
    for m in modules:
        width = (m.gate_up_proj if m.has_gate else m.up_proj).shape[1 if m.is_transposed else 2]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            m.to(dtype)
            h = torch.randn(7, width, generator=gen).to(dtype)
            index = torch.stack([torch.randperm(m.num_experts, generator=gen)[:2] for _ in range(7)])
            w = torch.rand(7, 2, generator=gen).to(dtype)
            want = m(h, index, w)
            got = _experts.dense_forward(m, h, index, w)
            assert got.dtype == want.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
            elif type(m).__name__ != "GptOssExperts":  # its gate clamps in fp32: a GEMM's rounding shows
                assert torch.equal(got, want), (type(m).__name__, dtype)
            else:
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_through_the_capturable_form_is_generate(family):
    """``generate()`` with every experts module in the capturable form gives the same greedy tokens as with
    transformers' own dispatch, in fp32 and under bf16 autocast over fp32 weights; the swap is undone."""
    model = moe_model(family)
    found = _experts.experts_modules(model)
    assert len(found) == 2 and all("forward" not in vars(m) for m in found)  # one per layer
    for amp in (None, torch.bfloat16):
        with _autocast("cpu", amp):
            want = [reference(model, p, 8) for p in PROMPTS[:3]]
            with _experts.static_experts(model) as n:
                assert n == 2 and all("forward" in vars(m) for m in found)
                got = [reference(model, p, 8) for p in PROMPTS[:3]]
        assert got == want, amp
    assert all("forward" not in vars(m) for m in found)
    hooked = found[0]
    hooked.forward = wrapper = functools.partial(type(hooked).forward, hooked)  # as accelerate's hooks do
    with _experts.static_experts(model):
        assert hooked.forward is not wrapper
    assert hooked.forward is wrapper  # put back, not deleted


def test_the_experts_own_dispatch_is_kept_where_a_graph_can_capture_it(monkeypatch):
    """Off the grouped GEMM's bf16 kernel (here: the CPU) "grouped_mm" copies to the host, and "eager" finds
    the experts a step reached with ``nonzero``: both run the capturable form. "batched_mm" and dispatchers
    rlmem does not know keep their own, unless forced."""
    from transformers.integrations.moe import ExpertsInterface, batched_mm_experts_forward

    own = []
    ExpertsInterface.register(
        "rlmem_test_experts", lambda *a: own.append(1) or batched_mm_experts_forward(*a)
    )
    model = moe_model("qwen3_moe")
    m = _experts.experts_modules(model)[0]
    dense = []
    real = _experts.dense_forward
    monkeypatch.setattr(_experts, "dense_forward", lambda *a: dense.append(1) or real(*a))
    ids = torch.tensor([PROMPTS[1]])
    for impl, capturable in (
        ("grouped_mm", False),
        ("eager", False),
        ("batched_mm", True),
        ("rlmem_test_experts", True),
    ):
        model.config._experts_implementation = impl
        assert _experts.own_is_capturable(m, m.gate_up_proj) is capturable, impl
        for force in (False, True):
            dense.clear()
            own.clear()
            with _experts.static_experts(model, force=force):
                model(ids)
            assert len(dense) == (2 if force or not capturable else 0), (impl, force)
            assert len(own) == (2 if impl == "rlmem_test_experts" and not force else 0), (impl, force)
    model.config._experts_implementation = None  # transformers' experts then run their own loop
    assert not _experts.own_is_capturable(m, m.gate_up_proj)
    dense_model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**dict(_SIZES, intermediate_size=64))
    )
    assert _experts.experts_modules(dense_model) == []


def _failing_capture(s: HFSampler, log: list[str]):
    """A capture that runs the step it is given (noting whether the experts ran in the capturable form) and
    then fails, as transformers' grouped GEMM fails in a capture off its bf16 kernel."""

    def capture(d, length, forward, count=True):
        before = len(log)
        forward(d.ids, d.mask[..., :length], d.pos)
        log.append("dense" if len(log) > before else "own")
        raise CaptureError("RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    return capture


def test_a_step_that_cannot_be_captured_runs_eagerly_with_one_warning(monkeypatch):
    """The sampler's logic off a GPU, its capture made to fail: an MoE model whose experts' own dispatch was
    taken for capturable is tried once more with every expert in the capturable form; then the decode steps
    run eagerly, the tokens the eager sampler's, with one warning for the sampler's life; a dense model goes
    eager at its first failure."""
    model = moe_model("mixtral")
    model.config._experts_implementation = "batched_mm"  # taken for capturable: kept in the first capture
    kw = dict(max_len=32, batch_size=4, pad_token_id=0, eos_token_id=2, refill=False)
    want = HFSampler(model, **kw).generate(PROMPTS, max_new_tokens=10, temperature=0)
    s = HFSampler(model, **kw)
    log: list[str] = []
    real = _experts.dense_forward
    monkeypatch.setattr(_experts, "dense_forward", lambda *a: log.append("") or real(*a))
    s.cuda_graphs = s._moe = True  # as on a GPU (the graphs' own flag stays off: no device to synchronise)
    s._graphs.capture = _failing_capture(s, log)
    with pytest.warns(RuntimeWarning, match=r"MixtralForCausalLM cannot be captured .*Cannot copy") as caught:
        got = s.generate(PROMPTS, max_new_tokens=10, temperature=0)
    assert got == want
    assert [x for x in log if x] == ["own", "dense"]  # then eager: no third capture
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert not s.cuda_graphs and s._graphs.pool is None
    with _no_fallback():
        assert s.generate(PROMPTS, max_new_tokens=10, temperature=0) == want
    assert [x for x in log if x] == ["own", "dense"]

    dense = _dense()
    want = HFSampler(dense, **kw).generate(PROMPTS, max_new_tokens=6, temperature=0)
    s = HFSampler(dense, **kw)
    s.cuda_graphs = True
    log = []
    s._graphs.capture = _failing_capture(s, log)
    with pytest.warns(RuntimeWarning, match="Qwen2ForCausalLM cannot be captured"):
        assert s.generate(PROMPTS, max_new_tokens=6, temperature=0) == want
    assert log == ["own"] and not s._moe


def _with_experts_swapped(s: HFSampler) -> None:
    """Eager decode steps with the experts in the form the captured steps use (prefill as it is)."""
    real = s._decode

    def decode(d, length):
        with _experts.static_experts(s._runner):
            return real(d, length)

    s._decode = decode


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_captured_moe_steps_are_the_eager_ones(family, setting):
    """On a GPU at each precision and rollout dtype of the recipe (fp32 weights under bf16 or fp16 autocast
    took transformers' grouped GEMM off its bf16 kernel, which copies to the host: the capture failed):
    every decode step is a graph replay, with no warning, and the tokens, greedy and sampled, are those of
    eager steps whose experts run the same way; each greedy token is a greedy choice of the model itself."""
    base = moe_model(family, "cuda")
    weights, kw, copy_dtype, amp = SETTINGS[setting]
    model = base if weights == torch.float32 else base.to(weights)
    common = dict(max_len=32, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8, **kw)
    eager = HFSampler(model, cuda_graphs="off", fused="on", **common)
    _with_experts_swapped(eager)
    with _no_fallback():
        graphs = HFSampler(model, cuda_graphs="on", **common)
        for refill in (False, True):
            eager.refill = graphs.refill = refill
            for sampling in (dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=7)):
                want = eager.generate(PROMPTS, max_new_tokens=10, **sampling)
                assert graphs.generate(PROMPTS, max_new_tokens=10, **sampling) == want, (refill, sampling)
    # every step captured, the experts' own dispatch kept only where it was capturable
    assert graphs.cuda_graphs and graphs._moe and not graphs._all_static and graphs.captures > 0
    greedy = graphs.generate(PROMPTS, max_new_tokens=10, temperature=0)
    ref = model if copy_dtype is None else copy.deepcopy(model).to(copy_dtype)
    with _autocast("cuda", amp):
        assert all(not near_greedy(ref, p, g, rel=2e-2) for p, g in zip(PROMPTS, greedy, strict=True))


@pytest.mark.cuda
def test_moe_graphs_captured_up_front():
    """``capture()`` captures every bucket of an MoE model under autocast over fp32 weights, with no
    warning; generating afterwards captures nothing more."""
    model = moe_model("qwen3_moe", "cuda")
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8)
    with _no_fallback():
        s = HFSampler(model, compute_dtype=torch.bfloat16, cuda_graphs="on", **kw)
        s.capture()
        assert s.captures == 3 * 3 and s.graph_pool_bytes > 0  # rows 1, 2, 4 x lengths 8, 16, 24
        s.generate(PROMPTS, max_new_tokens=10, temperature=0)
    assert s.captures == 9 and s.cuda_graphs


def test_host_syncs_notes_the_calling_threads_own():
    """``host_syncs`` notes each sync torch reports in the calling thread, where the code that called it is,
    however often one line repeats it; another thread's, and other warnings, are shown as they would be; the
    warning filters are as they were after the block."""
    text = f"{_graphs._SYNC} (Triggered internally at aten/src/ATen/native/cuda/Copy.cu:1.)"
    filters = list(warnings.filters)
    lines = []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")  # once per line, but for the syncs noted
        with _graphs.host_syncs() as found:
            for _ in range(2):
                lines.append(inspect.currentframe().f_lineno + 1)
                warnings.warn(text, UserWarning, stacklevel=1)
            other = threading.Thread(target=warnings.warn, args=(text,))
            other.start()
            other.join()
            warnings.warn("not a sync", DeprecationWarning, stacklevel=1)
    here = inspect.currentframe().f_code.co_filename
    assert found == [f"{here}:{n}" for n in lines] and lines[0] == lines[1]
    assert [str(w.message) for w in shown] == [text, "not a sync"]
    assert warnings.filters == filters
    if torch.cuda.is_available():
        assert torch.cuda.get_sync_debug_mode() == 0  # put back


def test_gc_paused_puts_the_collector_back():
    """No automatic collection within ``gc_paused``; after it, the collector as it was, an error or not."""
    assert gc.isenabled()
    with pytest.raises(KeyError), _graphs.gc_paused():
        assert not gc.isenabled()
        raise KeyError("in the block")
    assert gc.isenabled()
    gc.disable()
    try:
        with _graphs.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


# tiny_qwen2's vocabulary has 14 tokens
TINY_PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 8], [11, 12], [13], [3, 3, 3, 3]]


def _hook_that_waits(kind: str):
    """A forward hook that makes a step uncapturable: it reads a value (``.item()``), copies to the host, or
    synchronises the device while a capture is underway only (which torch's sync debug mode does not see)."""

    def hook(module, args, out):
        if kind == "item":
            float(out[0].float().sum())
        elif kind == "copy":
            out[0].cpu()
        elif torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()

    return hook


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["item", "copy", "sync_in_capture"])
def test_a_step_that_cannot_be_captured_leaves_the_process_healthy(kind, monkeypatch):
    """A decode step that waits for the device cannot be captured: the sampler says so once and decodes
    eagerly, the tokens the eager sampler's. One that reads a value or copies to the host is found in its
    warm-up, with where it does, before any capture (no graph pool made); one whose capture fails all the same
    is undone. Then, in the same process: no memory of the failed capture's pool is held, another sampler
    captures every step with no warning (greedy and sampled tokens the eager sampler's), and the default CUDA
    generator draws for a seed what it drew before."""
    from _models import tiny_qwen2

    pools: list = []
    handle = torch.cuda.graph_pool_handle
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pools.append(handle()) or pools[-1])
    torch.manual_seed(11)
    drawn = torch.rand(64, device="cuda")
    model = tiny_qwen2("cuda")
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8)
    eager = HFSampler(model, cuda_graphs="off", fused="on", **kw)
    sampled = dict(temperature=1.0, top_p=0.9, seed=3)
    want = eager.generate(TINY_PROMPTS, max_new_tokens=8, temperature=0)
    want_sampled = eager.generate(TINY_PROMPTS, max_new_tokens=8, **sampled)

    hook = model.model.layers[0].register_forward_hook(_hook_that_waits(kind))
    s = HFSampler(model, cuda_graphs="on", **kw)  # fused with graphs: its eager steps are the same kernels
    with pytest.warns(RuntimeWarning, match="cannot be captured into a CUDA graph") as caught:
        assert s.generate(TINY_PROMPTS, max_new_tokens=8, temperature=0) == want
    said = [str(w.message) for w in caught if "cannot be captured" in str(w.message)]
    assert len(said) == 1 and not s.cuda_graphs and s.captures == 0 and s.graph_pool_bytes == 0
    if kind == "sync_in_capture":
        assert "captur" in said[0].split("CUDA graph", 1)[1].lower() and pools  # the capture's own error
    else:
        where = _hook_that_waits(kind).__code__.co_filename
        assert f"{_graphs._SYNC} at {where}:" in said[0] and not pools
    with _no_fallback():
        assert s.generate(TINY_PROMPTS, max_new_tokens=8, temperature=0) == want
    hook.remove()

    gc.collect()
    torch.cuda.empty_cache()
    held = {tuple(seg.get("segment_pool_id", ())) for seg in torch.cuda.memory_snapshot()}
    assert not held & {tuple(p) for p in pools}
    with _no_fallback():
        g = HFSampler(model, cuda_graphs="on", **kw)
        assert g.generate(TINY_PROMPTS, max_new_tokens=8, temperature=0) == want
        assert g.generate(TINY_PROMPTS, max_new_tokens=8, **sampled) == want_sampled
    assert g.cuda_graphs and g.captures > 0
    torch.manual_seed(11)
    assert torch.equal(torch.rand(64, device="cuda"), drawn)


@pytest.mark.cuda
def test_no_garbage_is_collected_inside_a_capture():
    """Garbage found in the middle of a step waits for the capture's end: a finalizer that synchronises the
    device (a dead sampler's Region does; this file's eager samplers are left in reference cycles) would
    break the capture. Here every step leaves such a cycle and the collector looks after every allocation:
    every step is captured all the same, with no warning, and every finalizer runs, none inside a capture."""
    from _models import tiny_qwen2

    ran: list[bool] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            ran.append(torch.cuda.is_current_stream_capturing())
            torch.cuda.synchronize()

    made: list[int] = []

    def leave_a_cycle(module, args, out):
        made.append(1)
        Cycle()

    model = tiny_qwen2("cuda")
    # fused off: nothing compiled while the collector runs that often
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8, fused="off")
    want = HFSampler(model, cuda_graphs="off", **kw).generate(TINY_PROMPTS, max_new_tokens=8, temperature=0)
    hook = model.model.layers[0].register_forward_hook(leave_a_cycle)
    thresholds = gc.get_threshold()
    gc.collect()
    # At every allocation: the young generations (a cycle outlives the collection its own allocation asks
    # for, made in its constructor, so the next one finds it), not the process's old objects.
    gc.set_threshold(1, 1, 1_000_000)
    try:
        with _no_fallback():
            s = HFSampler(model, cuda_graphs="on", **kw)
            got = s.generate(TINY_PROMPTS, max_new_tokens=8, temperature=0)
    finally:
        gc.set_threshold(*thresholds)
        hook.remove()
    gc.collect()
    assert got == want and s.cuda_graphs and s.captures > 0
    assert len(ran) == len(made) > 0 and not any(ran)
