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
takes their place; after it, everything is back for TRL's scoring, forward and backward. It tokenizes TRL's
prompts, text or conversational, as TRL's own generation does.

What the callback cannot carry out is refused at the start of training, in TRL's terms: DeepSpeed (any ZeRO
stage), a second rlmem callback in one trainer, a sampler's callback without its ``rollout_func`` or the
reverse.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from .._checks import check_flag
from .._tokenize import chat_ids, text_ids
from ..train import OffloadConfig, PhaseManager, TrainState

__all__ = ["RLMemCallback", "SamplerRollout", "manage", "sampler_rollout"]

_MIN_TRL = (0, 29)  # the first release whose GRPOTrainer steps as described above


def _trl_version() -> tuple[int, int]:
    import trl

    parts = trl.__version__.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it wraps (accelerate's ``AcceleratedOptimizer`` and any wrapper with
    ``.optimizer``), outermost first."""
    out, seen = [], optimizer
    while seen is not None and len(out) < 4:
        out.append(seen)
        seen = getattr(seen, "optimizer", None)
    return out


_DEEPSPEED_MODULES = ("deepspeed", "accelerate.utils.deepspeed")


def _deepspeed(optimizer: Any, args: Any) -> str | None:
    """How the trainer runs under DeepSpeed (``"DeepSpeed ZeRO stage N"``), or None when it does not: its
    optimizer is accelerate's ``DeepSpeedOptimizerWrapper`` (accelerate 1.15.0, utils/deepspeed.py:295; at
    stage 0 too) or DeepSpeed's own, or ``TrainingArguments.deepspeed`` is set."""
    chain = _chain(optimizer)
    named = getattr(args, "deepspeed", None)
    if not (named or any(type(o).__module__.startswith(_DEEPSPEED_MODULES) for o in chain)):
        return None
    stage = None
    for o in chain:  # accelerate's wrappers keep the AcceleratorState, which knows the plugin's stage
        plugin = getattr(getattr(o, "accelerator_state", None), "deepspeed_plugin", None)
        if plugin is not None:
            stage = plugin.zero_stage
            break
    if stage is None:
        config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or named
        if isinstance(config, dict):  # DeepSpeed's default, with no zero_optimization section, is stage 0
            stage = (config.get("zero_optimization") or {}).get("stage", 0)
    return "DeepSpeed" if stage is None else f"DeepSpeed ZeRO stage {stage}"


