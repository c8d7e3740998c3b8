"""``rlmem colocate status``: the ledger of a device's broker as a table, and ``rlmem colocate broker``.

The table has a row per process (role, pid, whether it holds the device) and a column per category of what
it holds (bytes resident on the device), what it maps of another's, and beside them the device's free and
total bytes as the processes last reported them.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

from .broker import Broker, default_path

__all__ = ["format_ledger", "main"]


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def format_ledger(ledger: dict[str, Any]) -> str:
    """The ledger (:meth:`Broker.ledger`) as text: GiB by role and category, the device's totals."""
    members = ledger.get("members", [])
    cats = sorted({c for m in members for c in m.get("holdings", {})})
    head = ["role", "pid", "device", *cats, "total", "maps others'"]
    rows = [head]
    for m in members:
        held = m.get("holdings", {})
        rows.append(
            [
                m["role"],
                str(m["pid"]),
                "held" if m.get("holds_device") else "",
                *(_gib(held.get(c, 0)) for c in cats),
                _gib(sum(held.values())),
                _gib(sum(m.get("mapped", {}).values())),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    dev = ledger.get("device", {})
    total_held = sum(sum(m.get("holdings", {}).values()) for m in members)
    lines.append(
        f"GiB. ledger total {_gib(total_held)}; device free {_gib(dev.get('free'))} of "
        f"{_gib(dev.get('total'))}"
        + (f"; capacity {_gib(ledger['capacity'])}" if ledger.get("capacity") else "")
        + f"; broker at {ledger.get('path')}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``rlmem colocate status|broker``."""
    p = argparse.ArgumentParser(prog="rlmem colocate", description="processes sharing one GPU")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("status", help="print the ledger of the device's broker")
    b = sub.add_parser("broker", help="run a broker for the device until interrupted")
    for q in (s, b):
        q.add_argument("--device", default="cuda:0", help="the device whose broker (default cuda:0)")
        q.add_argument("--path", default=None, help="the broker's socket (default: the device's)")
    s.add_argument("--json", action="store_true", help="print the ledger as JSON")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    b.add_argument("--capacity", type=int, default=None, help="bytes the ledger may add up to")
    args = p.parse_args(argv)
    path = args.path or default_path(args.device)
    if args.what == "broker":
        broker = Broker(path, capacity=args.capacity).start()
        print(f"rlmem colocate: broker for {args.device} at {broker.path} (Ctrl-C ends it)", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            broker.close()
        return 0
    from .member import Member

    try:
        with Member("observer", path=path, device="cpu", timeout=args.timeout) as m:
            ledger = m.status()
    except (ConnectionError, TimeoutError) as e:
        print(f"rlmem colocate status: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(ledger, indent=1) if args.json else format_ledger(ledger))
    return 0
