"""Calls between members, relayed by the broker: the caller's side (a reply turned back into the result or
the exception the peer's handler raised) and the callee's (the serve loop: each call dispatched to its
handler, its result or exception sent back with the member's report).

A handler's exception never leaves the serve loop: it travels to the caller by name and message, and an
:class:`~rlmem.OutOfMemoryError` keeps its fields, so the caller can raise it as its own. Descriptors that
come with a call or a reply are closed by whoever received them, once used.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from typing import Any

from ..errors import OutOfMemoryError
from ._link import Link
from ._outcomes import PeerLostError, RemoteError, describe

__all__ = ["call", "serve"]


def call(
    link: Link, role: str, method: str, args: dict[str, Any], fds: list[int], wait: float
) -> tuple[Any, list[int]]:
    """:meth:`Member.call` over ``link``, its answer awaited up to ``wait`` seconds."""
    reply, rfds = link.request(
        {"op": "call", "to": role, "method": method, "args": args},
        fds=fds,
        wait=wait,
        with_fds=True,
    )
    if reply["ok"]:
        return reply.get("result"), rfds
    for fd in rfds:
        os.close(fd)
    err = reply.get("error")
    if err in ("peer_lost", "absent"):
        peer = reply.get("peer")
        who = describe(peer) if peer else f"no {role!r} member"
        raise PeerLostError(f"{method}() on {role}: {who} is gone (it exited or was killed)", peer)
    if err == "OutOfMemoryError":
        raise OutOfMemoryError(
            reply.get("message", ""), needed=reply.get("needed", 0), free=reply.get("free", 0)
        )
    raise RemoteError(f"{method}() on {role} raised {err}: {reply.get('message', '')}")


def serve(
    link: Link,
    handlers: dict[str, Callable[..., Any]],
    *,
    role: str,
    report: Callable[[], dict[str, Any]],
    idle_timeout: float | None,
    until: Callable[[], bool] | None,
) -> int:
    """:meth:`Member.serve` over ``link``: each answer carries ``report()``; returns the calls answered."""
    served = 0
    link.send({"op": "serving"})
    while until is None or not until():
        try:
            item = link.calls.get(timeout=0.05 if until is not None else idle_timeout)
        except queue.Empty:
            if until is not None:
                continue
            raise TimeoutError(f"{role}: no call within {idle_timeout} s") from None
        if item is None:
            raise link.lost or PeerLostError("the broker closed the connection")
        msg, fds = item
        method = msg.get("method")
        reply: dict[str, Any] = {"op": "result", "cid": msg.get("cid")}
        out_fds: list[int] = []
        try:
            if method == "stop":
                reply.update(ok=True, result=None)
            else:
                fn = handlers.get(method)
                if fn is None:
                    raise ValueError(f"no method {method!r}; this member serves {sorted(handlers)}")
                result = fn(fds, **msg.get("args", {}))
                if isinstance(result, tuple):
                    result, out_fds = result
                reply.update(ok=True, result=result)
        except Exception as e:  # sent to the caller, who raises it
            reply.update(ok=False, error=type(e).__name__, message=str(e))
            if isinstance(e, OutOfMemoryError):
                reply.update(needed=e.needed, free=e.free)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            link.send({**reply, **report()}, out_fds)
        finally:
            for fd in out_fds:
                os.close(fd)
        served += 1
        if method == "stop":
            break
    return served
