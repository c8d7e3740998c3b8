"""What a member's operations end in: the errors (a peer lost, a fence not met, a peer's handler raising), the
typed results of a handoff (:class:`Fence`, :class:`Grant`), and a ledger entry as the messages name it.

Apart from :mod:`~rlmem.colocate.member` so that the connection under it (``_link.py``) and the calls between
members (``_calls.py``) raise and name the same things; ``member`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._results import Result

__all__ = ["Fence", "FenceError", "Grant", "PeerLostError", "RemoteError", "describe", "gib"]


class PeerLostError(ConnectionError):
    """The broker or a peer process went away (it exited, or was killed).

    Attributes:
        peer: the lost peer's ledger entry (pid, role, holdings), when known.
    """

    def __init__(self, message: str, peer: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class FenceError(TimeoutError):
    """A release whose memory did not come back to the device in time (another process still maps it, or
    something out of the ledger's sight holds it: the message says which)."""


class RemoteError(RuntimeError):
    """A call the peer received raised; the message is the peer's."""


@dataclass(frozen=True)
class Fence(Result):
    """What a fenced :meth:`Member.release` saw: bytes it let go by its holdings (on the host backend, the
    pages its shared files held), the rise of the device's free memory, and the seconds from the start of
    the work to the fence (``wait_s``: spent waiting for the device and the memory after the work)."""

    released_bytes: int
    free_rise_bytes: int
    seconds: float
    wait_s: float


@dataclass(frozen=True)
class Grant(Result):
    """What :meth:`Member.acquire` got: the seconds it waited (for the grant, then for the memory), the
    device's free bytes once admitted, and the other members as the ledger had them."""

    waited_s: float
    free_bytes: int
    others: list[dict[str, Any]]


def gib(n: int) -> str:
    """Bytes as the ledger's messages write them: ``30.00 GiB``."""
    return f"{n / (1 << 30):.2f} GiB"


def describe(member: dict[str, Any]) -> str:
    """One ledger entry as text: ``pid 123 (rollout) holding kv_cache 30.00 GiB, ...``."""
    held = ", ".join(f"{k} {gib(v)}" for k, v in sorted(member.get("holdings", {}).items()) if v)
    mapped = ", ".join(f"{k} {gib(v)}" for k, v in sorted(member.get("mapped", {}).items()) if v)
    text = f"pid {member.get('pid')} ({member.get('role')}) holding {held or 'nothing'}"
    return text + (f", mapping another's {mapped}" if mapped else "")
