"""A rollout engine for Hugging Face causal LMs whose KV cache lives in a Region.

``HFSampler`` is rlmem's batched sampler (temperature, top-p, EOS, max new tokens; left-padded prompts, one
prefill then one token per step) over a ``transformers.StaticCache``. The cache's per-layer key and value
tensors are re-pointed into one Region, so ``sleep()`` gives the whole cache back to the device (a discarded
pause: milliseconds) and ``wake()`` takes it again at the same addresses. Its size comes from a byte budget,
like vLLM's ``gpu_memory_utilization``.

Decode steps run from fixed buffers (token ids, positions, a prepared 4-D attention mask) into the static
cache, so on a GPU each step is one CUDA graph replay (``cuda_graphs``): one graph per batch-size bucket
(powers of two up to ``batch_size``) and cache-length bucket (multiples of ``kv_block``), captured on first
use. A step attends over the columns of its length bucket only, not the whole cache: at batch 64 the keys
and values outweigh the weights, and reading the unfilled part of the cache would double a step's bytes.
The cache's addresses never change, so the graphs survive ``sleep()`` / ``wake()`` and the train phase
between rollouts without re-capture; they are captured again only if the model's parameters or buffers move
(``captures`` counts every capture). Sampling runs after each replay on the device, with no host sync per
token.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._checks import check_choice, check_flag, check_tags
from .._dtensor import is_dtensor as _is_dtensor
from .._units import round_up
from ..memory.region import Region
from ..plan.shapes import kv_bytes_per_token as _kv_bytes
from ._fused import fused as _fused
from ._fused import kernels
from ._gqa import grouped_decode
from ._qkv import FusedQKV
from ._slots import Slots, WritePlan, row_bases, slot_writes, step_index

__all__ = ["HFSampler", "kv_bytes_per_token"]


def _kv_shape(config: Any) -> tuple[int, int, int]:
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token of a ``transformers`` config takes across all layers (keys and values)."""
    layers, kv_heads, head_dim = _kv_shape(config)
    return _kv_bytes(layers, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())


