"""The ``rlmem`` command."""

from __future__ import annotations

import argparse
import sys

from . import __version__

_BENCHES = ("region", "phase_switch")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rlmem`` and ``python -m rlmem``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="rlmem", description="GPU memory for co-located RL post-training.")
    p.add_argument("--version", action="version", version=f"rlmem {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser("bench", help="run a benchmark (rlmem bench NAME --help for its options)")
    b.add_argument("name", choices=_BENCHES, help="which benchmark")
    if not argv:
        p.print_help()
        return 2
    args, rest = p.parse_known_args(argv)
    if args.command == "bench":
        import importlib

        return importlib.import_module(f".benchmarks.{args.name}", __package__).main(rest)
    p.error(f"unknown arguments: {' '.join(rest)}")
    return 2
