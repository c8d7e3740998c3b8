"""PhaseManager: switch a co-located RL loop between rollout and train with one flag.

``with pm.rollout():`` gives the trainer's idle memory back (per :class:`OffloadConfig`) and wakes rollout
engines; ``with pm.train():`` puts engines to sleep and brings the trainer's state back, waiting only for
what is needed. With ``offload_during_rollout=False`` (the default) both are no-ops that allocate nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import comm
from .._checks import check_choice, check_flag
from .._results import Result
from ..rollout import engine as _engines
from ..rollout.engine import TAGS, Engine
from .state import TrainState, TrainStateStats, check_policy

__all__ = ["TAGS", "Engine", "OffloadConfig", "PhaseManager", "PhaseStats", "SwitchStats"]


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What the train phase gives back during rollout.

    Args:
        offload_during_rollout: the single switch; off by default, and then nothing is adopted or moved.
        params: ``"offload"`` (to pinned host memory; the model stays readable during rollout, for a
            checkpoint or a weight sync, see :meth:`TrainState.offload`), ``"discard"`` (weights the caller
            reloads itself, e.g. synced from the rollout engine) or ``"keep"`` (the rollout runs on the
            training model).
        grads: default ``"discard"`` (gradients become None, as after ``zero_grad()``); ``"keep"`` leaves
            them PyTorch's own, not adopted (``TrainState(grads=False)``), for a loop whose backward runs
            while the rollout phase lasts.
        optimizer: default ``"offload"``.
        buffers: default ``"keep"``; anything else adopts the model's buffers too.
        empty_cache: after offloading, return PyTorch's cached free blocks to the driver, so the rollout
            engine can take the activations' memory too.
        reserve_backups: allocate the pinned host backups in the background as soon as the state is adopted,
            so the first switch runs at link speed.
        comms: ``"keep"`` (default) or ``"suspend"``: the train phase's NCCL communicators give their GPU
            memory back during rollout (:func:`rlmem.comm.suspend`; every rank switches phases together).
            The groups are ``PhaseManager(comm_groups=...)``, by default every NCCL group of the process.
        engine_sleep_level: the ``level`` engines are put to sleep with when the train phase begins: 1
            (default; weights kept in host memory) or 2 (discarded: ``rollout(sync_weights=...)`` refills
            them).
        overlap_offload: the train state's copies to host memory go on while the rollout starts, as far as
            memory allows: ``rollout()`` returns once the engines are awake and the device has the memory the
            previous rollout took, and a quarter more, free (the first rollout waits for the whole release),
            and an engine with ``order_after(event)`` (``HFSampler``) runs its next generation on a stream of
            its own, ordered after the train phase's work but not after the copies. The rollout's memory is
            measured from PyTorch's peak counter, which the switch resets as each rollout begins. Off by
            default: the switch returns once the memory is released.

    Raises:
        ValueError: a field has a value outside those listed; the message names the field.
    """

    offload_during_rollout: bool = False
    params: str = "offload"
    grads: str = "discard"
    optimizer: str = "offload"
    buffers: str = "keep"
    empty_cache: bool = True
    reserve_backups: bool = True
    comms: str = "keep"
    engine_sleep_level: int = 1
    overlap_offload: bool = False

    def __post_init__(self) -> None:
        check_choice("OffloadConfig.comms", self.comms, ("keep", "suspend"))
        check_choice("OffloadConfig.engine_sleep_level", self.engine_sleep_level, (1, 2))
        for f in ("offload_during_rollout", "empty_cache", "reserve_backups", "overlap_offload"):
            check_flag(f"OffloadConfig.{f}", getattr(self, f))
        for f in ("params", "grads", "optimizer", "buffers"):
            check_policy(f"OffloadConfig.{f}", getattr(self, f))

    def policies(self) -> dict[str, str]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "buffers": self.buffers,
        }


