"""The policy side of ``rlmem train``: the model, the reference model, the optimizer, the
:class:`~rlmem.PhaseManager` that switches their memory between phases, the rollout engine, and FSDP2's
gathering and sharding around the rollout (the only place the recipe asks how many ranks there are)."""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._dtypes import dtype_name
from .._units import parse_bytes
from ..models.load import load_model
from ..rollout.engine import takes
from ..rollout.remote.server_rollout import SERVER_CATEGORIES, ServerRollout
from ..rollout.sampler import HFSampler, kv_bytes_per_token
from ..rollout.sampler.config import SamplerConfig, kv_batch, kv_batch_shared, kv_rows
from ..train.phases import OffloadConfig, PhaseManager
from ..train.state import TrainState
from .config import GRPOConfig, OffloadKeys, is_fraction
from .prompts import PromptSource
from .runtime import Runtime, local_rank

__all__ = ["Policy", "build_policy", "materialize_optimizer_state"]


def build_policy(
    cfg: GRPOConfig, device: torch.device, dtype: torch.dtype, vocab: int, max_len: int = 0
) -> nn.Module:
    """The policy ``cfg.model`` names (:func:`rlmem.models.load_model`), its random weights seeded by
    ``cfg.seed``, with ``vocab`` tokens (at least) and room for ``max_len`` positions."""
    return load_model(cfg.model, device, dtype, seed=cfg.seed, vocab=vocab, max_len=max_len)