class HFSampler:
    """Batched sampling from a Hugging Face causal LM into a Region-backed static KV cache.

    Args:
        model: a ``transformers`` causal LM (its config gives the cache's shape).
        max_len: prompt plus completion tokens per sequence.
        batch_size: sequences per generate call; or None to size it from ``kv_budget_bytes``.
        kv_budget_bytes: bytes the cache may take (used when ``batch_size`` is None).
        pad_token_id, eos_token_id: the tokenizer's ids.
        compute_dtype: run the model under autocast to this dtype (the cache takes it too); None: the
            parameters' dtype.
        sync_every: tokens between the host checks that stop a batch once every row has ended.
        cuda_graphs: ``"auto"`` (default: on for CUDA), ``"on"`` or ``"off"``: decode steps as CUDA graph
            replays.
        fused: ``"auto"`` (default: on with CUDA graphs), ``"on"`` or ``"off"``: run the RMSNorms, MLP gates
            and rotary embeddings of Llama-family models (Llama, Mistral, Qwen2, Qwen3) as one compiled kernel
            each while sampling (``_fused``), and their query, key and value projections as one GEMM over a
            copy of the three weights held with the KV cache (``_qkv``: it sleeps with the cache, is refreshed
            before each generation, and ``memory()`` counts it as ``fused_weights``); other models and modules
            run as they are. The arithmetic is the model's own; the rounding of a fused reduction may differ
            in the last bit from the unfused one.
        kv_block: granularity of the cache-length buckets a decode step attends over (a multiple of 8);
            None: ``max_len / 8`` rounded up to a multiple of 64 (at most 8 buckets, graphs, per batch size).
        rollout_dtype: sample from a copy of the model's parameters in this dtype (e.g. ``torch.bfloat16``
            while training keeps fp32 weights), held in a Region of its own: ``sync_weights()`` refreshes it
            from the model (after each optimizer step), ``sleep(1)`` keeps it in pinned host memory and
            ``sleep(2)`` discards it (``sync_weights()`` again before sampling); ``wake(["weights"])`` takes
            it back. It costs ``numel x itemsize`` of device memory during rollout and one copy per sync;
            each decode step then reads the weights in that dtype, with no cast. None: the model itself.
            ``compute_dtype`` defaults to it. With a sharded model (FSDP2) the copy holds the full weights
            on each rank, gathered at each sync, and the rollout runs an unsharded twin of the model over
            it: no communication while sampling, and the CUDA graphs are captured once (over FSDP's own
            gathered weights they would be captured again at every rollout, which gathers them anew).
        weights: run the model over these tensors, by name, instead of its own parameters: e.g. another
            process's :class:`~rlmem.colocate.SharedWeights` mapped here (``AttachedWeights.tensors``),
            updated in place by their owner (``sync_weights()`` does nothing). The model may then be built
            on the meta device, with no memory of its own, if ``weights`` has its buffers too. See
            :meth:`use_weights`.
        gqa: ``"auto"`` (default): a model with fewer KV heads than query heads attends in its decode steps
            over the cache as it is, each KV head read once for its group of query heads (``_gqa``), instead
            of through transformers' copy of the cache expanded to every head; ``"off"``: as transformers
            does. The attention is SDPA's in both; only its inputs' layout differs.
        refill: with more sequences than ``batch_size`` rows, keep the batch full instead of running each
            batch until its longest sequence ends (False): rows whose sequences ended (checked every
            ``sync_every`` steps) take the next waiting ones, their prompts prefilled into those rows of the
            cache, once a quarter of the rows (or as many as wait) are idle, since each prefill costs the
            decode steps its host time. Sequences come back in the order given. Seeded sampling is
            reproducible for the same prompts, seed, ``batch_size`` and ``sync_every``; a sequence's tokens
            do not depend on which row it took.
        asleep: start asleep: the KV cache's addresses reserved, no memory taken until ``wake()`` (for a
            process that makes its sampler before it is given the device).

    Raises:
        ValueError: a size is not positive, the budget holds less than one sequence, ``kv_block`` is not a
            positive multiple of 8, or ``cuda_graphs`` is not one of the three (or ``"on"`` off a GPU).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_len: int,
        batch_size: int | None = None,
        kv_budget_bytes: int | None = None,
        pad_token_id: int,
        eos_token_id: int,
        compute_dtype: torch.dtype | None = None,
        sync_every: int = 8,
        cuda_graphs: str = "auto",
        rollout_dtype: torch.dtype | None = None,
        fused: str = "auto",
        kv_block: int | None = None,
        name: str = "kv-cache",
        weights: Mapping[str, torch.Tensor] | None = None,
        asleep: bool = False,
        gqa: str = "auto",
        refill: bool = True,
    ) -> None:
        check_choice("cuda_graphs", cuda_graphs, ("auto", "on", "off"))
        check_choice("fused", fused, ("auto", "on", "off"))
        check_choice("gqa", gqa, ("auto", "off"))
        check_flag("refill", refill)
        self.refill = refill
        self.gqa = gqa == "auto"
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive int, got {sync_every!r}")
        if kv_block is None:
            kv_block = round_up(-(-max_len // 8), 64)
        elif not isinstance(kv_block, int) or kv_block < 8 or kv_block % 8:
            raise ValueError(f"kv_block must be a positive multiple of 8 or None, got {kv_block!r}")
        if weights is not None and rollout_dtype is not None:
            raise ValueError("weights and rollout_dtype exclude each other: the weights are the rollout copy")
        param = next(model.parameters())
        if weights is not None:  # the model's own parameters may be on the meta device
            param = _first_param(model, weights)
        device = param.device
        if cuda_graphs == "on" and device.type != "cuda":
            raise ValueError(f"cuda_graphs='on' needs a model on a CUDA device; this one is on {device}")
        self.cuda_graphs = cuda_graphs != "off" and device.type == "cuda"
        self.fused = fused == "on" or (fused == "auto" and self.cuda_graphs)
        self._kernels = kernels(device) if self.fused else ()
        if rollout_dtype is not None and not (
            isinstance(rollout_dtype, torch.dtype) and rollout_dtype.is_floating_point
        ):
            raise ValueError(f"rollout_dtype must be a floating torch.dtype or None, got {rollout_dtype!r}")
        compute_dtype = compute_dtype or rollout_dtype
        dtype = compute_dtype or param.dtype
        per_seq = kv_bytes_per_token(model.config, dtype) * max_len
        if batch_size is None:
            if not isinstance(kv_budget_bytes, int) or kv_budget_bytes < per_seq:
                raise ValueError(
                    f"kv_budget_bytes must hold at least one sequence of max_len={max_len} "
                    f"({per_seq} bytes); got {kv_budget_bytes!r}"
                )
            batch_size = kv_budget_bytes // per_seq
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.model = model
        self._dtype = dtype  # what the model computes in: its attention's queries, the cache
        self._qkv: FusedQKV | None = None  # the fused projections, once the cache's Region holds them
        self.max_len = max_len
        self.kv_block = kv_block
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.compute_dtype = compute_dtype
        self.sync_every = sync_every
        self.rollout_dtype = rollout_dtype
        self.weights: dict[str, torch.Tensor] | None = None
        self.weights_region: Region | None = None
        self._weights_stale = False
        # The module the rollout runs: the model itself, or (a sharded model with a rollout copy) a twin of
        # it without FSDP's hooks, whose parameters are the copy's full tensors (see ``_twin``).
        self._runner: nn.Module = model
        # The cache's keyword: ``cache`` in transformers releases that renamed it (``past_key_values`` is
        # deprecated there), ``past_key_values`` before.
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._state: dict[str, torch.Tensor] = {}  # what functional_call runs it over: the copy (+ buffers)
        self._external = False  # the weights are someone else's (``weights=``): nothing to sync
        if weights is not None:
            self.use_weights(weights)
        if rollout_dtype is not None:
            named = dict(model.named_parameters())  # tied parameters once: functional_call ties them back
            buffers: dict[str, torch.Tensor] = {}
            if _sharded(model):
                self._runner = _twin(model)
                buffers = dict(model.named_buffers())
                _check_covers(self._runner, {**named, **buffers}, "rollout_dtype: the sharded model's")
            size = sum(round_up(p.numel() * rollout_dtype.itemsize, 256) for p in named.values())
            self.weights_region = Region(size, device, name=f"{name}/weights")
            self.weights = {n: self.weights_region.empty(p.shape, rollout_dtype) for n, p in named.items()}
            self._state = {**self.weights, **buffers}
            self.sync_weights()
        self.cache = _static_cache(model.config, max_len, dtype)
        # One forward step of a single sequence initialises every layer (shapes, dtype, device: through the
        # public path, which holds across transformers releases); each layer's tensors are then replaced by
        # views of the full batch in the Region. Probing at the full batch would hold the whole cache twice.
        # A model the sampler cannot serve fails here, at start, not in the middle of a rollout.
        self._probe(torch.full((1, 1), pad_token_id, dtype=torch.long, device=device))
        layers = self.cache.layers
        shapes = [
            ((batch_size, *t.shape[1:]), t.dtype) for layer in layers for t in (layer.keys, layer.values)
        ]
        # The fused projections' weights (``_qkv``): a copy derived from the weights, refreshed before each
        # generation, so it lives and sleeps with the cache. Not for a sharded model sampled as it is (its
        # weights are whole only inside its forward).
        if self.fused and (self.weights is not None or not _sharded(model)):
            qkv = FusedQKV(self._runner, dtype)
            self._qkv = qkv if qkv.layers else None
        extra = [(s, dtype) for s in self._qkv.shapes()] if self._qkv is not None else []
        nbytes = [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in (*shapes, *extra)]
        self.region = Region(sum(nbytes) + 256 * len(nbytes), device, name=name, paused=bool(asleep))
        views = [self.region.empty(s, d) for s, d in shapes]
        self.kv_bytes = sum(nbytes[: len(shapes)])
        self.fused_weight_bytes = sum(nbytes[len(shapes) :])
        if self._qkv is not None:
            self._qkv.bind([self.region.empty(s, d) for s, d in extra])
        for i, layer in enumerate(layers):
            layer.keys, layer.values = views[2 * i], views[2 * i + 1]
            if hasattr(layer, "batch_size"):
                layer.batch_size = batch_size
        if not asleep:  # asleep, nothing is mapped there yet (each batch resets the cache anyway)
            self.cache.reset()
        self.tokens_generated = 0
        # CUDA graphs captured so far: one per rows and length bucket, again only if the weights move
        self.captures = 0
        self._decoders: dict[int, _Decode] = {}  # by rows; with CUDA graphs, each holds its graphs
        self._pool: Any = None
        self.graph_pool_bytes = 0  # device memory the captured graphs' private pool holds
        self._after: Any = None  # order_after()'s event, for the next generate()
        self._stream: Any = None  # the sampler's own stream, made on the first order_after()
        self._capture_stream: Any = None  # where the graphs are warmed up and captured
        self._fingerprint: tuple[int, ...] = ()

    @torch.no_grad()
    def _probe(self, ids: torch.Tensor) -> None:
        """One decode step of one sequence into the cache, which initialises its layers; raises ``ValueError``
        naming why if the model cannot be sampled this way."""
        name = type(self.model).__name__
        try:
            self._forward(ids, None, None)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError) as e:
            raise ValueError(
                f"HFSampler cannot sample from {name}: one decode step into a static KV cache failed "
                f"({type(e).__name__}: {e})"
            ) from e
        for i, layer in enumerate(self.cache.layers):
            kv = (getattr(layer, "keys", None), getattr(layer, "values", None))
            if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.numel() for t in kv):
                raise ValueError(
                    f"HFSampler cannot sample from {name}: its layer {i} wrote no keys and values into the "
                    f"static KV cache (a model must call Cache.update from its attention)"
                )

    def memory(self) -> dict[str, int]:
        """Device bytes the sampler holds now, by category: ``kv_cache``, ``cuda_graphs`` (their pool),
        ``rollout_weights`` (its own copy) and ``fused_weights`` (the fused projections' copy, which lives and
        sleeps with the cache)."""
        own = self.weights_region.resident_bytes if self.weights_region is not None else 0
        fused = self.fused_weight_bytes if self.region.resident_bytes else 0
        return {
            "kv_cache": self.region.resident_bytes - fused,
            "cuda_graphs": self.graph_pool_bytes,
            "rollout_weights": own,
            "fused_weights": fused,
        }

    def use_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Sample from ``weights`` (by parameter and buffer name) from now on; the model's own buffers fill
        in those missing. The CUDA graphs are captured again on next use if the addresses differ.

        Raises:
            ValueError: a parameter or buffer missing, of another shape, or on the meta device; or the
                sampler has a rollout copy of its own.
        """
        if self.weights_region is not None:
            raise ValueError("this sampler samples from its own rollout copy (rollout_dtype)")
        if not isinstance(weights, Mapping) or not weights:
            raise ValueError("weights must be a non-empty mapping of name -> tensor")
        own = {n: b for n, b in self.model.named_buffers() if b.device.type != "meta"}
        state = {**own, **weights}
        _check_covers(self.model, state, "weights")
        meta = [n for n, t in state.items() if t.device.type == "meta"]
        if meta:
            raise ValueError(f"weights: {meta[0]!r} is on the meta device (it has no data)")
        self.weights, self._state, self._external = dict(weights), state, True

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy the model's parameters into the rollout copy (``rollout_dtype``); nothing without one.

        A sharded parameter (FSDP2, a DTensor) is gathered whole, one parameter at a time: a collective, so
        every rank syncs together, while its communicators work. A model FSDP holds gathered (``unshard()``)
        is read as it is, with no communication.

        Raises:
            RuntimeError: the copy is asleep (``wake(["weights"])`` first).
        """
        if self.weights is None or self._external:
            return
        assert self.weights_region is not None
        if self.weights_region.paused:
            raise RuntimeError("HFSampler's rollout weights are asleep: wake(['weights']) before syncing")
        for n, p in self.model.named_parameters():
            self.weights[n].copy_(p.full_tensor() if _is_dtensor(p) else p)
        self._weights_stale = False

    def sleep(self, level: int = 1) -> None:
        """Give the KV cache's memory back (its contents are not needed between rollouts), and the rollout
        copy's: kept in pinned host memory at level 1, discarded at level 2 (``sync_weights()`` after
        waking). Without a rollout copy the sampler runs on the caller's model and both levels release the
        same memory. The CUDA graphs stay at both levels (every address they read comes back the same on
        waking), and so does their memory pool: :meth:`drop_graphs` frees it.

        Raises:
            ValueError: ``level`` is not 1 or 2.
        """
        check_choice("level", level, (1, 2))
        self.region.pause(keep=False)
        if self.weights_region is not None:
            self.weights_region.pause(keep=level == 1)
            self._weights_stale = self._weights_stale or level == 2

    def drop_graphs(self) -> int:
        """Forget the CUDA graphs and hand their memory pool back to the device (captured again on the next
        use, or by :meth:`capture`).

        Returns:
            Bytes of pool released (``graph_pool_bytes`` before).
        """
        freed = self.graph_pool_bytes
        if self._decoders:
            self._drop_graphs()
            if self.cuda_graphs:  # emptying the cache hands the freed pool back to the driver
                torch.cuda.synchronize(self.region.device)
                torch.cuda.empty_cache()
        return freed

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take memory again, at the same addresses: ``"weights"`` (the rollout copy; the caller's model
        otherwise, always awake), ``"kv_cache"``; None: both (``"cuda_graph"``: nothing, the graphs' pool is
        PyTorch's).

        Raises:
            ValueError: an unknown tag.
        """
        tags = check_tags(tags)
        if self.weights_region is not None and (tags is None or "weights" in tags):
            self.weights_region.resume()
        if tags is None or "kv_cache" in tags:
            self.region.resume()

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None
    ) -> torch.Tensor:
        """Last-position logits. Under autocast the model computes as it does in training (its residual
        stream in the weights' dtype); the cache stores keys and values in the compute dtype
        (``_static_cache``)."""
        if mask is not None and mask.dim() == 4 and mask.dtype == torch.bool:
            # Additive, once per step, as SDPA would make it of a boolean mask (0 where True, -inf elsewhere)
            # in every layer, three kernels each.
            additive = torch.full(mask.shape, float("-inf"), dtype=self._dtype, device=mask.device)
            mask = additive.masked_fill_(mask, 0.0)
        kwargs = {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": pos,
            self._cache_kw: self.cache,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        swap = _fused(self._runner, self._kernels) if self.fused else contextlib.nullcontext()
        packed = grouped_decode(self._runner) if self.gqa else contextlib.nullcontext()
        qkv = self._qkv.swapped() if self._qkv is not None else contextlib.nullcontext()
        with self._autocast(ids.device), swap, packed, qkv:
            if self.weights is None:
                out = self.model(**kwargs)
            else:  # the same modules (or the sharded model's twin) over the rollout copy
                out = torch.func.functional_call(self._runner, self._state, (), kwargs, strict=False)
        return out.logits[:, -1]

    def _buckets(self) -> list[int]:
        sizes = [1 << k for k in range(self.batch_size.bit_length()) if 1 << k < self.batch_size]
        return [*sizes, self.batch_size]

    def _bucket(self, n: int) -> int:
        return next(b for b in self._buckets() if b >= n) if self.cuda_graphs else n

    def _weights_fingerprint(self) -> tuple[int, ...]:
        params = self.model.parameters() if self.weights is None else self.weights.values()
        return tuple(t.data_ptr() for t in (*params, *self.model.buffers()))

    def _drop_graphs(self) -> None:
        """Forget the graphs (the decode buffers stay, with what a generation in progress put there); PyTorch
        frees the graphs' pool once none holds it."""
        for d in self._decoders.values():
            d.graphs.clear()
        self._pool = None
        self.graph_pool_bytes = 0

    def _follow_weights(self) -> None:
        """Drop the graphs if the weights they read moved (adopted, reloaded elsewhere, or gathered anew by
        FSDP2 in the first forward of a rollout: so checked after a prefill too)."""
        if self.cuda_graphs:
            fp = self._weights_fingerprint()
            if fp != self._fingerprint:
                self._drop_graphs()
                self._fingerprint = fp

    def _check_awake(self, call: str) -> None:
        if self.region.paused or (self.weights_region is not None and self.weights_region.paused):
            raise RuntimeError(f"HFSampler is asleep: call wake() before {call}()")

    def _decoder(self, size: int) -> _Decode:
        """The fixed decode buffers of ``size`` rows (and their captured graphs, with CUDA graphs)."""
        self._follow_weights()
        d = self._decoders.get(size)
        if d is None:
            heads = self.cache.layers[0].keys.shape[1]
            d = self._decoders[size] = _Decode(size, self.max_len, heads, self.region.device)
        return d

    @torch.no_grad()
    def capture(self) -> float:
        """Capture every decode graph now, each batch-size bucket over each cache-length bucket, instead of
        on first use (as a serving engine does at start-up); the graphs read the weights where they are now.
        Nothing without CUDA graphs.

        Returns:
            Seconds it took.

        Raises:
            RuntimeError: the engine is asleep.
        """
        self._check_awake("capture")
        if not self.cuda_graphs:
            return 0.0
        t0 = time.perf_counter()
        if self._qkv is not None:
            self._qkv.refresh(self._state)
        full = [(layer.keys, layer.values) for layer in self.cache.layers]
        lengths = sorted({self._length(n) for n in range(1, self.max_len + 1)})
        try:
            self.cache.reset()
            for rows in self._buckets():
                d = self._decoder(rows)
                d.mask.zero_()
                d.mask[..., 0] = True  # a row with nothing to attend to would compute NaN
                with self._row_writes(d, full):
                    for length in lengths:
                        if length not in d.graphs:
                            self._use_rows(full, rows, length)
                            self._capture(d, length, count=False)
        finally:
            self._use_rows(full, None)
            self.cache.reset()
            self._count_pool()
        torch.cuda.synchronize(self.region.device)
        return time.perf_counter() - t0

    def _row_writes(self, d: _Decode, full: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Decode steps write each row's keys and values where ``d.index`` says (``_slots``): one batch at a
        time and kept full alike, so both run the same graphs."""
        plan = WritePlan()
        plan.decode(d.index)
        return slot_writes(self.cache.layers, plan, full)

    def _length(self, n: int) -> int:
        """The cache-length bucket that holds ``n`` columns."""
        return min(self.max_len, round_up(n, self.kv_block))

    def _decode(self, d: _Decode, length: int) -> torch.Tensor:
        """Logits of one decode step from ``d``'s buffers over the first ``length`` cache columns (a graph
        replay once captured). The cache's views must span ``length`` columns (``_use_rows``)."""
        if not self.cuda_graphs:
            return self._forward(d.ids, d.mask[..., :length], d.pos)
        graph = d.graphs.get(length)
        if graph is None:
            graph = self._capture(d, length)
        graph.replay()
        assert d.logits is not None
        return d.logits

    @torch.no_grad()  # with autograd on, the logits buffer would keep every graph's activations alive
    def _capture(self, d: _Decode, length: int, *, count: bool = True) -> Any:
        # Warm-up runs write this step's keys and values at the rows' columns (``_row_writes``, in force
        # wherever a step is captured): the replay rewrites the same ones.
        mask = d.mask[..., :length]
        # One side stream for every capture: the pool's freed blocks are reused only by allocations on the
        # stream that freed them, so graphs captured on streams of their own would not share memory.
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.region.device)
        side = self._capture_stream
        side.wait_stream(torch.cuda.current_stream(self.region.device))
        with torch.cuda.stream(side):
            # Twice before this sampler's first capture (lazy initialisation of the libraries), then once;
            # each run writes the same column (the next would lie past the length bucket's view).
            for _ in range(2 if self.captures == 0 else 1):
                out = self._forward(d.ids, mask, d.pos)
        torch.cuda.current_stream(self.region.device).wait_stream(side)
        if d.logits is None:  # outside the pool: every length's graph of these rows writes here
            d.logits = torch.empty_like(out)
        del out
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # The model's own output is a temporary of the pool, so graphs of other lengths reuse its memory.
        # Captured on the side stream, not through ``torch.cuda.graph``: that empties PyTorch's device and
        # host caches before every capture, and the next warm-up then allocates all again from the driver
        # (most of a capture's time when the buckets are captured in a row).
        side.wait_stream(torch.cuda.current_stream(self.region.device))
        with torch.cuda.stream(side):
            # thread_local: another thread of the process (a server's) may call the driver meanwhile
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                d.logits.copy_(self._forward(d.ids, mask, d.pos))
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.region.device).wait_stream(side)
        d.graphs[length] = graph
        self.captures += 1
        if count:
            self._count_pool()
        return graph

    def _count_pool(self) -> None:
        """The pool's segments are reserved for the graphs alone and stay reserved while they live (through
        sleep and the train phase too). Counted from the allocator's segments: the difference of the
        reserved bytes around a capture would also see what the capture allocated for other pools."""
        self.graph_pool_bytes = sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if self._pool is not None and tuple(seg.get("segment_pool_id", ())) == tuple(self._pool)
        )

    def order_after(self, event: Any) -> None:
        """Run the next :meth:`generate` on the sampler's own CUDA stream, ordered after ``event`` alone
        rather than after all that is queued on the caller's stream, which is ordered after the generation
        when it returns. A :class:`~rlmem.PhaseManager` with ``overlap_offload`` passes the end of the train
        phase, so the prefill runs while the train state is copied to host memory. Nothing off a GPU.

        Raises:
            ValueError: ``event`` is not a ``torch.cuda.Event``.
        """
        if not isinstance(event, torch.cuda.Event):
            raise ValueError(f"event must be a torch.cuda.Event, got {type(event).__name__}")
        if self.region.device.type == "cuda":
            self._after = event

    def _autocast(self, device: torch.device) -> Any:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """Completions (token ids, up to and including EOS) for each prompt, in batches of ``batch_size``.

        Args:
            prompts: token ids per prompt.
            max_new_tokens: tokens sampled at most per completion.
            temperature: 0 samples greedily; otherwise logits are divided by it.
            top_p: nucleus sampling: only the most likely tokens whose probabilities sum to ``top_p``.
            seed: seeds this call's own generator (the global RNG is left alone); None draws a seed from it.

        Raises:
            RuntimeError: the engine is asleep.
            ValueError: an argument is out of range, or a prompt plus ``max_new_tokens`` exceeds ``max_len``.
        """
        self._check_awake("generate")
        if self._weights_stale:
            raise RuntimeError(
                "HFSampler's rollout weights were discarded (sleep(level=2)): sync_weights() after waking"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.max_len:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"max_len={self.max_len}"
            )
        device = self.region.device
        gen = torch.Generator(device=device)
        gen.manual_seed(int(torch.randint(2**62, ()).item()) if seed is None else seed)
        after, self._after = self._after, None
        out: list[list[int]] = []
        with contextlib.nullcontext() if after is None else self._own_stream_after(after):
            if self._qkv is not None:  # the weights may have changed since the last generation
                self._qkv.refresh(self._state)
            if self.refill and len(prompts) > self.batch_size:
                out = self._generate_full(prompts, max_new_tokens, temperature, top_p, gen)
            else:
                for start in range(0, len(prompts), self.batch_size):
                    rows = self._generate_batch(
                        prompts[start : start + self.batch_size], max_new_tokens, temperature, top_p, gen
                    )
                    out.extend(rows)
        return out

    @contextlib.contextmanager
    def _own_stream_after(self, event: Any) -> Iterator[None]:
        """The block runs on the sampler's own stream, ordered after ``event`` alone; the caller's stream is
        ordered after the block."""
        device = self.region.device
        caller = torch.cuda.current_stream(device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_event(event)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            caller.wait_stream(self._stream)

    def _generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator,
    ) -> list[list[int]]:
        n, device = len(prompts), self.region.device
        rows = self._bucket(n)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width + max_new_tokens), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row ends where sampling starts
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) : width] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        full = [(layer.keys, layer.values) for layer in self.cache.layers]
        try:
            # A last, partial batch uses the first rows of the cache: n to prefill, its bucket to decode.
            self._use_rows(full, n)
            self.cache.reset()
            logits = self._forward(ids, mask[:, :width], pos)
            done = torch.zeros(n, dtype=torch.bool, device=device)
            steps = []
            self._use_rows(full, rows)
            # Only now: the prefill may have moved the weights the graphs read (FSDP2 gathers them into
            # new storage on its first forward of a rollout), and the fingerprint must see where they are.
            d = self._decoder(rows)
            d.start(mask[:, :width], pos[:, -1], width)
            length = 0
            with self._row_writes(d, full):
                for t in range(max_new_tokens):
                    nxt = _sample(logits[:n], temperature, top_p, gen)
                    nxt = torch.where(done, self.pad_token_id, nxt)
                    steps.append(nxt)
                    done |= nxt == self.eos_token_id
                    # One host sync every few tokens to stop early, instead of one per token.
                    if t + 1 == max_new_tokens or ((t + 1) % self.sync_every == 0 and bool(done.all())):
                        break
                    d.advance(nxt, width + t)
                    need = self._length(width + t + 1)
                    if need != length:  # the new column opens the next length bucket
                        length = need
                        self._use_rows(full, rows, length)
                    logits = self._decode(d, length)
        finally:
            self._use_rows(full, None)
        rows = []
        for row in torch.stack(steps, 1).tolist():
            if self.eos_token_id in row:
                row = row[: row.index(self.eos_token_id) + 1]
            rows.append(row)
            self.tokens_generated += len(row)
        return rows

    def _generate_full(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator,
    ) -> list[list[int]]:
        """Every sequence through ``batch_size`` rows kept full (``refill``): each row writes its own columns
        (``_slots``), a waiting sequence's prompt is prefilled into the row of one that ended."""
        rows, device = self.batch_size, self.region.device
        slots = Slots(rows, prompts, max_new_tokens, self.eos_token_id)
        plan = WritePlan()
        lengths = torch.zeros(rows, dtype=torch.long, device=device)  # columns each row fills
        active = torch.zeros(rows, dtype=torch.long, device=device)
        block = torch.zeros((rows, self.sync_every), dtype=torch.long, device=device)
        full = [(layer.keys, layer.values) for layer in self.cache.layers]
        cur: torch.Tensor | None = None  # the logits each row samples its next token from
        try:
            with slot_writes(self.cache.layers, plan, full):
                self._use_rows(full, None)
                self.cache.reset()  # rows hold finite values wherever a mask hides them
                d = self._decoder(rows)
                d.start(d.mask[:0, 0, 0, :0], d.pos[:0, 0], 0)  # every row idle: attends to column 0
                while not slots.done:
                    admitted = slots.admit()
                    if admitted:
                        self._use_rows(full, None)
                        first = cur is None
                        cur = self._prefill_rows(admitted, slots, plan, d, lengths, active, cur)
                        if first:  # the first forward of the rollout may have moved the weights (FSDP2)
                            self._follow_weights()
                    assert cur is not None
                    n = min(self.sync_every, slots.steps_left())
                    base = max(slots.length[r] for r, s in enumerate(slots.seq) if s is not None)
                    for j in range(n):
                        nxt = _sample(cur, temperature, top_p, gen)
                        block[:, j] = nxt
                        d.ids[:, 0] = nxt
                        d.pos[:, 0] = lengths
                        step_index(d.base, lengths, d.index)
                        d.mask[d.rows, 0, 0, lengths] = True
                        plan.decode(d.index)
                        length = self._length(base + j + 1)
                        self._use_rows(full, rows, length)
                        cur = self._decode(d, length)
                        lengths.add_(active)
                    ended = slots.record(block[:, :n].tolist())
                    if ended:  # idle rows: nothing to write, column 0 to attend to (never an empty row)
                        idx = torch.tensor(ended, device=device)
                        active[idx] = 0
                        lengths[idx] = 0
                        d.mask[idx] = False
                        d.mask[idx, 0, 0, 0] = True
        finally:
            self._use_rows(full, None)
        out = slots.outputs()
        self.tokens_generated += sum(len(o) for o in out)
        return out

    def _prefill_rows(
        self,
        admitted: list[tuple[int, int]],
        slots: Slots,
        plan: WritePlan,
        d: _Decode,
        lengths: torch.Tensor,
        active: torch.Tensor,
        cur: torch.Tensor | None,
    ) -> torch.Tensor:
        """Prefill the admitted sequences into their rows, those of one prompt length together (no padding:
        each row's last column is its last token); their first logits go into ``cur``'s rows."""
        device = self.region.device
        by_len: dict[int, list[tuple[int, int]]] = {}
        for r, s in admitted:
            by_len.setdefault(len(slots.prompts[s]), []).append((r, s))
        for p, group in by_len.items():
            idx = torch.tensor([r for r, _ in group], device=device)
            ids = torch.tensor([slots.prompts[s] for _, s in group], dtype=torch.long, device=device)
            pos = torch.arange(p, device=device).expand(len(group), p)
            causal = torch.ones((p, self.max_len), dtype=torch.bool, device=device).tril()
            plan.prefill(idx)
            logits = self._forward(ids, causal.expand(len(group), 1, p, self.max_len), pos)
            if cur is None:
                cur = torch.zeros((self.batch_size, logits.shape[-1]), dtype=logits.dtype, device=device)
            cur[idx] = logits.to(cur.dtype)
            lengths[idx] = p
            active[idx] = 1
            d.mask[idx] = False
            d.mask[idx, 0, 0, :p] = True
        assert cur is not None
        return cur

    def _use_rows(
        self, full: list[tuple[torch.Tensor, torch.Tensor]], n: int | None, length: int | None = None
    ) -> None:
        """Point the cache's layers at the first ``n`` rows and ``length`` columns of the Region's tensors
        (None: all of them)."""
        whole = (n is None or n == self.batch_size) and (length is None or length == self.max_len)
        for layer, (k, v) in zip(self.cache.layers, full, strict=True):
            layer.keys, layer.values = (k, v) if whole else (k[:n, :, :length], v[:n, :, :length])


