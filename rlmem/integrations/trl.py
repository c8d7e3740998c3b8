"""rlmem in TRL's ``GRPOTrainer``, in one line: :class:`RLMemCallback` keeps the optimizer states in pinned
host memory from the start of each step (generation, scoring, forward and backward) until the optimizer
step, and, given the reference model (``manage(trainer)`` does), keeps the reference off the device except
while it scores.

As TRL 1.16 and transformers' ``Trainer`` run a step: ``on_step_begin`` (once per optimizer step, before its
gradient-accumulation passes), generation inside ``training_step`` (``_generate_and_score_completions``,
the reference's forward passes among them), forward and backward, gradient clipping,
``on_pre_optimizer_step``, ``optimizer.step()``. The callback enters :class:`~rlmem.PhaseManager`'s rollout
phase at the first (optimizer states out; gradients kept, as backward writes them then; parameters kept,
as generation runs on them) and its train phase at the second (the states back; the step waits for them
alone). Training is what it is without the callback, bit for bit. A vLLM that TRL runs (``use_vllm``) is left
to TRL, which already sleeps and wakes it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..train import OffloadConfig, PhaseManager, TrainState

__all__ = ["RLMemCallback", "manage"]

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


def _callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class RLMemCallback(_callback_base()):  # type: ignore[misc]
    """A ``transformers.TrainerCallback`` for TRL's ``GRPOTrainer`` (see the module docstring).

    Args:
        ref_model: TRL's reference model (``trainer.ref_model``), kept off the device except while it scores;
            None: left where TRL put it (:func:`manage` passes it).
        reserve_backups: allocate the pinned host backups in the background at the start, so the first
            switch runs at link speed.

    Raises:
        ValueError (at the start of training): a DeepSpeed optimizer, or a TRL older than 0.29.

    Example:
        >>> trainer = GRPOTrainer(model, reward_funcs=..., args=..., callbacks=[RLMemCallback()])
    """

    def __init__(self, ref_model: nn.Module | None = None, *, reserve_backups: bool = True) -> None:
        if ref_model is not None and not isinstance(ref_model, nn.Module):
            raise ValueError(f"ref_model must be an nn.Module or None, got {type(ref_model).__name__}")
        self.ref_model = ref_model
        self.reserve_backups = bool(reserve_backups)
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
            offload_during_rollout=True,
            params="keep",  # generation runs on the training weights
            grads="keep",  # backward writes them while the states are away
            optimizer="offload",
            reserve_backups=self.reserve_backups,
        )
        self.pm = PhaseManager(model, _inner(optimizer), config)
        if self.ref_model is not None and self.ref_state is None:
            self._manage_ref(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.pm is not None:
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