class Policy:
    """The model being trained and what goes with it, built per ``cfg`` on ``rt``'s device.

    Attributes:
        model, ref, opt: the policy, its frozen reference (None without ``kl_coef``) and AdamW.
        pm: the PhaseManager, built once by :meth:`manage_memory` (disabled without offload): during
            rollout the optimizer states wait in pinned host memory and gradients are dropped; the rollout
            runs on the policy's own weights, or on its ``rollout_dtype`` copy, synced at every rollout
            (so the engine discards it while asleep), and then the training weights wait in pinned host
            memory too.
        ref_state: the reference's TrainState with offload on: it is on the device only while it scores.
        engine: the sampler, made at the first rollout (once the train state has made room).
    """

    def __init__(self, cfg: GRPOConfig, rt: Runtime, prompts: PromptSource) -> None:
        self.cfg, self.rt = cfg, rt
        self.prompts = prompts
        model = build_policy(cfg, rt.device, rt.param_dtype, prompts.vocab, prompts.max_len)
        if cfg.gradient_checkpointing:  # Hugging Face's switch (renamed in transformers 5.x)
            enable = (
                getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            )
            enable()
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        if rt.world > 1:
            _shard(model, rt.device, rt.world)
            if self.ref is not None:
                _shard(self.ref, rt.device, rt.world)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        materialize_optimizer_state(self.opt)
        # The rollout samples from a copy of its own (``rollout_dtype``, or the server's shared one).
        self.own_copy = rt.rollout_dtype is not None or cfg.engine == "server"
        self.pm: PhaseManager | None = None  # built by manage_memory(), once
        self.ref_state: TrainState | None = None
        self.engine: HFSampler | ServerRollout | None = None
        self.last_sync_s: float | None = None  # the last weight sync's time (None: none this step)

    def manage_memory(self) -> PhaseManager:
        """Build the run's one PhaseManager and hand it the memory (with offload on: ``rt.offload``), from
        the config's :class:`~rlmem.recipes.config.OffloadKeys`: after a resume has loaded the weights and
        optimizer states, so that what is adopted is what trains.

        Raises:
            RuntimeError: called a second time (two PhaseManagers would adopt the same state).
        """
        if self.pm is not None:
            raise RuntimeError("manage_memory: the PhaseManager is built once per run, and it is built")
        keys = OffloadKeys.of(self.cfg)
        self.pm = PhaseManager(
            self.model,
            self.opt,
            OffloadConfig(
                offload_during_rollout=self.rt.offload,
                # A rollout copy samples without the training weights: they leave the device too.
                params="offload" if self.own_copy else "keep",
                grads="discard",
                optimizer="offload",
                engine_sleep_level=2 if self.own_copy else 1,
                empty_cache=releases_cache(self.cfg),
                comms=keys.comms,
                overlap_offload=keys.overlap_offload,
            ),
        )
        if self.ref is not None and self.rt.offload:
            self.ref_state = TrainState(self.ref, None, name="reference")
            self.ref_state.offload(params="offload", blocking=True)
        return self.pm

    @property
    def n_params(self) -> int:
        """Parameters of the whole policy (over every rank's shard)."""
        return sum(p.numel() for p in self.model.parameters()) * self.rt.world

    def weight_sync(self) -> Callable[[], Any] | None:
        """What ``pm.rollout(sync_weights=...)`` runs: the engine's weight sync, and with the communicators
        about to be suspended, FSDP's all-gather first where the sync (or the rollout) would come after them.

        An engine with its own copy that wakes its weights apart (``wake(tags)``) is synced before the switch
        suspends anything, gathering in buckets as with ``comms="keep"``: gathering every layer at once first
        would only raise the switch's peak by the whole model."""
        sync = self._timed_sync if self.engine is not None else None
        if self.cfg.comms == "suspend":
            early = self.own_copy and self.engine is not None and takes(self.engine.wake, "tags")
            if not early:
                reshard = self.own_copy and self.engine is not None
                sync = functools.partial(self._gather_then, sync, reshard=reshard)
        return sync

    @property
    def engine_categories(self) -> tuple[str, ...]:
        """What the timeline shows of the engine (:meth:`engine_memory`'s keys)."""
        return (
            SERVER_CATEGORIES if self.cfg.engine == "server" else ("kv_cache", "fused_weights", "cuda_graphs")
        )

    def engine_memory(self) -> dict[str, int]:
        """Device bytes the engine holds now, by category (nothing before it is made)."""
        return {} if self.engine is None else self.engine.memory()

    def _timed_sync(self) -> None:
        assert self.engine is not None
        t0 = time.perf_counter()
        self.engine.sync_weights()
        self.rt.synchronize()
        self.last_sync_s = time.perf_counter() - t0

    def make_engine(self) -> HFSampler | ServerRollout:
        """The engine, made once; its KV cache is sized once the train state has made room."""
        assert self.pm is not None, "manage_memory() builds the PhaseManager before the first rollout"
        if self.engine is None:
            cfg, rt = self.cfg, self.rt
            rollout_dtype = rt.rollout_dtype
            kv_dtype = rt.amp_dtype or rollout_dtype or rt.param_dtype
            n_seqs = cfg.prompts_per_step // rt.world * cfg.group_size
            batch = _kv_batch(cfg, self.model, n_seqs, self.prompts, kv_dtype)
            # One config for the sampler here and for the server's: every setting reaches both.
            sampler = SamplerConfig(
                max_len=self.prompts.max_len,
                batch_size=batch,
                pad_token_id=self.prompts.pad_id,
                eos_token_id=self.prompts.eos_id,
                compute_dtype=None if rt.amp_dtype is None else dtype_name(rt.amp_dtype),
                cuda_graphs=cfg.cuda_graphs,
                share_prompts=cfg.share_prompts,
            )
            if cfg.engine == "server":
                # Under torchrun a server per rank, on its GPU: its log, and a running one's URL, by rank.
                url = None if cfg.engine_url is None else cfg.engine_url.format(local_rank=local_rank())
                self.engine = ServerRollout(
                    self.model,
                    device=rt.device,
                    weights_dtype=rollout_dtype or rt.param_dtype,
                    sampler=sampler,
                    url=url,
                    log=Path(cfg.out_dir) / ("server.log" if rt.world == 1 else f"server-rank{rt.rank}.log"),
                    group=rt.ctl if rt.world > 1 else None,
                )
                if self.pm.state is not None:
                    self.engine.track_train_state(self.pm.state)
                # Its copy is filled: the weights gathered for it (comms="suspend" gathers them all at once
                # before the switch) and their cached blocks go before its cache takes the device.
                self._drop_gathered()
                # Made inside the first rollout (or with no handoff at all, when it then keeps it): the
                # server takes its memory now.
                self.engine.wake()
            else:
                self.engine = HFSampler(self.model, **sampler.sampler_kwargs(), rollout_dtype=rollout_dtype)
                if self.own_copy:  # filled from the weights gathered for it: FSDP's gathered copy can go
                    self._set_reshard(True)
            self.pm.add_engine(self.engine)
        return self.engine

    def _drop_gathered(self) -> None:
        """FSDP's gathered weights go (the engine samples from its own copy), and with them the blocks they
        leave in PyTorch's cache where the switch gives the cache back (:func:`releases_cache`)."""
        self._set_reshard(True)
        if releases_cache(self.cfg) and self.rt.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Let the engine go (a server this run started is stopped)."""
        if isinstance(self.engine, ServerRollout):
            self.engine.close()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Under FSDP2, without a rollout copy, the rollout runs the model itself: its weights stay gathered
        for the whole rollout (one all-gather instead of one per token), and are sharded again after."""
        if not self.own_copy:
            self._set_reshard(False)
        try:
            yield
        finally:
            if not self.own_copy:
                self._set_reshard(True)

    def _gather_then(self, then: Callable[[], Any] | None, *, reshard: bool) -> None:
        """FSDP gathers the weights now (the rollout keeps them gathered), then ``then`` (the engine's weight
        sync) runs on the full weights. ``reshard``: the engine samples from its own copy, so the gathered
        weights go once it is synced."""
        if self.rt.world > 1:
            from torch.distributed.fsdp import FSDPModule

            self._set_reshard(False)
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.unshard()
        if then is not None:
            then()
        if reshard:
            self._set_reshard(True)

    def _set_reshard(self, reshard: bool) -> None:
        if self.rt.world == 1:
            return
        from torch.distributed.fsdp import FSDPModule

        mods = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in mods:
            # Back to FSDP's own setting for training: the root keeps its parameters (the embedding and the
            # head) gathered after forward, as backward needs them at once; resharding it too would gather
            # them again in every backward.
            m.set_reshard_after_forward(reshard and m is not self.model, recurse=False)
        if reshard:
            for m in mods:
                m.reshard()