def _static_cache(config: Any, max_len: int, dtype: torch.dtype) -> Any:
    """``transformers.StaticCache`` whose layers take keys and values in ``dtype``, the compute dtype.

    A static cache allocates its layers in the dtype of the first keys (or keys and values) written to it,
    and later writes must match. Under autocast over fp32 weights they need not: Qwen3 normalises its keys
    with an RMSNorm whose fp32 weight times the bf16 projection gives fp32 keys, while its values leave
    ``v_proj`` in bf16, so the cache was made fp32 and the first bf16 write failed (``index_copy_``), or,
    where transformers sizes values apart, kept fp32 keys at twice the bytes. Attention casts its inputs to
    the autocast dtype either way, so storing them in it changes no result. ``.to`` is a no-op where the
    dtype already matches (every family whose keys and values leave their projections as they are).
    """
    from transformers import StaticCache

    class _Cache(StaticCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
            return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kw)

    return _Cache(config=config, max_cache_len=max_len)


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2 wraps any of ``model``'s modules or any parameter is a DTensor (also while FSDP holds
    the parameters gathered, when they read as plain tensors)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a PyTorch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        _is_dtensor(p) for p in model.parameters()
    )


def _twin(model: nn.Module) -> nn.Module:
    """The same Hugging Face model as ``model``, without FSDP: built from its config on the meta device (no
    memory), in eval mode. The rollout runs it over the copy's full tensors, so FSDP's hooks (which would
    gather the sharded weights at every forward, through the communicators) never run, and the weights the
    CUDA graphs read stay at the copy's addresses from one rollout to the next.

    Raises:
        ValueError: the model has no Hugging Face ``config`` to build the twin from.
    """
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"rollout_dtype with a sharded model needs a transformers model (a config to build its unsharded "
            f"twin from); {cls.__name__} has none: leave rollout_dtype=None"
        )
    with torch.device("meta"):
        twin = cls(config)
    return twin.eval()


