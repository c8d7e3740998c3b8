"""A rollout engine for Hugging Face causal LMs whose KV cache lives in a Region.

``HFSampler`` is rlmem's batched sampler (temperature, top-p, EOS, max new tokens; left-padded prompts, one
prefill then one token per step) over a ``transformers.StaticCache``. The cache's per-layer key and value
tensors are re-pointed into one Region, so ``sleep()`` gives the whole cache back to the device (a discarded
pause: milliseconds) and ``wake()`` takes it again at the same addresses. Its size comes from a byte budget,
like vLLM's ``gpu_memory_utilization``.

Decode steps are CUDA graph replays over batch-size and cache-length buckets (``cuda_graphs``), which
survive ``sleep()`` / ``wake()`` and the train phase between rollouts (``captures`` counts every capture);
sampling runs after each step on the device, with no host sync per token.

This module is the facade: the constructor, the public methods, ``memory()``, sleep and wake, and the
model's step (one forward under the swaps of ``_fused``, ``_gqa``, ``_qkv`` and, with ``share_prompts``,
``_prefix``; a graph replay once captured, with ``_experts``' swap for a mixture-of-experts model). Beside
it, one module per mechanism: the cache in its Region (``_cache``), the CUDA graphs and the length buckets
(``_graphs``), the rollout copy and the FSDP twin (``_weights``), top-p and temperature sampling
(``_sampling``), the decode loops of one batch at a time or kept full (``_generate``, over ``_slots``), a
group's prompt held once (``_prefix``).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..._checks import check_choice, check_flag, check_tags
from ...memory.region import Region
from ._cache import batch_size_for, into_region, kv_bytes_per_token, probe, static_cache
from ._experts import experts_modules, static_experts
from ._fused import fused as _fused
from ._fused import kernels
from ._generate import OwnStream, Run, check_request, generate_batch, generate_full, shared_batch, shared_full
from ._gqa import grouped_decode
from ._graphs import CaptureError, Decode, DecodeGraphs, length_block
from ._prefix import Prefix, SharedDecode, SharedLayout, groups_of, longest_run
from ._qkv import FusedQKV
from ._sampling import eval_mode
from ._weights import attached_state, check_rollout_dtype, copy_parameters, first_param, rollout_copy, sharded
from .config import shared_layout

__all__ = ["HFSampler", "kv_bytes_per_token"]


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
            replays. A mixture-of-experts model's experts run in the captured steps in a form with no host
            copy wherever transformers' own dispatch has one (``_experts``); a model whose decode step still
            cannot be captured decodes eagerly from then on, with a warning once.
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
        share_prompts: keep each prompt once in the KV cache for the rows that complete it. A ``generate``
            call whose prompts come in runs of one prompt repeated, consecutive (a GRPO group; a server's
            ``n``), prefills each prompt once and decodes its rows over its keys and values and their own:
            the same Region holds ``prompts x (max_len - max_new_tokens) + rows x max_new_tokens`` token
            columns instead of ``rows x max_len``, so more rows decode at once (:meth:`rows_for`;
            ``config.kv_batch_shared`` sizes a cache for so many rows). Rows of one prompt take one group of
            rows, so with ``refill`` a waiting prompt takes a group whose rows have all ended. A call with
            no repeated prompt, or whose groups would take more of the cache than rows of their own, runs
            as without it; so does every call of a model the shared step cannot serve
            (``share_blocked`` says why: attention not through transformers' SDPA interface, a logit
            softcap, attention sinks, a sliding window shorter than ``max_len``). ``last_layout`` says which
            layout the last call ran. Greedy tokens equal the unshared layout's where its logits are not
            within rounding of a tie (the attention is merged from two parts by their log-sum-exp: fp32
            logits ~3e-6 apart on the test models, bf16 ones as far from fp32 as the unshared layout's),
            and so does seeded sampling where the rows decode in the same order: every call that fits one
            batch in both layouts, not a kept-full one (its rows are scheduled by group).

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
        share_prompts: bool = False,
    ) -> None:
        # The arguments first, before the weights and the cache take any memory.
        check_choice("cuda_graphs", cuda_graphs, ("auto", "on", "off"))
        check_choice("fused", fused, ("auto", "on", "off"))
        check_choice("gqa", gqa, ("auto", "off"))
        check_flag("refill", refill)
        check_flag("share_prompts", share_prompts)
        self.refill = refill
        self.share_prompts = share_prompts
        # What a shared step's attention reads (``_prefix``); None: every call in the unshared layout.
        self._prefix: Prefix | None = Prefix() if share_prompts else None
        self.share_blocked: str | None = None  # why this model's prompts cannot be shared, once probed
        self.last_layout = ""  # "shared" or "unshared": the layout the last generate call ran
        self.last_rows = 0  # rows the last generate call decoded at once, at most
        self._layouts: dict[tuple[int, int], SharedLayout] = {}  # by (max_new_tokens, rows per group)
        self.gqa = gqa == "auto"
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive int, got {sync_every!r}")
        kv_block = length_block(max_len, kv_block)
        if weights is not None and rollout_dtype is not None:
            raise ValueError("weights and rollout_dtype exclude each other: the weights are the rollout copy")
        param = next(model.parameters())
        if weights is not None:  # the model's own parameters may be on the meta device
            param = first_param(model, weights)
        device = param.device
        self._choose_paths(device, cuda_graphs, fused)
        check_rollout_dtype(rollout_dtype)
        compute_dtype = compute_dtype or rollout_dtype
        dtype = compute_dtype or param.dtype
        batch_size = batch_size_for(model.config, dtype, max_len, batch_size, kv_budget_bytes)

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
        # The cache's keyword: ``cache`` in transformers releases that renamed it (``past_key_values`` is
        # deprecated there), ``past_key_values`` before.
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

        self._set_up_weights(weights, rollout_dtype, device, name)
        self._set_up_cache(device, name, asleep)
        self.tokens_generated = 0
        self._graphs = DecodeGraphs(self.cuda_graphs, batch_size, max_len, kv_block, self.region.device)
        # A mixture-of-experts model's experts run in a form a graph can capture in the captured steps
        # (``_experts``); ``_all_static``: every one of them, once a capture with their own dispatch failed.
        self._moe = self.cuda_graphs and bool(experts_modules(self._runner))
        self._all_static = False
        self._own_stream = OwnStream(self.region.device)  # where the next generation runs (order_after)

    def _choose_paths(self, device: torch.device, cuda_graphs: str, fused: str) -> None:
        """CUDA graphs and the fused kernels, as asked and as the device allows."""
        if cuda_graphs == "on" and device.type != "cuda":
            raise ValueError(f"cuda_graphs='on' needs a model on a CUDA device; this one is on {device}")
        self.cuda_graphs = cuda_graphs != "off" and device.type == "cuda"
        self.fused = fused == "on" or (fused == "auto" and self.cuda_graphs)
        self._kernels = kernels(device) if self.fused else ()

    def _set_up_weights(
        self,
        weights: Mapping[str, torch.Tensor] | None,
        rollout_dtype: torch.dtype | None,
        device: torch.device,
        name: str,
    ) -> None:
        """What the rollout reads: the model's own parameters, ``weights`` owned elsewhere, or a rollout copy
        of its own (filled now) with, for a sharded model, the unsharded twin that runs over it."""
        self.weights: dict[str, torch.Tensor] | None = None
        self.weights_region: Region | None = None
        self._weights_stale = False
        # The module the rollout runs: the model itself, or (a sharded model with a rollout copy) a twin of
        # it without FSDP's hooks, whose parameters are the copy's full tensors (``_weights.twin``).
        self._runner: nn.Module = self.model
        self._state: dict[str, torch.Tensor] = {}  # what functional_call runs it over: the copy (+ buffers)
        self._external = False  # the weights are someone else's (``weights=``): nothing to sync
        if weights is not None:
            self.use_weights(weights)
        if rollout_dtype is not None:
            copy = rollout_copy(self.model, rollout_dtype, device, name)
            self._runner, self.weights_region = copy.runner, copy.region
            self.weights, self._state = copy.tensors, copy.state
            self.sync_weights()

    def _set_up_cache(self, device: torch.device, name: str, asleep: bool) -> None:
        """The static cache, its layers initialised by one probing step, then moved into the Region at the
        full batch (with the fused projections' copy after them)."""
        self.cache = static_cache(self.model.config, self.max_len, self._dtype)
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=device)
        with eval_mode(self._runner):
            if self._prefix is None:
                probe(self.cache, self._forward, ids, type(self.model).__name__)
            else:  # the same step, each layer's attention call seen: can the shared step stand in for it?
                with self._prefix.recording(self.max_len):
                    probe(self.cache, self._forward, ids, type(self.model).__name__)
                self.share_blocked = self._prefix.verdict(len(self.cache.layers))
        # The fused projections' weights (``_qkv``): a copy derived from the weights, refreshed before each
        # generation, so it lives and sleeps with the cache. Not for a sharded model sampled as it is (its
        # weights are whole only inside its forward).
        if self.fused and (self.weights is not None or not sharded(self.model)):
            qkv = FusedQKV(self._runner, self._dtype)
            self._qkv = qkv if qkv.layers else None
        extra = [(s, self._dtype) for s in self._qkv.shapes()] if self._qkv is not None else []
        self.region, self.kv_bytes, self.fused_weight_bytes, tensors = into_region(
            self.cache, self.batch_size, extra, device, name, bool(asleep)
        )
        if self._qkv is not None:
            self._qkv.bind(tensors)
        if not asleep:  # asleep, nothing is mapped there yet (each batch resets the cache anyway)
            self.cache.reset()

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far: one per rows and length bucket, again only if the weights move."""
        return self._graphs.captures

    @property
    def graph_pool_bytes(self) -> int:
        """Device memory the captured graphs' private pool holds."""
        return self._graphs.pool_bytes

    @property
    def _decoders(self) -> dict[int, Decode]:
        """The decode buffers by rows, each with its graphs (tests count them)."""
        return self._graphs.decoders

    @property
    def _pool(self) -> Any:
        """The graphs' memory pool (tests look for its segments)."""
        return self._graphs.pool

    def memory(self) -> dict[str, int]:
        """Device bytes the sampler holds now, by category: ``kv_cache``, ``cuda_graphs`` (their pool),
        ``rollout_weights`` (its own copy) and ``fused_weights`` (the fused projections' copy, which lives and
        sleeps with the cache)."""
        own = self.weights_region.resident_bytes if self.weights_region is not None else 0
        fused = self.fused_weight_bytes if self.region.resident_bytes else 0
        return {
            "kv_cache": self.region.resident_bytes - fused,
            "cuda_graphs": self._graphs.pool_bytes,
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
        state = attached_state(self.model, weights)
        self.weights, self._state, self._external = dict(weights), state, True

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy the model's parameters into the rollout copy (``rollout_dtype``); nothing without one.

        Sharded parameters (FSDP2's DTensors) are gathered whole, many in one all-gather: a collective, so
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
        copy_parameters(self.model, self.weights)
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
        return self._graphs.release()

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
        (``_cache.static_cache``)."""
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
        # Inside ``packed``: the shared step stands in for the attention in force (``_gqa``'s or SDPA).
        shared = contextlib.nullcontext()
        if self._prefix is not None and self._prefix.engaged:
            shared = self._prefix.swap(self._runner)
        with self._autocast(ids.device), swap, packed, qkv, shared:
            if self.weights is None:
                out = self.model(**kwargs)
            else:  # the same modules (or the sharded model's twin) over the rollout copy
                out = torch.func.functional_call(self._runner, self._state, (), kwargs, strict=False)
        return out.logits[:, -1]

    def _autocast(self, device: torch.device) -> Any:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def _captured_step(
        self, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None
    ) -> torch.Tensor:
        """A decode step as the CUDA graphs capture it: ``_forward``, a mixture-of-experts model's experts in
        a form with no host copy (``_experts``: transformers' grouped GEMM copies its offsets to the host
        off torch's bf16 kernel)."""
        if not self._moe:
            return self._forward(ids, mask, pos)
        with static_experts(self._runner, force=self._all_static):
            return self._forward(ids, mask, pos)

    def _capturing(self, capture: Any) -> Any:
        """``capture()``'s result; if a step cannot be captured, once more with every expert of an MoE model
        in the capturable form (its own dispatch was taken for capturable and was not), then None: the
        decode steps run eagerly from now on, which a warning says once."""
        while True:
            try:
                return capture()
            except CaptureError as e:
                # Its text only: the error's traceback holds what the failed step allocated in the graphs'
                # pool, which the release below hands back once nothing holds it.
                reason = str(e)
            if self._moe and not self._all_static:
                self._all_static = True
                continue
            warnings.warn(
                f"HFSampler: a decode step of {type(self.model).__name__} cannot be captured into a CUDA "
                f"graph ({reason}); its decode steps run eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            self._graphs.release()
            self.cuda_graphs = self._graphs.enabled = False
            return None

    def _decode(self, d: Decode, length: int) -> torch.Tensor:
        """Logits of one decode step from ``d``'s buffers over the first ``length`` cache columns (a graph
        replay once captured). The cache's views must span ``length`` columns (``_cache.RowViews``)."""
        graph = d.graphs.get(length) if self.cuda_graphs else None
        if graph is None and self.cuda_graphs:
            graph = self._capturing(lambda: self._graphs.capture(d, length, self._captured_step))
        if graph is None:
            return self._forward(d.ids, d.step_mask(length), d.pos)
        graph.replay()
        assert d.logits is not None
        return d.logits

    def _follow_weights(self) -> None:
        """Drop the graphs if the weights they read moved (adopted, reloaded elsewhere, or gathered anew by
        FSDP2 in the first forward of a rollout: so checked after a prefill too)."""
        if self.cuda_graphs:
            params = self.model.parameters() if self.weights is None else self.weights.values()
            self._graphs.follow(tuple(t.data_ptr() for t in (*params, *self.model.buffers())))

    def _decoder(self, size: int) -> Decode:
        """The fixed decode buffers of ``size`` rows (and their captured graphs, with CUDA graphs)."""
        self._follow_weights()
        return self._graphs.decoder(size, self.cache)

    def _shared_decoder(self, layout: SharedLayout, groups: int) -> SharedDecode:
        """The fixed decode buffers of ``groups`` groups of a shared layout (and their graphs)."""
        self._follow_weights()
        heads = layout.own[0][0].shape[1]
        return self._graphs.shared_decoder(
            (layout.own_cols, layout.group, groups),
            lambda: SharedDecode(groups, layout.group, layout, heads, self._dtype, self.region.device),
        )

    def rows_for(self, group_size: int, max_new_tokens: int) -> int:
        """Rows a ``generate`` call decodes at once whose prompts come in runs of ``group_size`` (each with
        ``max_new_tokens``): ``batch_size`` in the unshared layout; with ``share_prompts`` (and a model it
        serves), the rows of the shared layout of this cache where it holds more
        (``config.shared_layout``: each group's prompt once in ``max_len - max_new_tokens`` columns).

        Raises:
            ValueError: a size is not a positive int, or ``max_new_tokens`` leaves no room for a prompt.
        """
        for name, v in (("group_size", group_size), ("max_new_tokens", max_new_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if max_new_tokens >= self.max_len:
            raise ValueError(f"max_new_tokens must be below max_len={self.max_len}, got {max_new_tokens}")
        if self._prefix is None or self.share_blocked is not None:
            return self.batch_size
        groups, per = shared_layout(
            self.batch_size * self.max_len,
            max_len=self.max_len,
            max_new_tokens=max_new_tokens,
            group_size=group_size,
        )
        return max(self.batch_size, groups * per)

    def _shared_plan(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> tuple[SharedLayout, list[tuple[int, int]]] | None:
        """The shared layout of a call and its groups, ``(first, count)`` each; None for the unshared one:
        no repeated prompt, a model the shared step cannot serve, groups that would take more of the
        cache than as many rows of their own, or a shared layout that would decode no more rows at once than
        today's."""
        if self._prefix is None or self.share_blocked is not None:
            return None
        most = longest_run(prompts)
        capacity = self.batch_size * self.max_len
        groups, per = shared_layout(
            capacity, max_len=self.max_len, max_new_tokens=max_new_tokens, group_size=most
        )
        if groups == 0:
            return None
        runs = groups_of(prompts, per)
        if len(runs) * (self.max_len - max_new_tokens + per * max_new_tokens) >= len(prompts) * self.max_len:
            return None
        if groups * per <= self.batch_size:
            # no more rows at once than today's layout: the prompt is short against the completions, and
            # the two-part attention then costs more than the prompt part saves (P=512, R=1,024, G=16 on
            # the H200: 0.71x)
            return None
        layout = self._layouts.get((max_new_tokens, per))
        if layout is None:
            whole = [(layer.keys, layer.values) for layer in self.cache.layers]
            layout = self._layouts[(max_new_tokens, per)] = SharedLayout(
                whole,
                groups=groups,
                group=per,
                max_len=self.max_len,
                max_new_tokens=max_new_tokens,
                block=self.kv_block,
            )
        return layout, runs

    def _check_awake(self, call: str) -> None:
        if self.region.paused or (self.weights_region is not None and self.weights_region.paused):
            raise RuntimeError(f"HFSampler is asleep: call wake() before {call}()")

    @torch.no_grad()
    def capture(self) -> float:
        """Capture every decode graph now, each batch-size bucket over each cache-length bucket, instead of
        on first use (as a serving engine does at start-up); the graphs read the weights where they are now.
        Nothing without CUDA graphs. With ``share_prompts``, the shared layout's graphs (a layout per
        ``max_new_tokens`` and group size) are captured on first use.

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
        with eval_mode(self._runner):
            self._capturing(lambda: self._graphs.capture_all(self.cache, self._decoder, self._captured_step))
        torch.cuda.synchronize(self.region.device)
        return time.perf_counter() - t0

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
            self._own_stream.after = event

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
        check_request(prompts, max_new_tokens, temperature, top_p, self.max_len)
        device = self.region.device
        gen = torch.Generator(device=device)
        gen.manual_seed(int(torch.randint(2**62, ()).item()) if seed is None else seed)
        out: list[list[int]] = []
        # The model's mode is set once per call, not per decode step (it walks every module).
        with self._own_stream.next_generation(), eval_mode(self._runner):
            if self._qkv is not None:  # the weights may have changed since the last generation
                self._qkv.refresh(self._state)
            run = self._run()
            shared = self._shared_plan(prompts, max_new_tokens)
            self.last_layout = "unshared" if shared is None else "shared"
            self.last_rows = min(len(prompts), self.batch_size)
            if shared is not None:
                out = self._generate_shared(run, shared, prompts, max_new_tokens, temperature, top_p, gen)
                self.tokens_generated += sum(len(o) for o in out)
            elif self.refill and len(prompts) > self.batch_size:
                out = generate_full(run, prompts, max_new_tokens, temperature, top_p, gen)
                self.tokens_generated += sum(len(o) for o in out)
            else:
                for start in range(0, len(prompts), self.batch_size):
                    rows = generate_batch(
                        run, prompts[start : start + self.batch_size], max_new_tokens, temperature, top_p, gen
                    )
                    self.tokens_generated += sum(len(r) for r in rows)
                    out.extend(rows)
        return out

    def _generate_shared(
        self,
        run: Run,
        shared: tuple[SharedLayout, list[tuple[int, int]]],
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        gen: torch.Generator,
    ) -> list[list[int]]:
        """A call in the shared layout: kept full (``refill``) with more groups than it holds, else in
        batches of as many groups as it holds."""
        layout, runs = shared
        self.last_rows = min(layout.rows, sum(c for _, c in runs[: layout.groups]))
        if self.refill and len(runs) > layout.groups:
            self.last_rows = layout.rows
            return shared_full(run, layout, prompts, runs, max_new_tokens, temperature, top_p, gen)
        out: list[list[int]] = []
        for start in range(0, len(runs), layout.groups):
            part = runs[start : start + layout.groups]
            out.extend(shared_batch(run, layout, prompts, part, max_new_tokens, temperature, top_p, gen))
        return out

    def _run(self) -> Run:
        """What this call's decode loops run over. Made per call: the step is looked up on the instance now
        (a wrapper set there is what runs), and nothing keeps it past the call."""
        return Run(
            cache=self.cache,
            graphs=self._graphs,
            forward=self._forward,
            decode=self._decode,
            decoder=self._decoder,
            follow_weights=self._follow_weights,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            sync_every=self.sync_every,
            prefix=self._prefix,
            shared_decoder=self._shared_decoder,
        )
