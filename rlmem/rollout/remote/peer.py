"""A rollout engine in another process, driven in the order ``PhaseManager`` drives one in its own.

On the trainer's side, :class:`PeerEngine` is an engine (``sleep(level)`` / ``wake(tags)``) whose calls go
through the broker to the rollout process, so ``pm.add_engine(PeerEngine(member, weights=shared))`` makes
``with pm.rollout():`` run: the peer's weights wake (mapping the trainer's :class:`SharedWeights` again after
a level-2 sleep), the sync (the trainer's cast-copy), the train state's offload, then this process's
**fenced release** and the peer's **admitted acquire** of its KV cache; and ``with pm.train():`` the
reverse: the peer's fenced release (KV cache discarded, its weights unmapped at level 2), then this
process's acquire before the state comes back.

On the rollout's side, :func:`serve_engine` answers those calls with an engine of the same protocol (its
``sleep(level)`` gives back what it holds, its ``wake(tags)`` takes it again), tracking what it holds in the
ledger and mapping the trainer's weights. Every call and wait is bounded; a peer that dies is an error
naming it, never a hang.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from ..._checks import TAGS, check_tags
from ...colocate.member import Member
from ...colocate.weights import AttachedWeights, SharedWeights, attach_weights
from ...memory.region import Region

__all__ = ["EngineSeat", "PeerEngine", "serve_engine"]


def _tags(tags: Sequence[str] | None) -> list[str]:
    """The tags asked for (None: all), in the order they are woken."""
    asked = check_tags(tags)
    return [t for t in TAGS if asked is None or t in asked]


class PeerEngine:
    """The rollout process, as an engine of this (the trainer's) process.

    Args:
        member: this process's :class:`Member` (role ``"train"``).
        weights: the rollout copy the peer runs on; sent to it now, mapped there without a copy.
        peer: the peer's role.
        need: bytes this process needs back when the peer sleeps (default: its tracked paused bytes).
        timeout: the bound of each call (default: the member's).

    Raises:
        TimeoutError: the peer did not join within ``timeout``.
        PeerLostError: it died before answering.
    """

    def __init__(
        self,
        member: Member,
        *,
        weights: SharedWeights | None = None,
        peer: str = "rollout",
        need: Callable[[], int] | None = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(member, Member):
            raise ValueError(f"member must be a Member, got {type(member).__name__}")
        if weights is not None and not isinstance(weights, SharedWeights):
            raise ValueError(f"weights must be a SharedWeights or None, got {type(weights).__name__}")
        if need is not None and not callable(need):
            raise ValueError(f"need must be callable or None, got {type(need).__name__}")
        self.member, self.weights, self.peer, self.timeout = member, weights, peer, timeout
        self._need = need
        self.last_fence: Any = None  # this process's, entering rollout
        self.last_peer_fence: Any = None  # the peer's, entering train
        self.last_grant: Any = None
        member.wait_for(peer, timeout=timeout)
        member.acquire(0, timeout=timeout)  # this process runs first: its state is on the device
        if weights is not None:
            self._send_weights("attach_weights", {})

    def _send_weights(self, method: str, args: dict[str, Any]) -> Any:
        assert self.weights is not None
        spec, fds = self.weights.export()
        try:
            return self.call(method, fds=fds, weights=spec, **args)
        finally:
            for fd in fds:
                os.close(fd)

    def call(self, method: str, *, fds: Sequence[int] = (), **args: Any) -> Any:
        """Call ``method`` of the peer's :func:`serve_engine` (or its own handlers) with JSON-able args."""
        result, rfds = self.member.call(self.peer, method, args, fds=fds, timeout=self.timeout)
        for fd in rfds:
            os.close(fd)
        return result

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """``"weights"``: the peer maps the weights (again, after a level-2 sleep); ``"kv_cache"``: this
        process releases (fenced), then the peer acquires and takes its cache back.

        Raises:
            FenceError: this process's memory did not come back (see :meth:`Member.release`).
            OutOfMemoryError: the peer could not be admitted (the message names this process's holdings).
        """
        tags = _tags(tags)
        if "weights" in tags:
            self.member.mark()  # the fence entering rollout counts from here (the offload comes next)
            if self.weights is not None and self.weights.region.paused:
                self.weights.region.resume()
                self._send_weights("wake", {"tags": ["weights"]})
            else:
                self.call("wake", tags=["weights"])
        if "kv_cache" in tags:
            self.last_fence = self.member.release(timeout=self.timeout)
            self.last_grant = self.call("wake", tags=["kv_cache"])

    def sleep(self, level: int = 1) -> None:
        """The peer releases (its KV cache; at level 2 its mapping of the weights, which this process then
        releases too), fenced; then this process acquires what it needs back.

        Raises:
            OutOfMemoryError: the memory did not come back in time (the peer named); retry after it has.
        """
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self.last_peer_fence = self.call("sleep", level=level)
        if level == 2 and self.weights is not None:
            self.weights.region.pause(keep=False)  # every process has unmapped it: it is freed now
        need = self._need() if self._need is not None else None
        self.last_grant = self.member.acquire(need, timeout=self.timeout)

    def stop(self) -> None:
        """End the peer's :func:`serve_engine` loop."""
        self.call("stop")


class EngineSeat:
    """The rollout side of :class:`PeerEngine`'s protocol for ``engine`` (``sleep(level)``, ``wake(tags)``,
    optionally ``attach_weights(weights)``): the handlers :func:`serve_engine` answers the broker's calls
    with, callable as well from another front of the same process (``rlmem serve``'s HTTP endpoints), so
    that every way in releases fenced and acquires admitted.

    Args:
        member: this process's :class:`Member` (role ``"rollout"``).
        engine: the engine.
        track: Regions (or callables giving them) to report by category, e.g. ``{"kv_cache": region}``.
    """

    def __init__(
        self, member: Member, engine: Any, track: dict[str, Region | Callable[[], Any]] | None = None
    ) -> None:
        self.member, self.engine = member, engine
        for cat, regions in (track or {}).items():
            member.track(cat, regions)
        self.weights: AttachedWeights | None = None
        member.on_peer_lost(self._owner_lost)

    def _owner_lost(self, entry: dict[str, Any]) -> None:
        if self.weights is not None and entry.get("role") == "train":
            self.weights.owner_lost(entry)

    def attach(self, fds: list[int], weights: dict[str, Any]) -> dict[str, Any]:
        """Map the trainer's weights (``weights``: its :meth:`SharedWeights.export` spec) and hand them to
        the engine's ``attach_weights``."""
        if self.weights is not None:
            self.weights.close()
        w = self.weights = attach_weights(weights, fds)
        self.member.track("weights", w.region)
        if callable(getattr(self.engine, "attach_weights", None)):
            self.engine.attach_weights(w)
        return {"tensors": len(w.tensors), "bytes": w.region.used_bytes}

    def wake(self, fds: list[int], tags: list[str] | None, weights: dict[str, Any] | None = None) -> Any:
        """``"weights"``: map them again (after a level-2 sleep, from the spec sent) and wake the engine's;
        ``"kv_cache"``: acquire (admitted by the broker), then the engine takes its cache."""
        tags = _tags(tags)
        out = None
        if "weights" in tags:
            w = self.weights
            if weights is not None and w is not None and w.region.paused:
                w.reattach(weights, fds)
            self.engine.wake(tags=["weights"])
        if "kv_cache" in tags:
            out = self.member.acquire().as_dict()
            self.engine.wake(tags=["kv_cache"])
        return out

    def sleep(self, fds: list[int], level: int) -> dict[str, Any]:
        """The engine's sleep, then (level 2) the weights unmapped: one fenced release."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")

        def work() -> None:
            self.engine.sleep(level)
            if level == 2 and self.weights is not None:
                self.weights.pause()

        return self.member.release(work).as_dict()

    def handlers(self, methods: Sequence[str] = ()) -> dict[str, Callable[..., Any]]:
        """``attach_weights``, ``wake``, ``sleep``, and ``methods`` of the engine (JSON in and out)."""
        out: dict[str, Callable[..., Any]] = {
            "attach_weights": self.attach,
            "wake": self.wake,
            "sleep": self.sleep,
        }
        for m in methods:
            fn = getattr(self.engine, m, None)
            if not callable(fn):
                raise ValueError(f"methods: the engine has no method {m!r}")
            out[m] = lambda fds, _fn=fn, **kw: _fn(**kw)
        return out


def serve_engine(
    member: Member,
    engine: Any,
    *,
    methods: Sequence[str] = (),
    track: dict[str, Region | Callable[[], Any]] | None = None,
    idle_timeout: float | None = None,
    until: Callable[[], bool] | None = None,
) -> int:
    """Serve the trainer's :class:`PeerEngine` calls with ``engine`` in this (the rollout) process, until
    the trainer stops it. Returns the number of calls served.

    Args:
        member: this process's :class:`Member` (role ``"rollout"``).
        engine: ``sleep(level)`` gives its memory back, ``wake(tags)`` takes it again (tags ``"weights"``,
            ``"kv_cache"``); ``attach_weights(weights)``, if it has one, is given the trainer's
            :class:`AttachedWeights` (also after each re-mapping; the addresses do not change).
        methods: other engine methods the trainer may call (e.g. ``"generate"``), JSON in and out.
        track: Regions (or callables giving them) to report by category, e.g. ``{"kv_cache": region}``.
        idle_timeout: give up (``TimeoutError``) after this long without a call.
        until: stop once it returns True (checked between calls), e.g. when the trainer is gone.

    Raises:
        PeerLostError: the broker went away.
    """
    seat = EngineSeat(member, engine, track)
    handlers = seat.handlers(methods)
    # The weights stay mapped when serving ends (the engine has them; a dead owner's last sync stays
    # readable through the Region): ``engine.weights.close()`` lets them go.
    return member.serve(handlers, idle_timeout=idle_timeout, until=until)
