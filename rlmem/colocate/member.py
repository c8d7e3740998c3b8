"""A process's seat at the broker: what it holds, the fenced release, the admitted acquire, and calls.

``Member(role)`` connects to the device's :class:`~rlmem.colocate.Broker` and reports, with every message,
what it holds by category (the Regions it :meth:`~Member.track`\\ s, resident bytes, and PyTorch's cache),
what it maps of another's, and the device's free and total bytes. A handoff is ``release()`` on one side,
then ``acquire()`` on the other:

- ``release(work)`` is a **fence**: it runs ``work`` (pauses, offloads), waits until the work queued on the
  device has finished, then until the device's free memory has risen by what this process stopped holding,
  and only then tells the broker. A release that returns is memory another process can have; one whose
  memory does not come back (another process still maps it) fails with :class:`FenceError`, naming who maps
  what (or, when no member maps anything, what else can hold it), instead of counting. What it waits for is
  what this process's memory took: on the host backend the pages its shared files hold, not pages never
  touched.
- ``acquire(need)`` waits (bounded) for the grant, then for ``need`` bytes to be free (a release in flight),
  and raises rlmem's :class:`~rlmem.OutOfMemoryError` naming the peers (pid, role, holdings) when they do not
  come; it changes nothing of the caller's, so whatever it had paused stays paused and a retry works.

Nothing here ever exits the process: every failure is an exception, every wait has a time-out.

This module owns the seat: holdings, the fence, the admission, and :class:`Member`'s whole public face. Under
it, one mechanism a module: the connection to the broker (``_link.py``: the socket, the reader thread,
requests matched to their replies), the calls between members (``_calls.py``: the caller's side and the serve
loop), and the errors and results (``_outcomes.py``), whose names are re-exported here.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .._units import MiB
from ..errors import OutOfMemoryError
from ..memory.region import Region
from . import _calls
from ._link import Link
from ._outcomes import Fence, FenceError, Grant, PeerLostError, RemoteError, describe, gib
from .broker import ROLES, default_path
from .device import mem_info, synchronize

__all__ = [
    "Fence",
    "FenceError",
    "Grant",
    "Member",
    "PeerLostError",
    "RemoteError",
    "describe",
    "fence_bytes",
]

_POLL = 0.001


def fence_bytes(let_go: int) -> int:
    """The rise of the device's free memory that counts a release of ``let_go`` bytes as back: all of it
    but 1/64 and 4 MiB (allocation granularity, memory the driver or another library keeps), never below 0.
    A negative ``let_go`` (more taken than given back) allows a fall of as much, with the same slack."""
    want = let_go - (abs(let_go) // 64 + 4 * MiB)
    return max(0, want) if let_go >= 0 else want


def _fence_cause(others: list[dict[str, Any]]) -> str:
    """Why a release's memory has not come back, as far as the ledger can tell: another member maps it (it is
    freed when that one unmaps it), or no member maps anything of another's, and what holds it is out of the
    ledger's sight."""
    if any(v for m in others for v in m.get("mapped", {}).values()):
        return (
            "; ".join(describe(m) for m in others)
            + " (memory another process still maps is freed only when it unmaps it)"
        )
    members = "; ".join(describe(m) + ", mapping nothing of another's" for m in others)
    return (
        (members or "no other member is at the broker")
        + "; no member maps this memory, so what keeps it is out of the ledger's sight: a descriptor of "
        "this process's export() still open, a process that is not a member mapping it, or memory another "
        "process took meanwhile"
    )