@dataclass(frozen=True)
class SwitchStats(Result):
    """Phase switches so far and the last of each: seconds to enter rollout (offload, communicators
    suspended, engines woken), to enter train (the reload queued; the optimizer step waits for the rest), of
    the last :meth:`PhaseManager.prefetch`, and what the last communicator suspend / resume returned.
    With ``overlap_offload``: whether the last rollout began with the offload still in flight
    (``overlapped``), and the device memory the previous rollout took, which the switch waits to be free
    (``rollout_need_bytes``; None before the first rollout)."""

    count: int
    rollout_s: float | None
    train_s: float | None
    prefetch_s: float | None
    comm_suspend: Any
    comm_resume: Any
    overlapped: bool = False
    rollout_need_bytes: int | None = None


@dataclass(frozen=True)
class PhaseStats(Result):
    """What :meth:`PhaseManager.stats` returns."""

    enabled: bool
    phase: str | None
    config: OffloadConfig
    switches: SwitchStats
    engines: int
    state: TrainStateStats | None


class PhaseManager:
    """Rollout/train switching for a model and its optimizer, plus the rollout engines that share the GPU.

    Args:
        model: the policy being trained.
        optimizer: its optimizer (or None).
        config: an :class:`OffloadConfig`; default: disabled.
        comm_groups: with ``config.comms="suspend"``, the process groups to suspend during rollout (a list);
            default: every NCCL group of this process (then the rollout engine must not use NCCL groups).

    Example:
        >>> pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True))
        >>> pm.add_engine(engine)            # anything with sleep() / wake()
        >>> with pm.rollout():
        ...     samples = engine.generate(prompts)
        >>> pm.prefetch()                    # optional: start the reload while rewards are computed
        >>> with pm.train():
        ...     loss = step(model, samples); opt.step()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        config: OffloadConfig | None = None,
        *,
        comm_groups: list[Any] | None = None,
    ) -> None:
        config = OffloadConfig() if config is None else config
        if not isinstance(config, OffloadConfig):
            raise ValueError(f"config must be an OffloadConfig, got {type(config).__name__}")
        self.config = config
        self.comm_groups = None if comm_groups is None else list(comm_groups)
        self.engines: list[Any] = []
        self.phase: str | None = None
        self.state: TrainState | None = None
        self._reloading = False
        self._switches: dict[str, Any] = dict.fromkeys(
            ("rollout_s", "train_s", "prefetch_s", "comm_suspend", "comm_resume", "rollout_need_bytes")
        )
        self._switches.update(count=0, overlapped=False)
        self._rollout_base: int | None = None  # the allocator's reserved bytes as the rollout began
        if config.offload_during_rollout:
            self.state = TrainState(
                model,
                optimizer,
                buffers=config.buffers != "keep",
                grads=config.grads != "keep",  # kept gradients stay PyTorch's, freed by zero_grad() as usual
                name="phase",
            )
            if config.reserve_backups:
                self._reserve()

    @property
    def enabled(self) -> bool:
        return self.config.offload_during_rollout

    def _reserve(self) -> None:
        assert self.state is not None
        self.state.reserve_backups(self.state.backup_categories(self.config.policies()), blocking=False)

    def add_engine(self, engine: Any) -> None:
        """Register a rollout engine: it sleeps on entering train and wakes on entering rollout (see
        :meth:`rollout` for the order).

        Raises:
            ValueError: ``engine`` has no callable ``sleep()`` and ``wake()``.
        """
        if not (callable(getattr(engine, "sleep", None)) and callable(getattr(engine, "wake", None))):
            raise ValueError(f"engine must have sleep() and wake() methods; {type(engine).__name__} has not")
        self.engines.append(engine)

    @contextmanager
    def rollout(self, sync_weights: Callable[[], Any] | None = None) -> Iterator[PhaseManager]:
        """Enter the rollout phase, in the order that keeps the switch's peak lowest: the engines' weights
        wake (``wake(tags=["weights"])``), ``sync_weights()`` copies the policy into them while its
        parameters are still on the device, the train state is offloaded per config, and only then do the
        KV caches wake (``wake(tags=["kv_cache"])``). The peak never holds the train state and a whole
        engine at once; the train phase undoes it in reverse (engines asleep before the state comes back).

        Engines with bare ``sleep()`` / ``wake()`` are woken whole after the offload, and then
        ``sync_weights`` runs after them, reading the offloaded parameters from their pinned backup.

        Args:
            sync_weights: called once per rollout with every engine's weights awake (also when offloading
                is disabled).

        Raises:
            ValueError: ``sync_weights`` with an engine without tags while ``params="discard"`` (nothing
                would be left to sync from).
        """
        if sync_weights is not None and not callable(sync_weights):
            raise ValueError(f"sync_weights must be callable or None, got {type(sync_weights).__name__}")
        if self.enabled and self.phase != "rollout":
            t0 = time.perf_counter()
            assert self.state is not None
            tagged: list[Any] = []
            bare: list[Any] = []
            for e in self.engines:
                (tagged if _engines.takes(e.wake, "tags") else bare).append(e)
            if sync_weights is not None and bare and self.config.params == "discard":
                raise ValueError(
                    "rollout(sync_weights=...): engine(s) "
                    + ", ".join(type(e).__name__ for e in bare)
                    + " have no wake(tags) to wake their weights before the train state goes, and "
                    "params='discard' leaves nothing to sync from; give them wake(tags) or use "
                    "params='offload'"
                )
            for e in tagged:
                e.wake(tags=["weights"])
            if sync_weights is not None and not bare:
                sync_weights()
            overlap = self.config.overlap_offload
            if overlap:
                # Before the copies are queued: both wait for the device to be idle (NCCL's suspend, and
                # the cudaFree under empty_cache), which would wait for the copies too.
                self._release_comms_and_cache()
            # The train phase's work and the weight sync, but not the copies queued next: what an engine
            # with order_after() waits for before generating.
            done = _record(self.state.device) if overlap else None
            self.state.offload(**self.config.policies(), blocking=not overlap)
            self._reloading = False
            if not overlap:
                self._release_comms_and_cache()
            for e in bare:
                self._wake_with_room(e.wake)
            if sync_weights is not None and bare:
                sync_weights()
            for e in tagged:
                self._wake_with_room(functools.partial(e.wake, tags=["kv_cache"]))
            if overlap:
                self._switches["overlapped"] = self._await_room()
                if done is not None:
                    for e in self.engines:
                        if callable(getattr(e, "order_after", None)):
                            e.order_after(done)
                self._rollout_base = _reserved_from_here(self.state.device)
            self._switches["rollout_s"] = time.perf_counter() - t0
            self._switches["count"] += 1
            self.phase = "rollout"
        elif sync_weights is not None:
            sync_weights()
        yield self
        if self._rollout_base is not None:  # what this rollout took, the next switch waits for
            assert self.state is not None
            took = torch.cuda.max_memory_reserved(self.state.device) - self._rollout_base
            self._switches["rollout_need_bytes"] = max(0, took)
            self._rollout_base = None

    def _release_comms_and_cache(self) -> None:
        if self.config.comms == "suspend":
            self._switches["comm_suspend"] = comm.suspend(self.comm_groups)
        if self.config.empty_cache and _cuda_ready():
            torch.cuda.empty_cache()

    def _wake_with_room(self, wake: Callable[[], Any]) -> None:
        """``wake()``; with the offload still releasing memory and the device full, again once the release
        has left the bytes it asked for free (all of it, if it did not say), and after the whole release."""
        try:
            wake()
            return
        except torch.OutOfMemoryError as e:
            if not self.config.overlap_offload:
                raise
            needed = getattr(e, "needed", 0) or None
        if self._wait_release(needed):
            try:
                wake()
                return
            except torch.OutOfMemoryError:
                pass
        assert self.state is not None
        self.state.synchronize()
        wake()

    def _await_room(self) -> bool:
        """Wait until the device has the memory the previous rollout took (and a quarter more, for a rollout a
        little larger than the last), or the offload has released everything (the first rollout waits for
        that). Returns whether the offload was still in flight."""
        need = self._switches["rollout_need_bytes"]
        return self._wait_release(None if need is None else need + need // 4)

    def _wait_release(self, need: int | None) -> bool:
        """Wait until the device has ``need`` bytes free or the offload in flight has released everything
        (None, or off a GPU: the latter). Returns True if it returned with the release still in flight."""
        assert self.state is not None
        handles = self.state.in_flight()
        device = self.state.device
        while handles and not all(h.done() for h in handles):
            if need is not None and device.type == "cuda" and _free_bytes(device) >= need:
                return True
            time.sleep(0.0005)
        self.state.synchronize()  # raises what a release on a worker thread raised
        return False

    def prefetch(self) -> None:
        """Start bringing the train state back now (engines are put to sleep first, to make room)."""
        if not self.enabled or self._reloading or self.phase == "train":
            return
        t0 = time.perf_counter()
        for e in reversed(self.engines):
            _engines.sleep(e, self.config.engine_sleep_level)
        if self.config.overlap_offload and self.config.empty_cache and _cuda_ready():
            # An engine's own stream keeps the blocks it freed cached for itself: give them back for the
            # reload and the train phase.
            torch.cuda.empty_cache()
        assert self.state is not None
        self.state.reload(blocking=False)
        # After the reload is queued: NCCL's resume (host work, mapping, barriers) runs while the copy stream
        # brings the train state back, so a switch sees the longer of the two, not their sum.
        self.resume_comms()
        self._reloading = True
        self._switches["prefetch_s"] = time.perf_counter() - t0

    def resume_comms(self) -> None:
        """Bring back the NCCL communicators the switch to rollout suspended (``comms="suspend"``), the train
        state staying where it is: for collectives the program runs before its next train phase (a
        checkpoint's gathers, the barrier at the end of a run). Every rank calls it, as for a switch; the
        next :meth:`prefetch` / :meth:`train` skips the groups already back. Does nothing otherwise."""
        if self.config.comms == "suspend" and comm.suspended():
            self._switches["comm_resume"] = comm.resume(self.comm_groups)

    @contextmanager
    def train(self) -> Iterator[PhaseManager]:
        """Enter the train phase: engines sleep, the state comes back (parameters first; the optimizer
        step alone waits for the optimizer states)."""
        if self.enabled and self.phase != "train":
            t0 = time.perf_counter()
            self.prefetch()
            self._switches["train_s"] = time.perf_counter() - t0
            self._switches["count"] += 1
            self._reloading = False
            self.phase = "train"
        yield self

    def stats(self) -> PhaseStats:
        """Config, phase, last switch times and, when enabled, the TrainState's bytes per category."""
        sw = self._switches
        return PhaseStats(
            enabled=self.enabled,
            phase=self.phase,
            config=self.config,
            switches=SwitchStats(
                count=sw["count"],
                rollout_s=sw["rollout_s"],
                train_s=sw["train_s"],
                prefetch_s=sw["prefetch_s"],
                comm_suspend=sw["comm_suspend"],
                comm_resume=sw["comm_resume"],
                overlapped=sw["overlapped"],
                rollout_need_bytes=sw["rollout_need_bytes"],
            ),
            engines=len(self.engines),
            state=None if self.state is None else self.state.stats(),
        )


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _record(device: torch.device) -> Any:
    """An event on ``device``'s current stream (None off a GPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).record_event()


def _reserved_from_here(device: torch.device) -> int | None:
    """The allocator's reserved bytes now, its peak counter reset (None off a GPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_reserved(device)


def _free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]
