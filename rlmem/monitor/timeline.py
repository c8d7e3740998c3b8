"""MemoryTimeline: device and host memory over time, tagged by phase and step, with leak detection.

Each sample records PyTorch's allocated and reserved bytes and the driver's free bytes on the device, the
pinned host bytes rlmem holds, the process RSS, and the bytes of any categories the caller tracks (for
example parameters, optimizer states, KV cache). Sampling reads counters only: no device synchronisation
unless ``sync=True``, so it can stay on in a training loop.

Example:
    >>> tl = MemoryTimeline("cuda")
    >>> tl.track("kv_cache", lambda: engine.region.resident_bytes)
    >>> with tl.phase("rollout", step):
    ...     engine.generate(prompts)
    >>> print(tl.report()); tl.plot("memory.png"); tl.check_leaks()
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._results import Result
from .._units import GiB, MiB
from ..memory import host_memory_held

__all__ = ["Leak", "MemoryLeakWarning", "MemoryTimeline", "PhaseRecord", "PhaseSummary"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryLeakWarning(UserWarning):
    """A phase's memory grows from step to step."""


@dataclass(frozen=True)
class PhaseRecord(Result):
    """One phase interval: its name and step, start and end (seconds since the timeline began), the peak
    allocated device bytes in it (None on the CPU), and what the caller noted in it (``extra``)."""

    name: str
    step: int
    start: float
    end: float
    peak: int | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Leak(Result):
    """Growth :meth:`MemoryTimeline.leaks` found: a metric (``category``) of a phase rising by
    ``bytes_per_step`` (fitted) over ``steps`` steps."""

    phase: str
    category: str
    bytes_per_step: float
    steps: int


@dataclass(frozen=True)
class PhaseSummary(Result):
    """One phase over the run: intervals, seconds in all and on average, peak allocated device bytes, and
    the largest value of every metric (``maxima``: device used/allocated/reserved, host backups, RSS, each
    tracked category) over the samples taken in it."""

    count: int
    seconds: float
    mean_seconds: float | None
    peak: int | None
    maxima: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """Flat, as run summaries and benchmark results store it: ``max_<metric>`` keys."""
        out: dict[str, Any] = {
            "count": self.count,
            "seconds": self.seconds,
            "peak": self.peak,
            "mean_seconds": self.mean_seconds,
        }
        out.update({f"max_{k}": v for k, v in self.maxima.items()})
        return out