def _inner(optimizer: Any, args: Any = None) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (and any wrapper with ``.optimizer``).

    Raises:
        ValueError: the trainer runs under DeepSpeed, or nothing rlmem can adopt.
    """
    ds = _deepspeed(optimizer, args)
    if ds is not None:
        # Under DeepSpeed, accelerator.backward() steps the optimizer itself (accelerate 1.15.0,
        # utils/deepspeed.py:264-281): before on_pre_optimizer_step, where the states come back, so a step
        # after the first finds them away (stage 0 too); ZeRO 1-3 also keep them in DeepSpeed's partitions.
        raise ValueError(
            f"RLMemCallback cannot manage the optimizer under {ds}: DeepSpeed steps it inside "
            "accelerator.backward(), before the callback brings its states back. Train without DeepSpeed "
            "(no `deepspeed` in GRPOConfig nor in `accelerate launch`'s config) for rlmem to keep the "
            "optimizer states off the device, or keep DeepSpeed and use its own offload "
            "(offload_optimizer in the ZeRO config) without RLMemCallback"
        )
    for seen in _chain(optimizer):
        if isinstance(seen, torch.optim.Optimizer) and hasattr(seen, "_optimizer_step_pre_hooks"):
            return seen
    raise ValueError(f"RLMemCallback: no torch optimizer found in {type(optimizer).__name__}")


# torch optimizer -> the callback managing it: a second callback of ours in the same trainer is refused
_MANAGED: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[Any]] = weakref.WeakKeyDictionary()

_ONE_CALLBACK = (
    "keep one: callbacks=[RLMemCallback()] and manage(trainer) each add one, and a sampler_rollout's "
    "r.callback does what RLMemCallback does (manage(trainer) gives it TRL's reference model)"
)


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
        ValueError (at the start of training): DeepSpeed (any ZeRO stage), a second rlmem callback in the
            trainer, a TRL older than 0.29; for a :func:`sampler_rollout`'s callback, a trainer whose
            ``rollout_func`` is not that sampler (before the first optimizer step, as generation is what
            tells).

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
        self._ref_policy: nn.Module | None = None
        self.model: nn.Module | None = None  # the policy of the run begun last
        self._optimizer: torch.optim.Optimizer | None = None
        self.generations = 0  # sampler_rollout's calls in this run
        self._checked = False

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
        inner = _inner(optimizer, args)
        owner = _MANAGED.get(inner)
        if owner is not None and owner() not in (None, self):
            raise ValueError(f"a second rlmem callback in this GRPOTrainer: {_ONE_CALLBACK}")
        if self.pm is not None and self.pm.state is not None:
            # a run of this callback before (this trainer's, or another's): what it adopted goes back to
            # PyTorch before this run adopts the (perhaps same) model again
            self.pm.state.close()
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
        self.pm = PhaseManager(model, inner, config)
        _MANAGED[inner] = weakref.ref(self)
        self.model, self._optimizer = model, inner
        self.generations, self._checked = 0, False
        if self.ref_model is not None:
            self._manage_ref(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pm is not None and not self.around_generation:
            with self.pm.rollout():
                pass

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.around_generation and not self._checked:
            # TRL generates before the first optimizer step of a run, always (a resumed run has no
            # buffered batch): none by the sampler means the trainer's rollout_func is another
            if self.generations == 0:
                raise ValueError(
                    "sampler_rollout: r.callback is in GRPOTrainer's callbacks but the trainer's "
                    "rollout_func is not r (TRL generated without it): pass both, GRPOTrainer(..., "
                    "rollout_func=r, callbacks=[r.callback])"
                )
            self._checked = True
        if self.pm is not None:
            with self.pm.train():
                pass

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pm is not None and self.pm.state is not None:
            with self.pm.train():
                pass
            self.pm.state.synchronize()
        owner = _MANAGED.get(self._optimizer) if self._optimizer is not None else None
        if owner is not None and owner() is self:
            del _MANAGED[self._optimizer]

    # -- the reference model ------------------------------------------------------------------------
    def _manage_ref(self, policy: nn.Module) -> None:
        """The reference under a TrainState of its own, offloaded; back at its first forward (before its
        submodules' guards run: a hook on the root), away again at the policy's next forward. A reference
        or policy other than the last run's (another trainer's) replaces them: the old reference is given
        back as it was."""
        ref = self.ref_model
        assert ref is not None
        if self.ref_state is not None:
            if self.ref_state.model is ref and self._ref_policy is policy:
                return
            for h in self._ref_hooks:
                h.remove()
            self.ref_state.close()
        self.ref_state = TrainState(ref, None, name="reference")
        self.ref_state.offload(params="offload", blocking=True)
        st = self.ref_state

        def back(*_: Any) -> None:
            if st.paused("params"):
                st.reload(blocking=True)

        def away(*_: Any) -> None:
            if not st.paused("params"):
                st.offload(params="offload", blocking=False)

        self._ref_policy = policy
        self._ref_hooks = [
            ref.register_forward_pre_hook(back, prepend=True),
            policy.register_forward_pre_hook(away, prepend=True),
        ]


def manage(trainer: Any, **kwargs: Any) -> RLMemCallback:
    """Put rlmem in ``trainer`` (a TRL ``GRPOTrainer``), its reference model managed too; returns the
    callback. With a :func:`sampler_rollout` as the trainer's ``rollout_func``, that one's callback (added
    if missing) is given the reference; otherwise a new :class:`RLMemCallback` is added. Call before
    ``trainer.train()``.

    Args:
        trainer: the ``GRPOTrainer``, built.
        kwargs: :class:`RLMemCallback`'s keywords (none with a sampler_rollout, whose callback is made).

    Raises:
        ValueError: ``trainer`` is not a transformers ``Trainer``; it holds an rlmem callback already (one
            per trainer), or a sampler_rollout's callback without that sampler as its ``rollout_func``.

    Example:
        >>> import rlmem
        >>> rlmem.integrations.trl.manage(trainer); trainer.train()
    """
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise ValueError(
            f"trainer must be TRL's GRPOTrainer (a transformers Trainer), got {type(trainer).__name__}: "
            "build the trainer, then manage(trainer) before trainer.train()"
        )
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, RLMemCallback)]
    rollout = getattr(trainer, "rollout_func", None)
    if isinstance(rollout, SamplerRollout):
        cb = rollout.callback
        if kwargs:
            raise ValueError(
                f"manage(trainer) takes no keywords ({', '.join(kwargs)}) when the trainer's rollout_func is "
                "a sampler_rollout: its callback is the sampler's"
            )
        if any(c is not cb for c in ours):
            raise ValueError(f"manage(trainer): the trainer holds another rlmem callback: {_ONE_CALLBACK}")
        if not ours:
            trainer.add_callback(cb)
    else:
        if any(c.around_generation for c in ours):
            raise ValueError(
                "manage(trainer): a sampler_rollout's r.callback is in the trainer's callbacks but its "
                "rollout_func is not r: pass both, GRPOTrainer(..., rollout_func=r, callbacks=[r.callback])"
            )
        if ours:
            raise ValueError(
                "manage(trainer): the trainer has an RLMemCallback already (callbacks=[RLMemCallback()]), "
                "and manage adds one: use one of the two (manage also keeps TRL's reference model off the "
                "device)"
            )
        cb = RLMemCallback(**kwargs)
        trainer.add_callback(cb)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        cb.ref_model = ref
    return cb


def _prompt_ids(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """The ids TRL's own generation gives ``prompts`` (TRL 1.16.0, trainer/grpo_trainer.py:1684-1761,
    ``_tokenize_prompts``): conversational prompts (TRL's ``is_conversational``, :1686) through the chat
    template with the generation prompt, the trainer's tools, its chat template and GRPOConfig's
    ``chat_template_kwargs`` (:1737-1746; its padding for transformers 5.3's processors, removed again at
    :1747-1752, changes no id); text by the tokenizer's call with its default special tokens (:1758)."""
    from trl.data_utils import is_conversational

    tok = trainer.processing_class
    if is_conversational({"prompt": prompts[0]}):
        return chat_ids(
            tok,
            prompts,
            tools=getattr(trainer, "tools", None) or None,
            chat_template=getattr(trainer, "chat_template", None),
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )
    return text_ids(tok, prompts)


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
        share_prompts: bool = True,
    ) -> None:
        self.callback = RLMemCallback(ref_model)
        self.callback.around_generation = True
        self.callback.offload = offload
        self.rollout_dtype, self.batch_size, self.seed = rollout_dtype, batch_size, seed
        self.max_prompt_len = max_prompt_len
        self.share_prompts = share_prompts
        self.sampler: Any = None
        self._pm: PhaseManager | None = None  # the one whose engine the sampler is
        self.calls = 0

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        cb = self.callback
        pm = cb.pm
        if pm is None or cb.model is not trainer.model:
            raise ValueError(
                "sampler_rollout: GRPOTrainer(rollout_func=r) needs r.callback in its callbacks too: "
                "GRPOTrainer(..., rollout_func=r, callbacks=[r.callback]), or manage(trainer), which adds it"
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
        # TRL passes this process's rows, each prompt already repeated num_generations times by its
        # RepeatSampler (grpo_trainer.py:1309-1316), and its own path generates one completion a row
        # (:2220-2225): so one here
        ids = _prompt_ids(trainer, prompts)
        longest = max(len(x) for x in ids)
        if self.sampler is None or self._pm is not pm:
            self._attach(trainer, pm, longest, len(ids))
        elif longest + trainer.max_completion_length > self.sampler.max_len:
            raise ValueError(
                f"sampler_rollout: a prompt of {longest} tokens plus max_completion_length "
                f"{trainer.max_completion_length} exceeds the sampler's {self.sampler.max_len}: give "
                "sampler_rollout(max_prompt_len=...)"
            )
        cb.generations += 1
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

    def _attach(self, trainer: Any, pm: PhaseManager, longest: int, n: int) -> None:
        """The sampler as an engine of this run's PhaseManager: the last run's where it samples from this
        trainer's model and its prompts fit, else a new one (a second trainer, or longer prompts)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        old = self.sampler
        fits = old is not None and longest + trainer.max_completion_length <= old.max_len
        if not (fits and old.model is model):
            if old is not None:
                old.drop_graphs()
            self.sampler = None  # the old one's memory goes before the new one takes its own
            self._make(trainer, model, longest, n)
        pm.add_engine(self.sampler)
        self._pm = pm

    def _make(self, trainer: Any, model: nn.Module, longest: int, n: int) -> None:
        from ..rollout.sampler import HFSampler, kv_batch_shared

        tok = trainer.processing_class
        limit = self.max_prompt_len or getattr(trainer.args, "max_prompt_length", None)
        if limit is None:  # the longest prompt of the training set, tokenized once
            data = getattr(trainer, "train_dataset", None)
            rows = (
                data["prompt"] if data is not None and "prompt" in getattr(data, "column_names", ()) else []
            )
            limit = max(
                (
                    len(x)
                    for i in range(0, len(rows), 256)
                    for x in _prompt_ids(trainer, list(rows[i : i + 256]))
                ),
                default=longest,
            )
        max_len = max(limit, longest) + trainer.max_completion_length
        group = int(getattr(trainer, "num_generations", 1) or 1)
        rows = self.batch_size or n
        if self.share_prompts and group >= 2 and self.batch_size is None:
            # a call's rows come as TRL's groups, each prompt num_generations times in a row: the cache
            # holds each prompt once, so all of a call's rows take fewer rows of max_len
            rows = kv_batch_shared(
                n, max_len=max_len, max_new_tokens=trainer.max_completion_length, group_size=group
            )
        self.sampler = HFSampler(
            model,
            max_len=max_len,
            batch_size=rows,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            rollout_dtype=self.rollout_dtype,
            share_prompts=self.share_prompts,
        )


def sampler_rollout(
    *,
    rollout_dtype: torch.dtype | None = torch.bfloat16,
    offload: bool = True,
    batch_size: int | None = None,
    seed: int = 0,
    ref_model: nn.Module | None = None,
    max_prompt_len: int | None = None,
    share_prompts: bool = True,
) -> SamplerRollout:
    """TRL's ``rollout_func`` on rlmem's sampler, and the callback it needs.

    Args:
        rollout_dtype: the copy it samples from (None: the training weights, which then stay on the device).
        offload: the weights (with a copy) and optimizer states leave the device during generation.
        batch_size: sequences at once (default: all of a call's).
        seed: call ``k`` samples with seed ``seed + k`` (reproducible, whatever the global RNG).
        ref_model: TRL's reference model, managed as :class:`RLMemCallback` does; ``manage(trainer)`` on the
            trainer built with this sampler gives it ``trainer.ref_model``.
        max_prompt_len: the longest prompt in tokens (the KV cache's length is it plus TRL's
            ``max_completion_length``); default: ``max_prompt_length`` of TRL's config where it has one,
            else the longest prompt of the training set.
        share_prompts: a group's prompt (TRL repeats each ``num_generations`` times in a row) is prefilled
            once and held once in the KV cache (:class:`~rlmem.rollout.HFSampler` ``share_prompts``); the
            cache (with ``batch_size`` None) is sized for that. Equal completions within the rounding of the
            attention's sums taken in two parts; False: every row holds its own copy.

    Returns:
        A callable with ``.callback``. TRL's ``logprobs`` are not returned (None: TRL's own generation gives
        none either; it scores the completions itself).

    Example:
        >>> r = sampler_rollout()
        >>> trainer = GRPOTrainer(model, ..., rollout_func=r, callbacks=[r.callback])
    """
    check_flag("offload", offload)
    check_flag("share_prompts", share_prompts)
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
        share_prompts=share_prompts,
    )