class Member:
    """This process at the broker of its device, in ``role``.

    Args:
        role: ``"train"``, ``"rollout"`` or ``"observer"`` (reads the ledger, holds nothing).
        path: the broker's socket (default: :func:`~rlmem.colocate.default_path` of ``device``).
        device: the device this process's memory is on (``"cpu"`` for the host backend).
        timeout: the default bound, in seconds, of every wait (connect, grant, memory, calls).
        name: a label shown in the ledger.

    Raises:
        ValueError: a bad argument.
        ConnectionError: no broker listens at ``path``.
        wire.PeerRefusedError: the broker runs as another user.
        RuntimeError: the broker refused the role (taken by another process; the message names it).
    """

    def __init__(
        self,
        role: str,
        *,
        path: str | os.PathLike[str] | None = None,
        device: str | torch.device = "cuda",
        timeout: float = 60.0,
        name: str = "",
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.role, self.device, self.timeout, self.name = role, dev, float(timeout), name
        self.path = Path(path) if path is not None else default_path(str(dev))
        self._tracked: dict[str, list[Callable[[], Iterable[Region]]]] = {}
        self._maps: dict[str, Callable[[], Iterable[Region]]] = {}
        self._baseline: tuple[int, dict[Any, int]] | None = None
        self._link = Link(
            self.path,
            {"op": "hello", "role": role, "name": name},
            timeout=self.timeout,
            report=self._report,
            thread_name=f"rlmem-member-{role}",
        )
        self.broker_pid = self._link.broker_pid
        self.lost_peers: list[dict[str, Any]] = self._link.lost_peers  # the reader appends to it
        ref = weakref.ref(self)
        atexit.register(lambda: (m := ref()) is not None and m.close())  # no reader left in a read at exit
        hello = self._link.hello
        self.pid: int = hello["pid"]
        self.capacity: int | None = hello.get("capacity")

    # -- what this process holds ------------------------------------------------------------------------
    def track(self, category: str, regions: Region | Callable[[], Iterable[Region]]) -> None:
        """Count ``regions`` (a Region, or a callable returning the current ones: e.g.
        ``lambda: state.regions("optimizer")``) under ``category`` in the ledger: their resident bytes are
        what this process holds, their paused bytes what an ``acquire`` needs by default. Attached Regions
        (another process's memory) are reported as mapped, not held."""
        if not isinstance(category, str) or not category:
            raise ValueError(f"category must be a non-empty str, got {category!r}")
        if isinstance(regions, Region):
            one = regions
            regions = lambda: (one,)  # noqa: E731
        if not callable(regions):
            raise ValueError(f"regions must be a Region or a callable, got {type(regions).__name__}")
        self._tracked.setdefault(category, []).append(regions)

    def track_train_state(self, state: Any) -> None:
        """Track a :class:`~rlmem.TrainState`'s Regions under their categories."""
        for cat in ("params", "grads", "optimizer", "buffers"):
            self.track(cat, lambda c=cat: state.regions(c))

    def _regions(self) -> Iterable[tuple[str, Region]]:
        for cat, sources in self._tracked.items():
            for src in sources:
                for r in src():
                    if not r.closed:
                        yield cat, r

    def holdings(self) -> dict[str, int]:
        """Resident bytes by category (attached Regions apart), and PyTorch's cached device memory."""
        out: dict[str, int] = {}
        for cat, r in self._regions():
            if not r.attached:
                out[cat] = out.get(cat, 0) + r.resident_bytes
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            out["torch_cache"] = int(torch.cuda.memory_reserved(self.device))
        return out

    def mapped(self) -> dict[str, int]:
        """Bytes this process maps of other processes' memory (attached Regions), by Region name."""
        out: dict[str, int] = {}
        for _, r in self._regions():
            if r.attached:
                out[r.name] = out.get(r.name, 0) + r.resident_bytes
        return out

    def _seen(self) -> dict[Any, int]:
        """What the device's free memory counts of this process's holdings, by holder: every category on a
        GPU (PyTorch's cache among them); on the host backend, each shareable Region's pages its files hold
        (shared memory), not private pages, and not pages never touched: a Region partly written, or resumed
        after a discard and not written since, gives back only what it took, and a fence that waited for its
        whole size would wait for what cannot come."""
        if self.device.type == "cuda":
            return self.holdings()
        return {(c, id(r)): r.committed_bytes for c, r in self._regions() if r.shareable and not r.attached}

    def paused_bytes(self) -> int:
        """Bytes of this process's own tracked Regions that are not resident: what resuming them takes."""
        return sum(r.nbytes - r.resident_bytes for _, r in self._regions() if not r.attached)

    def _report(self) -> dict[str, Any]:
        if self.role == "observer":  # holds nothing, and must not make a CUDA context to look
            return {}
        free, total = mem_info(self.device)
        return {
            "holdings": self.holdings(),
            "mapped": self.mapped(),
            "device": {"free": free, "total": total, "at": int(time.time() * 1000)},
        }

    # -- the handoff ------------------------------------------------------------------------------------
    def mark(self) -> None:
        """Take the baseline the next :meth:`release` measures from (the device's free bytes and what this
        process holds), for a release whose work was done piecemeal before it (``PhaseManager``'s order)."""
        self._baseline = (mem_info(self.device)[0], self._seen())

    def release(self, work: Callable[[], Any] | None = None, *, timeout: float | None = None) -> Fence:
        """Run ``work`` (what gives memory back), then fence: the device's queued work finished, and the free
        memory seen to rise by what this process stopped holding; then give the device up at the broker.

        Measured from the last :meth:`mark` if there was one since the last release, else from this call. A
        release that let nothing go (beyond the slack of :func:`fence_bytes`; what it took meanwhile, e.g. a
        rollout copy mapped again, is not let go) does not wait: the free memory is every process's, and
        what others took meanwhile is not this release's to wait for.

        Raises:
            FenceError: the memory did not come back within ``timeout`` (the message names what the other
                processes hold and map); the device is not given up.
            PeerLostError: the broker is gone.
        """
        limit = self._limit(timeout)
        t0 = time.perf_counter()
        if self._baseline is None:
            self.mark()
        free0, held0 = self._baseline or (0, {})
        if work is not None:
            work()
        t1 = time.perf_counter()
        synchronize(self.device)
        held1 = self._seen()
        gave = sum(max(0, n - held1.get(k, 0)) for k, n in held0.items())
        took = sum(max(0, n - held0.get(k, 0)) for k, n in held1.items())  # e.g. a rollout copy mapped again
        let_go = max(0, gave - took)
        # The free memory is every process's (on the host backend, the machine's shared memory): with nothing
        # of this process's to come back, a wait could only wait for others to give back what they took
        # meanwhile, and time out while they keep it.
        want = fence_bytes(gave - took) if fence_bytes(gave) > 0 else None
        deadline = time.monotonic() + limit
        rise = mem_info(self.device)[0] - free0
        while want is not None and rise < want:
            if time.monotonic() > deadline:
                others = [m for m in self.status()["members"] if m["role"] != self.role]
                raise FenceError(
                    f"release by {self.role}: the device's free memory rose {gib(max(0, rise))} of the "
                    f"{gib(let_go)} let go within {limit:g} s; {_fence_cause(others)}"
                )
            time.sleep(_POLL)
            rise = mem_info(self.device)[0] - free0
        fence = Fence(
            released_bytes=let_go,
            free_rise_bytes=max(0, rise),
            seconds=time.perf_counter() - t0,
            wait_s=time.perf_counter() - t1,
        )
        self._baseline = None
        self._link.request({"op": "release", "fence": fence.as_dict()}, wait=self.timeout)
        return fence

    def acquire(self, need: int | None = None, *, timeout: float | None = None) -> Grant:
        """Take the device: wait (bounded) for the holder's fenced release, then until ``need`` bytes are
        free (default: :meth:`paused_bytes`) and the ledger stays within the broker's capacity.

        Raises:
            OutOfMemoryError: the grant or the memory did not come within ``timeout``; the message names the
                peers (pid, role, what they hold). Nothing of this process's is changed; the grant is given
                back, so a retry works.
            PeerLostError: the broker is gone.
        """
        limit = self._limit(timeout)
        need = self.paused_bytes() if need is None else int(need)
        if need < 0:
            raise ValueError(f"need must be >= 0 bytes, got {need}")
        t0 = time.monotonic()
        reply = self._link.request({"op": "acquire", "timeout": limit}, wait=limit + self.timeout)
        if not reply["ok"]:
            free = mem_info(self.device)[0]
            raise OutOfMemoryError(
                f"{self.role} could not take {self.device}: {describe(reply['holder'])} has not released "
                f"it within {limit:g} s (needed {gib(need)}, {gib(free)} free)",
                needed=need,
                free=free,
                device=str(self.device),
            )
        others = reply["others"]
        deadline = t0 + limit
        last_status = time.monotonic()
        while True:
            free = mem_info(self.device)[0]
            over = self._over_capacity(need, others)
            if free >= need and not over:
                return Grant(waited_s=time.monotonic() - t0, free_bytes=free, others=others)
            if time.monotonic() > deadline:
                break
            if time.monotonic() - last_status > 0.05:  # a peer's release in flight shows in its holdings
                others = [m for m in self.status()["members"] if m["role"] != self.role]
                last_status = time.monotonic()
            time.sleep(_POLL)
        # give the grant back: a retry starts afresh
        self._link.request({"op": "release", "fence": None}, wait=self.timeout)
        cap = f"; the ledger's capacity is {gib(self.capacity)}" if self.capacity and over else ""
        raise OutOfMemoryError(
            f"{self.role} needs {gib(need)} on {self.device} and {gib(free)} is free after {limit:g} s"
            + f"{cap}; "
            + ("; ".join(describe(m) for m in others) or "no other member holds any")
            + ". Nothing of this process's was changed: retry once the peer has released",
            needed=need,
            free=free,
            device=str(self.device),
        )

    def _over_capacity(self, need: int, others: list[dict[str, Any]]) -> bool:
        if self.capacity is None:
            return False
        theirs = sum(sum(m.get("holdings", {}).values()) for m in others)
        return theirs + sum(self.holdings().values()) + need > self.capacity

    # -- calls between members --------------------------------------------------------------------------
    def wait_for(self, role: str, *, serving: bool = True, timeout: float | None = None) -> dict[str, Any]:
        """Wait (bounded) until a member of ``role`` has joined and, if ``serving``, answers calls (its
        :meth:`serve` has begun: it has made its memory, under the grant, and is ready); its ledger entry.

        Raises:
            TimeoutError: none did within ``timeout``.
        """
        limit = self._limit(timeout)
        msg = {"op": "wait_for", "role": role, "serving": serving, "timeout": limit}
        reply = self._link.request(msg, wait=limit + self.timeout)
        if not reply["ok"]:
            what = "serving calls" if serving else "joined"
            raise TimeoutError(f"no {role!r} process {what} at the broker {self.path} within {limit:g} s")
        return reply["peer"]

    def call(
        self,
        role: str,
        method: str,
        args: dict[str, Any] | None = None,
        *,
        fds: Iterable[int] = (),
        timeout: float | None = None,
    ) -> tuple[Any, list[int]]:
        """Call ``method`` of the member of ``role`` (its :meth:`serve` loop) with JSON-able ``args`` and
        ``fds``; its result and the descriptors that came back (the caller closes them).

        Raises:
            PeerLostError: the peer died before answering (or there is none).
            OutOfMemoryError: the peer's handler raised one (its fields are kept).
            RemoteError: it raised anything else.
            TimeoutError: no answer within ``timeout``.
        """
        return _calls.call(self._link, role, method, args or {}, list(fds), self._limit(timeout))

    def serve(
        self,
        handlers: dict[str, Callable[..., Any]],
        *,
        idle_timeout: float | None = None,
        until: Callable[[], bool] | None = None,
    ) -> int:
        """Answer calls from other members with ``handlers[method](fds, **args)`` (a result, or ``(result,
        fds)`` to send descriptors back) until a ``"stop"`` call, ``until()`` turns true, or no call came for
        ``idle_timeout`` seconds. A handler's exception is sent back, not raised here. Returns the number of
        calls answered.

        Raises:
            PeerLostError: the broker went away.
            TimeoutError: ``idle_timeout`` passed without a call.
        """
        return _calls.serve(
            self._link, handlers, role=self.role, report=self._report, idle_timeout=idle_timeout, until=until
        )

    def on_peer_lost(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(entry)`` (on the reader thread) when the broker says a peer died."""
        self._link.on_lost.append(fn)

    # -- the ledger -------------------------------------------------------------------------------------
    def report(self) -> None:
        """Send this process's holdings now (every message sends them too)."""
        self._link.request({"op": "report"}, wait=self.timeout)

    def status(self) -> dict[str, Any]:
        """The broker's ledger (see :meth:`Broker.ledger`)."""
        return self._link.request({"op": "status"}, wait=self.timeout)["ledger"]

    def close(self) -> None:
        """Leave the broker (a grant held is returned)."""
        self._link.close()

    def __enter__(self) -> Member:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- arguments --------------------------------------------------------------------------------------
    def _limit(self, timeout: float | None) -> float:
        if timeout is None:
            return self.timeout
        if not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        return float(timeout)
