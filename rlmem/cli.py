"""The ``rlmem`` command."""

from __future__ import annotations

import argparse
import sys

from . import __version__

_BENCHES = (
    "region",
    "phase_switch",
    "grpo_colocated",
    "activations",
    "comm",
    "token_budget",
    "plan_accuracy",
    "vmm_calls",
    "megatron",
    "megatron_parallel",
    "rollout",
    "numa",
    "real_model",
    "colocate",
    "families",
    "trl",
    "verify",
    "verl",
    "prefix",
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rlmem`` and ``python -m rlmem``."""
    from ._procs import dump_stacks_on_signal

    dump_stacks_on_signal()  # kill -USR1 PID: where a process (a rank under torchrun) is
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="rlmem", description="GPU memory for co-located RL post-training.")
    p.add_argument("--version", action="version", version=f"rlmem {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser("bench", help="run a benchmark (rlmem bench NAME --help for its options)")
    b.add_argument("name", choices=_BENCHES, help="which benchmark")
    sub.add_parser("train", help="co-located GRPO (rlmem train --help for its options)", add_help=False)
    sub.add_parser("serve", help="a rollout server (rlmem serve MODEL --help)", add_help=False)
    sub.add_parser("plan", help="memory estimate and which options fit (rlmem plan --help)", add_help=False)
    sub.add_parser("colocate", help="processes sharing one GPU: status (the ledger), broker", add_help=False)
    r = sub.add_parser("report", help="re-print a run's memory table and re-draw its plot")
    r.add_argument("run_dir", help="the out_dir of an rlmem train run")
    r.add_argument("--no-plot", action="store_true", help="only print")
    if not argv:
        p.print_help()
        return 2
    if argv[0] == "train":  # its own parser takes every remaining argument
        if any(a in ("-h", "--help") for a in argv[1:]):
            from .recipes.config import train_parser  # no torch: the help answers at once

            train_parser().parse_args(["--help"])
        from .recipes import grpo

        return grpo.main(argv[1:])
    if argv[0] == "bench" and len(argv) > 1 and argv[1] in _BENCHES:  # its own parser, --help included
        import importlib

        return importlib.import_module(f".benchmarks.{argv[1]}", __package__).main(argv[2:])
    if argv[0] == "serve":
        from .serve.main import main as main_serve

        return main_serve(argv[1:])
    if argv[0] == "colocate":
        from .colocate.status import main as main_colocate

        return main_colocate(argv[1:])
    if argv[0] == "plan":
        from .plan.cli import main as main_plan

        return main_plan(argv[1:])
    args, rest = p.parse_known_args(argv)
    if args.command == "report" and not rest:
        from .recipes.report import report  # not the training loop

        try:
            return report(args.run_dir, plot=not args.no_plot)
        except ValueError as e:
            print(f"rlmem report: error: {e}", file=sys.stderr)
            return 2
    p.error(f"unknown arguments: {' '.join(rest)}")
    return 2