def releases_cache(cfg: GRPOConfig) -> bool:
    """Whether the switch to rollout gives PyTorch's cached blocks back to the device. The sampler in this
    process maps its Regions over them only when it needs them (a failed map empties the cache and retries),
    so with it the cache stays for the train phase, which would otherwise grow it again every step. A
    server's process cannot reclaim our cache, and the overlapped switch waits on free memory."""
    return cfg.engine != "local" or cfg.overlap_offload


def _shard(model: nn.Module, device: torch.device, world: int) -> None:
    """FSDP2: each decoder layer, then the root (so the embedding and head are sharded too). The mesh is on
    the run's device type (FSDP2 would default to CUDA on a machine that has it, even for CPU ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def materialize_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's states now (a zero-lr step on zero gradients, then the step counters reset), so that
    the memory the train phase holds is in place before the rollout sizes its KV cache. The next real step
    is then exactly a first step."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None
        step = opt.state[p].get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif step is not None:
            opt.state[p]["step"] = 0


def _kv_batch(
    cfg: GRPOConfig, model: nn.Module, n_seqs: int, prompts: PromptSource, dtype: torch.dtype
) -> int:
    """The KV cache's size in rows of ``max_len`` tokens: what ``kv_budget`` affords, never more than the
    rollout needs. With ``share_prompts`` a group's rows hold its prompt once, so the rollout's ``n_seqs``
    completions need fewer such rows (:func:`~rlmem.rollout.sampler.config.kv_batch_shared`)."""
    max_len, new = prompts.max_len, prompts.max_new_tokens
    per_token = kv_bytes_per_token(model.config, dtype)
    shared = cfg.share_prompts and cfg.group_size >= 2 and new < max_len
    budget = None
    if cfg.kv_budget is not None:
        v = cfg.kv_budget
        if isinstance(v, float) or (isinstance(v, str) and is_fraction(v)):
            dev = next(model.parameters()).device
            on_gpu = dev.type == "cuda"
            total = torch.cuda.get_device_properties(dev).total_memory if on_gpu else _host_total()
            budget = int(float(v) * total)
        else:
            budget = parse_bytes(v, "kv_budget")
    if not shared:
        if budget is None:
            return n_seqs
        return kv_batch(per_token * max_len, budget, n_seqs, max_len=max_len, field="kv_budget")
    rows = n_seqs
    if budget is not None:
        fit = kv_rows(per_token, budget, max_len=max_len, max_new_tokens=new, group_size=cfg.group_size)
        rows = min(rows, fit)
    return kv_batch_shared(rows, max_len=max_len, max_new_tokens=new, group_size=cfg.group_size)


def _host_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