def text_table(rows: list[list[str]]) -> str:
    """``rows`` (the header first) as aligned columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class MemoryTimeline:
    """Samples of memory, tagged by phase and step.

    Args:
        device: the CUDA device to watch, or ``"cpu"`` (host figures and tracked categories only).
        sync: synchronise the device before each sample (exact figures for work still queued; slower).
        leak_tolerance_bytes: growth per step below which a phase is not reported as leaking.
        leak_warmup_steps: steps ignored by leak detection (lazily created state, allocator warm-up).

    Raises:
        ValueError: a bad device or a negative tolerance / warm-up.
    """

    def __init__(
        self,
        device: str | torch.device | int = "cuda",
        *,
        sync: bool = False,
        leak_tolerance_bytes: int = 1 << 20,
        leak_warmup_steps: int = 2,
    ) -> None:
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}") from e
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
        if not isinstance(leak_tolerance_bytes, int) or leak_tolerance_bytes < 0:
            raise ValueError(f"leak_tolerance_bytes must be an int >= 0, got {leak_tolerance_bytes!r}")
        if not isinstance(leak_warmup_steps, int) or leak_warmup_steps < 0:
            raise ValueError(f"leak_warmup_steps must be an int >= 0, got {leak_warmup_steps!r}")
        self.sync = sync
        self.leak_tolerance_bytes = leak_tolerance_bytes
        self.leak_warmup_steps = leak_warmup_steps
        self.samples: list[dict[str, Any]] = []
        self.phases: list[PhaseRecord] = []  # one per phase interval
        self._sources: dict[str, Callable[[], int]] = {}
        self._t0 = time.perf_counter()

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def track(self, category: str, fn: Callable[[], int]) -> None:
        """Record ``fn()`` (bytes) under ``category`` in every sample.

        Raises:
            ValueError: ``category`` is empty or already tracked, or ``fn`` is not callable.
        """
        if not isinstance(category, str) or not category or category in self._sources:
            raise ValueError(f"category must be a new, non-empty name; got {category!r}")
        if not callable(fn):
            raise ValueError(f"fn for category {category!r} must be callable")
        self._sources[category] = fn

    def sample(self, phase: str, step: int, **extra: Any) -> dict[str, Any]:
        """Take one sample now and return it."""
        s: dict[str, Any] = {"t": time.perf_counter() - self._t0, "phase": phase, "step": step}
        if self.on_cuda:
            if self.sync:
                torch.cuda.synchronize(self.device)
            s["allocated"] = torch.cuda.memory_allocated(self.device)
            s["reserved"] = torch.cuda.memory_reserved(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            s["free"], s["total"], s["used"] = free, total, total - free
        held = host_memory_held()
        s["pinned"] = held["pinned"]
        s["host_backup"] = held["pinned"] + held["pageable"]
        s["rss"] = _rss()
        s["categories"] = {k: int(fn()) for k, fn in self._sources.items()}
        s.update(extra)
        self.samples.append(s)
        return s

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[dict[str, Any]]:
        """Samples on entry and exit, and records the phase (a :class:`PhaseRecord` in :attr:`phases`) with
        its peak allocated device bytes. Yields a dict for the caller's own figures, kept as the record's
        ``extra``.

        The device's peak counter is reset on entry (``torch.cuda.reset_peak_memory_stats``).
        """
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        # The entry sample shows what the previous phase left: plotted, but not counted as this phase's.
        start = self.sample(name, step, entry=True)["t"]
        extra: dict[str, Any] = {}
        try:
            yield extra
        finally:
            end = self.sample(name, step)["t"]
            peak = torch.cuda.max_memory_allocated(self.device) if self.on_cuda else None
            self.phases.append(
                PhaseRecord(name=name, step=step, start=start, end=end, peak=peak, extra=extra)
            )

    # -- analysis ---------------------------------------------------------------------------------------

    def _metrics(self, s: dict[str, Any]) -> dict[str, int]:
        keys = ("used", "allocated", "reserved", "pinned", "host_backup", "rss")
        out = {k: s[k] for k in keys if s.get(k) is not None}
        out.update(s.get("categories", {}))
        return out

    def leaks(self) -> list[Leak]:
        """Phases whose memory at the end of the phase grows across steps by more than the tolerance.

        For every phase and metric (device used/allocated/reserved, host backups, RSS, each tracked category),
        the value at the end of each step's phase after the warm-up is fitted with a line; growth is reported
        when the slope exceeds ``leak_tolerance_bytes`` per step over the whole window *and* over its second
        half, and the metric rose: growth that levels off (lazily loaded kernels, allocator arenas) is not a
        leak.
        """
        ends: dict[tuple[str, int], dict[str, int]] = {}
        for s in self.samples:
            ends[(s["phase"], s["step"])] = self._metrics(s)
        series: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
        steps = sorted({step for _, step in ends})
        skip = set(steps[: self.leak_warmup_steps])
        for (phase, step), metrics in sorted(ends.items(), key=lambda kv: kv[0][1]):
            if step in skip:
                continue
            for k, v in metrics.items():
                series[(phase, k)].append((step, v))
        found = []
        for (phase, k), pts in series.items():
            if len(pts) < 3:
                continue
            slope = _slope(pts)
            late = _slope(pts[len(pts) // 2 :]) if len(pts) >= 6 else slope
            if min(slope, late) > self.leak_tolerance_bytes and pts[-1][1] > pts[0][1]:
                found.append(Leak(phase=phase, category=k, bytes_per_step=slope, steps=len(pts)))
        return found

    def check_leaks(self) -> list[Leak]:
        """Warn (:class:`MemoryLeakWarning`) for each growth :meth:`leaks` finds, and return them."""
        found = self.leaks()
        for f in found:
            warnings.warn(
                f"memory grows in phase {f.phase!r}: {f.category} by "
                f"{f.bytes_per_step / MiB:.1f} MiB per step over {f.steps} steps",
                MemoryLeakWarning,
                stacklevel=2,
            )
        return found

    def summary(self) -> dict[str, PhaseSummary]:
        """Per phase: how many intervals, seconds, peak allocated, and the max of every metric (over the
        samples taken in the phase; the one taken on entry shows the previous phase's memory)."""
        acc: dict[str, dict[str, Any]] = {}

        def entry(name: str) -> dict[str, Any]:
            return acc.setdefault(name, {"count": 0, "seconds": 0.0, "peak": None, "maxima": {}})

        for rec in self.phases:
            d = entry(rec.name)
            d["count"] += 1
            d["seconds"] += rec.end - rec.start
            if rec.peak is not None:
                d["peak"] = max(d["peak"] or 0, rec.peak)
        for s in self.samples:
            if s.get("entry"):
                continue
            mx = entry(s["phase"])["maxima"]
            for k, v in self._metrics(s).items():
                mx[k] = max(mx.get(k, 0), v)
        return {
            name: PhaseSummary(mean_seconds=d["seconds"] / d["count"] if d["count"] else None, **d)
            for name, d in acc.items()
        }

    def report(self) -> str:
        """A table: one row per phase, its peak device memory and the largest value of every metric."""
        summ = self.summary()
        if not summ:
            return "(no samples)"
        keys = sorted({k for d in summ.values() for k in d.maxima}, key=metric_order)
        biggest = max(
            [d.peak or 0 for d in summ.values()] + [v for d in summ.values() for v in d.maxima.values()]
        )
        unit, unit_name = (GiB, "GiB") if biggest >= GiB else (MiB, "MiB")
        head = ["phase", "count", "mean s", "peak alloc", *keys]
        rows = [head]
        for name, d in summ.items():
            cells = [
                name,
                str(d.count),
                f"{d.mean_seconds:.3f}" if d.mean_seconds else "-",
                _size(d.peak, unit),
            ]
            cells += [_size(d.maxima.get(k), unit) for k in keys]
            rows.append(cells)
        return f"memory by phase ({unit_name}; maxima over the run)\n" + text_table(rows)

    def plot(self, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
        """Draw memory by category over time, phases shaded, to a PNG at ``path``.

        Raises:
            RuntimeError: matplotlib is not installed (``pip install matplotlib``).
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise RuntimeError("MemoryTimeline.plot needs matplotlib: pip install matplotlib") from e
        if not self.samples:
            raise RuntimeError("MemoryTimeline.plot: no samples")
        t = [s["t"] for s in self.samples]
        cats = list(dict.fromkeys(k for s in self.samples for k in s.get("categories", {})))
        stacks = [[s.get("categories", {}).get(c, 0) / GiB for s in self.samples] for c in cats]
        labels = list(cats)
        if "used" in self.samples[0]:
            # The rest of what the device has in use: activations, PyTorch's cached blocks, the CUDA context.
            other = [
                max(0.0, s["used"] / GiB - sum(st[i] for st in stacks)) for i, s in enumerate(self.samples)
            ]
            stacks.append(other)
            labels.append("other (activations, cache, context)")
        fig, (ax, hx) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=[3, 1])
        if stacks:
            ax.stackplot(t, *stacks, labels=labels, step="post", alpha=0.85)
        if "used" in self.samples[0]:
            used = [s["used"] / GiB for s in self.samples]
            ax.step(t, used, where="post", color="k", lw=1.2, label="device in use")
            reserved = [s["reserved"] / GiB for s in self.samples]
            ax.step(t, reserved, where="post", color="0.4", lw=1, ls="--", label="PyTorch reserved")
        colors = {}
        palette = ["#dbe9f6", "#fde0c5", "#e3f1da", "#eadcf0"]
        for rec in self.phases:
            c = colors.setdefault(rec.name, palette[len(colors) % len(palette)])
            for a in (ax, hx):
                a.axvspan(rec.start, rec.end, color=c, zorder=0, lw=0)
        ax.set_ylabel("device GiB" if "reserved" in self.samples[0] else "GiB (tracked)")
        ax.legend(loc="upper left", fontsize=8, ncol=3)
        hx.step(t, [s["rss"] / GiB for s in self.samples], where="post", label="process RSS")
        hx.step(t, [s["host_backup"] / GiB for s in self.samples], where="post", label="rlmem host backups")
        hx.set_ylabel("host GiB")
        hx.set_xlabel("seconds (shaded: " + ", ".join(f"{n}" for n in colors) + ")")
        hx.legend(loc="upper left", fontsize=8)
        ax.set_title(title or "memory timeline")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    # -- persistence --------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write samples and phase intervals as JSON lines (``{"sample": ...}`` / ``{"phase": ...}``)."""
        path = Path(path)
        with path.open("w") as f:
            f.write(json.dumps({"device": str(self.device)}) + "\n")
            for s in self.samples:
                f.write(json.dumps({"sample": s}) + "\n")
            for rec in self.phases:
                f.write(json.dumps({"phase": rec.as_dict()}) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MemoryTimeline:
        """Read what :meth:`save` wrote (no device is touched).

        Raises:
            ValueError: the file is not a saved timeline.
        """
        lines = Path(path).read_text().splitlines()
        try:
            head = json.loads(lines[0])
            tl = cls.__new__(cls)
            tl.device = torch.device(head["device"])
            tl.sync, tl.leak_tolerance_bytes, tl.leak_warmup_steps = False, 1 << 20, 2
            tl.samples, tl.phases, tl._sources, tl._t0 = [], [], {}, 0.0
            for line in lines[1:]:
                rec = json.loads(line)
                if "sample" in rec:
                    tl.samples.append(rec["sample"])
                else:
                    tl.phases.append(PhaseRecord(**rec["phase"]))
        except (IndexError, KeyError, TypeError, json.JSONDecodeError, RuntimeError) as e:
            raise ValueError(f"{path} is not a saved MemoryTimeline: {e}") from e
        return tl


def _slope(pts: list[tuple[int, int]]) -> float:
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else 0.0


def metric_order(k: str) -> tuple[int, str]:
    """The sort key of the memory table's columns: totals first, host memory last."""
    fixed = ["used", "allocated", "reserved"]
    tail = ["pinned", "host_backup", "rss"]
    if k in fixed:
        return (0, str(fixed.index(k)))
    if k in tail:
        return (2, str(tail.index(k)))
    return (1, k)


def _size(v: Any, unit: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v / unit:.2f}"
