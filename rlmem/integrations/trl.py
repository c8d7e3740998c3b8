"""rlmem in TRL's ``GRPOTrainer``, in one line: :class:`RLMemCallback` keeps the optimizer states in pinned
host memory from the start of each step (generation, scoring, forward and backward) until the optimizer
step, and, given the reference model (``manage(trainer)`` does), keeps the reference off the device except
while it scores.

As TRL 1.16 and transformers' ``Trainer`` run a step: ``on_step_begin`` (once per optimizer step, before its
gradient-accumulation passes), generation inside ``training_step`` (``_generate_and_score_completions``,
the reference's forward passes among them), forward and backward, gradient clipping,
``on_pre_optimizer_step``, ``optimizer.step()``. The callback enters :class:`~rlmem.PhaseManager`'s rollout
phase at the first (optimizer states out; gradients left to PyTorch, as backward writes them then and
TRL's ``zero_grad()`` frees them after the step; parameters kept, as generation runs on them) and its
train phase at the second (the states back; the step waits for them alone). Training is what it is
without the callback, bit for bit. A vLLM that TRL runs (``use_vllm``) is left to TRL, which already
sleeps and wakes it.

:func:`sampler_rollout` is TRL's ``rollout_func`` on rlmem's :class:`~rlmem.rollout.HFSampler`
(CUDA graphs, batches kept full) sampling from a copy of the policy (``rollout_dtype``, bf16 by default):
during generation the training weights and the optimizer states wait in pinned host memory and the KV cache
takes their place; after it, everything is back for TRL's scoring, forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .._checks import check_flag
from ..train import OffloadConfig, PhaseManager, TrainState

__all__ = ["RLMemCallback", "SamplerRollout", "manage", "sampler_rollout"]

_MIN_TRL = (0, 29)  # the first release whose GRPOTrainer steps as described above


def _trl_version() -> tuple[int, int]:
    import trl

    parts = trl.__version__.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (and any wrapper with ``.optimizer``).

    Raises:
        ValueError: a DeepSpeed optimizer (its states live in DeepSpeed's own partitions), or nothing rlmem
            can adopt.
    """
    seen = optimizer
    for _ in range(4):
        if type(seen).__module__.startswith("deepspeed"):
            raise ValueError(
                "RLMemCallback: a DeepSpeed optimizer keeps its states in DeepSpeed's partitions, which "
                "rlmem does not adopt; use DeepSpeed's own offload (offload_optimizer) or train without it"
            )
        if isinstance(seen, torch.optim.Optimizer) and hasattr(seen, "_optimizer_step_pre_hooks"):
            return seen
        seen = getattr(seen, "optimizer", None)
        if seen is None:
            break
    raise ValueError(f"RLMemCallback: no torch optimizer found in {type(optimizer).__name__}")


class RLMemCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` for TRL's ``GRPOTrainer`` (see the module docstring).

    Args:
        ref_model: TRL's reference model (``trainer.ref_model``), kept off the device except while it scores;
            None: left where TRL put it (:func:`manage` passes it).
        reserve_backups: allocate the pinned host backups in the background at the start, so the first
            switch runs at link speed.
        empty_cache: give PyTorch's cached free blocks back to the driver as generation begins (they are
            what training's activations left), so the device's memory in use drops by them too; TRL's
            generation then grows the cache again.
        overlap_offload: generation starts while the optimizer states are still being copied out (the
            switch costs the step only what generation waits for).

    Raises:
        ValueError (at the start of training): a DeepSpeed optimizer, or a TRL older than 0.29.

    Example:
        >>> trainer = GRPOTrainer(model, reward_funcs=..., args=..., callbacks=[RLMemCallback()])
    """

    def __init__(
        self,
        ref_model: nn.Module | None = None,
        *,
        reserve_backups: bool = True,
        empty_cache: bool = True,
        overlap_offload: bool = True,
    ) -> None:
        if ref_model is not None and not isinstance(ref_model, nn.Module):
            raise ValueError(f"ref_model must be an nn.Module or None, got {type(ref_model).__name__}")
        self.ref_model = ref_model
        self.reserve_backups = check_flag("reserve_backups", reserve_backups)
        self.empty_cache = check_flag("empty_cache", empty_cache)
        self.overlap_offload = check_flag("overlap_offload", overlap_offload)
        # sampler_rollout's: the rollout phase is its generation alone (the weights leave too)
        self.around_generation = False
        self.offload = True
        self.pm: PhaseManager | None = None
        self.ref_state: TrainState | None = None
        self._ref_hooks: list[Any] = []

    # -- TrainerCallback events ---------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if _trl_version() < _MIN_TRL:
            raise ValueError(
                f"RLMemCallback needs trl >= {'.'.join(map(str, _MIN_TRL))} (its GRPOTrainer's step order); "
                f"this is {_trl_version()}"
            )
        model, optimizer = kw.get("model"), kw.get("optimizer")
        if model is None or optimizer is None:
            raise ValueError("RLMemCallback: the trainer gave no model or optimizer at on_train_begin")
        config = OffloadConfig(
            offload_during_rollout=self.offload,
            # generation runs on the training weights, or (sampler_rollout) on a copy of them
            params="offload" if self.around_generation else "keep",
            # backward writes them while the states are away; kept, they stay PyTorch's (not adopted), so
            # between steps they take no memory, as without the callback
            grads="keep",
            optimizer="offload",
            reserve_backups=self.reserve_backups,
            empty_cache=self.empty_cache,
            overlap_offload=self.overlap_offload,
        )
        self.pm = PhaseManager(model, _inner(optimizer), config)
        if self.ref_model is not None and self.ref_state is None:
            self._manage_ref(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pm is not None and not self.around_generation:
            with self.pm.rollout():
                pass

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pm is not None:
            with self.pm.train():
                pass

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pm is not None and self.pm.state is not None:
            with self.pm.train():
                pass
            self.pm.state.synchronize()

    # -- the reference model ------------------------------------------------------------------------
    def _manage_ref(self, policy: nn.Module) -> None:
        """The reference under a TrainState of its own, offloaded; back at its first forward (before its
        submodules' guards run: a hook on the root), away again at the policy's next forward."""
        ref = self.ref_model
        assert ref is not None
        self.ref_state = TrainState(ref, None, name="reference")
        self.ref_state.offload(params="offload", blocking=True)
        st = self.ref_state

        def back(*_: Any) -> None:
            if st.paused("params"):
                st.reload(blocking=True)

        def away(*_: Any) -> None:
            if not st.paused("params"):
                st.offload(params="offload", blocking=False)

        self._ref_hooks = [
            ref.register_forward_pre_hook(back, prepend=True),
            policy.register_forward_pre_hook(away, prepend=True),
        ]


def manage(trainer: Any, **kwargs: Any) -> RLMemCallback:
    """Add an :class:`RLMemCallback` to ``trainer`` (a TRL ``GRPOTrainer``), its reference model managed
    too; returns it. Call before ``trainer.train()``.

    Example:
        >>> rlmem.integrations.trl.manage(trainer); trainer.train()
    """
    cb = RLMemCallback(getattr(trainer, "ref_model", None), **kwargs)
    trainer.add_callback(cb)
    return cb


class SamplerRollout:
    """TRL's ``rollout_func`` on :class:`~rlmem.rollout.HFSampler` (see :func:`sampler_rollout`);
    :attr:`callback` goes in the trainer's ``callbacks``."""

    def __init__(
        self,
        *,
        rollout_dtype: torch.dtype | None,
        offload: bool,
        batch_size: int | None,
        seed: int,
        ref_model: nn.Module | None = None,
        max_prompt_len: int | None = None,
    ) -> None:
        self.callback = RLMemCallback(ref_model)
        self.callback.around_generation = True
        self.callback.offload = offload
        self.rollout_dtype, self.batch_size, self.seed = rollout_dtype, batch_size, seed
        self.max_prompt_len = max_prompt_len
        self.sampler: Any = None
        self.calls = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        pm = self.callback.pm
        if pm is None:
            raise RuntimeError(
                "sampler_rollout: its callback is not in the trainer's callbacks (GRPOTrainer(..., "
                "rollout_func=r, callbacks=[r.callback]))"
            )
        unsupported = {
            "top_k": trainer.args.top_k not in (None, 0, -1),
            "min_p": trainer.args.min_p not in (None, 0.0),
            "repetition_penalty": trainer.args.repetition_penalty not in (None, 1.0),
        }
        if any(unsupported.values()):
            bad = next(k for k, v in unsupported.items() if v)
            raise ValueError(
                f"sampler_rollout samples with temperature and top_p only; GRPOConfig sets {bad}="
                f"{getattr(trainer.args, bad)!r} (leave it at its default, or use TRL's own generation)"
            )
        tok = trainer.processing_class
        ids = [self._tokens(tok, p) for p in prompts]
        longest = max(len(x) for x in ids)
        if self.sampler is None:
            self._make(trainer, tok, longest, len(ids))
            pm.add_engine(self.sampler)
        elif longest + trainer.max_completion_length > self.sampler.max_len:
            raise ValueError(
                f"sampler_rollout: a prompt of {longest} tokens plus max_completion_length "
                f"{trainer.max_completion_length} exceeds the sampler's {self.sampler.max_len}: give "
                "sampler_rollout(max_prompt_len=...)"
            )
        with pm.rollout(sync_weights=self.sampler.sync_weights):
            out = self.sampler.generate(
                ids,
                max_new_tokens=trainer.max_completion_length,
                temperature=trainer.temperature,
                top_p=trainer.top_p,
                seed=self.seed + self.calls,
            )
        with pm.train():
            pass
        self.calls += 1
        return {"prompt_ids": ids, "completion_ids": [list(c) for c in out], "logprobs": None}

    @staticmethod
    def _tokens(tok: Any, prompt: Any) -> list[int]:
        if isinstance(prompt, list):  # conversational: TRL's chat template, as its own generation applies it
            return list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
        return list(tok(prompt, add_special_tokens=False)["input_ids"])

    def _make(self, trainer: Any, tok: Any, longest: int, n: int) -> None:
        from ..rollout.sampler import HFSampler

        model = trainer.accelerator.unwrap_model(trainer.model)
        limit = self.max_prompt_len or getattr(trainer.args, "max_prompt_length", None)
        if limit is None:  # the longest prompt of the training set, tokenized once
            data = getattr(trainer, "train_dataset", None)
            rows = (
                data["prompt"] if data is not None and "prompt" in getattr(data, "column_names", ()) else []
            )
            limit = max((len(self._tokens(tok, p)) for p in rows), default=longest)
        self.sampler = HFSampler(
            model,
            max_len=max(limit, longest) + trainer.max_completion_length,
            batch_size=self.batch_size or n,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            rollout_dtype=self.rollout_dtype,
        )


def sampler_rollout(
    *,
    rollout_dtype: torch.dtype | None = torch.bfloat16,
    offload: bool = True,
    batch_size: int | None = None,
    seed: int = 0,
    ref_model: nn.Module | None = None,
    max_prompt_len: int | None = None,
) -> SamplerRollout:
    """TRL's ``rollout_func`` on rlmem's sampler, and the callback it needs.

    Args:
        rollout_dtype: the copy it samples from (None: the training weights, which then stay on the device).
        offload: the weights (with a copy) and optimizer states leave the device during generation.
        batch_size: sequences at once (default: all of a call's).
        seed: call ``k`` samples with seed ``seed + k`` (reproducible, whatever the global RNG).
        ref_model: TRL's reference model, managed as :class:`RLMemCallback` does.
        max_prompt_len: the longest prompt in tokens (the KV cache's length is it plus TRL's
            ``max_completion_length``); default: ``max_prompt_length`` of TRL's config where it has one,
            else the longest prompt of the training set.

    Returns:
        A callable with ``.callback``. TRL's ``logprobs`` are not returned (None: TRL's own generation gives
        none either; it scores the completions itself).

    Example:
        >>> r = sampler_rollout()
        >>> trainer = GRPOTrainer(model, ..., rollout_func=r, callbacks=[r.callback])
    """
    check_flag("offload", offload)
    if rollout_dtype is not None and not (
        isinstance(rollout_dtype, torch.dtype) and rollout_dtype.is_floating_point
    ):
        raise ValueError(f"rollout_dtype must be a floating torch.dtype or None, got {rollout_dtype!r}")
    for name, v in (("batch_size", batch_size), ("max_prompt_len", max_prompt_len)):
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return SamplerRollout(
        rollout_dtype=rollout_dtype,
        offload=offload,
        batch_size=batch_size,
        seed=seed,
        ref_model=ref_model,
        max_prompt_len=max_prompt_len,
    )