def _check_covers(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Every parameter and buffer of ``model`` is in ``state`` with its shape (anything else would stay on
    the meta device, with no data)."""
    for n, t in (*model.named_parameters(), *model.named_buffers()):
        got = state.get(n)
        if got is None or tuple(got.shape) != tuple(t.shape):
            raise ValueError(
                f"{what} {n!r} does not match the model's "
                f"({None if got is None else tuple(got.shape)} vs {tuple(t.shape)})"
            )


def _first_param(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The tensor ``weights`` holds for the model's first parameter (its device and dtype are the
    sampler's)."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping of name -> tensor, got {type(weights).__name__}")
    name = next(n for n, _ in model.named_parameters())
    t = weights.get(name)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"weights has no tensor for the model's parameter {name!r}")
    return t


class _Decode:
    """Fixed inputs of one decode step for ``size`` rows: token ids, positions and the 4-D attention mask
    (True: attend) over the whole cache, updated in place; with CUDA graphs, one graph per cache-length
    bucket and the output logits they all write."""

    def __init__(self, size: int, max_len: int, heads: int, device: torch.device) -> None:
        self.ids = torch.zeros((size, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((size, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((size, 1, 1, max_len), dtype=torch.bool, device=device)
        # Where a step writes each row's keys and values (``_slots.step_index``): column 0 until set.
        self.base = row_bases(size, heads, max_len, device)
        self.index = self.base.clone()
        self.rows = torch.arange(size, device=device)
        self.graphs: dict[int, Any] = {}
        self.logits: torch.Tensor | None = None

    def start(self, prompt_mask: torch.Tensor, last_pos: torch.Tensor, width: int) -> None:
        """Set up for a batch whose prompts fill ``width`` columns (rows past the batch attend to the first
        position only: their outputs are not used, and a row with nothing to attend to would be NaN)."""
        n = prompt_mask.shape[0]
        self.ids.zero_()
        self.pos.zero_()
        self.pos[:n, 0] = last_pos
        self.mask.zero_()
        self.mask[:n, 0, 0, :width] = prompt_mask.bool()
        self.mask[n:, 0, 0, 0] = True

    def advance(self, ids: torch.Tensor, column: int) -> None:
        """The next step's inputs: the sampled ids at the next position, attending to the new column."""
        self.ids[: ids.shape[0], 0] = ids
        self.pos.add_(1)
        step_index(self.base, column, self.index)
        self.mask[:, 0, 0, column] = True


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else from the tempered, top-p truncated distribution.

    Rows go through in slices, so the fp32 probabilities of a large batch over a large vocabulary never
    exist all at once."""
    if temperature == 0:
        return logits.argmax(-1)
    rows = max(1, (1 << 28) // (4 * logits.shape[-1]))  # ~256 MiB of fp32 per slice
    out = []
    for part in logits.split(rows):
        probs = torch.softmax(part.float() / temperature, -1)
        if top_p < 1:
            sorted_p, order = probs.sort(-1, descending=True)
            # Keep a token while the mass before it is below top_p (the most likely one is always kept).
            drop = sorted_p.cumsum(-1) - sorted_p >= top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0))
        out.append(torch.multinomial(probs, 1, generator=gen)[:, 0])
    return torch.cat(out)
