"""The one skeleton of every rlmem benchmark: ``rlmem bench NAME`` parses the common arguments, picks the
device, names the machine, and at the end prints the summary and the targets and writes the JSON file
(``bench/results/<name>-<machine>.json`` when run from a checkout) with the header every committed result
shares (``name, machine, date, versions, host, device``), the benchmark's own sections, then ``summary,
targets, targets_met``.

A benchmark module declares ``NAME``, its ``TARGETS`` (``summary key: (op, value)``) and a
``main(argv)`` that builds a :class:`Run`, adds its own arguments, measures, prints its table and calls
:meth:`Run.finish`. Where a figure misses its target it is written as measured; the definition of a
benchmark never moves to meet one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ._common import check_targets, environment, machine_name, summary_lines, targets_text, write_json

__all__ = ["Run", "results_dir"]


def _card(machine: str) -> str | None:
    """The card of a machine name (``nvidia-h100-x2`` -> ``h100``), None for other names."""
    parts = machine.split("-")
    return parts[1] if len(parts) == 3 and parts[0] == "nvidia" else None


def results_dir() -> Path | None:
    """``bench/results`` of the checkout rlmem runs from, or None for an installed copy (print only)."""
    d = Path(__file__).resolve().parents[2] / "bench" / "results"
    return d if d.is_dir() else None


class Run:
    """One invocation of benchmark ``name``.

    Args:
        name: the benchmark (``rlmem bench NAME``), also the JSON file's stem.
        description: the first line of ``--help``.
        targets: ``summary key: (op, value)`` checked by :meth:`finish`.
    """

    def __init__(
        self, name: str, description: str, targets: dict[str, tuple[str, float]] | None = None
    ) -> None:
        self.name = name
        self.targets = dict(targets or {})
        self.parser = argparse.ArgumentParser(prog=f"rlmem bench {name}", description=description)
        self.parser.add_argument(
            "--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)"
        )
        self.parser.add_argument("--machine", default=None, help="machine name in the JSON file name")
        self.parser.add_argument("--json", default=None, help="write the JSON here (default: bench/results/)")
        self.args = argparse.Namespace()
        self.device = torch.device("cpu")
        self.machine = "cpu"

    def parse(self, argv: list[str] | None) -> argparse.Namespace:
        """Parse ``argv``; resolves :attr:`device` and :attr:`machine`. ``kill -USR1`` then prints the
        process's Python stacks (a part's ranks killed past their time say where they were)."""
        from .._procs import dump_stacks_on_signal

        dump_stacks_on_signal()
        self.args = self.parser.parse_args(argv)
        dev = torch.device(self.args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.machine = self.args.machine or machine_name(dev)
        here = machine_name(dev)
        if self.args.machine and _card(self.machine) and _card(here) and _card(self.machine) != _card(here):
            # a file named for one card holding another card's figures would be read as the named one's
            self.error(f"--machine {self.machine!r} names another card than this device's ({here!r})")
        return self.args

    def error(self, message: str) -> None:
        """Exit with a usage error naming the argument (argparse's form)."""
        self.parser.error(message)

    def needs_cuda(self, count: int = 1) -> bool:
        """Whether ``count`` CUDA devices are here; says so on stderr when not."""
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have >= count:
            return True
        print(f"the {self.name} benchmark needs {count} CUDA device(s), found {have}", file=sys.stderr)
        return False

    @property
    def json_path(self) -> Path | None:
        if self.args.json:
            return Path(self.args.json)
        d = results_dir()
        return None if d is None else d / f"{self.name}-{self.machine}.json"

    def previous_file(self) -> dict[str, Any]:
        """The JSON file this run would write, if it exists (for benchmarks whose parts are measured in
        separate calls and merged).

        Raises:
            SystemExit: (a usage error) the file was measured on another device: merged, its figures would
                sit under this device's name.
        """
        p = self.json_path
        if p is None or not p.is_file():
            return {}
        old = json.loads(p.read_text())
        was, now = old.get("device", {}).get("name"), environment(self.device)["device"]["name"]
        if was is not None and was != now:
            self.error(f"--merge: {p} was measured on {was!r}, this run is on {now!r} (merge in one device)")
        return old

    def previous(self) -> dict[str, Any]:
        """The ``results`` of :meth:`previous_file`."""
        return self.previous_file().get("results", {})

    def finish(
        self,
        summary: dict[str, Any],
        *,
        met: dict[str, bool] | None = None,
        name_key: str = "name",
        **sections: Any,
    ) -> dict[str, bool]:
        """Check the targets, print the summary lines and write the JSON; returns which targets were met.

        Args:
            summary: the figures targets are checked against.
            met: targets met, where the benchmark decides them itself (default: checked here).
            name_key: the key naming the benchmark (``"benchmark"`` in files first written that way; kept
                so committed results stay comparable).
            sections: the file's own top-level keys, in order, between the environment and the summary
                (typically ``config`` and ``results``).
        """
        met = check_targets(summary, self.targets) if met is None else met
        print(summary_lines(summary, met))
        payload = {
            name_key: self.name,
            "machine": self.machine,
            **environment(self.device),
            **sections,
            "summary": summary,
            "targets": targets_text(self.targets),
            "targets_met": met,
        }
        p = self.json_path
        if p is not None:
            print(f"wrote {write_json(p, payload)}")
        return met
