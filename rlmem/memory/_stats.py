"""What a Region reports about itself: :class:`RegionStats`, and the record of its pauses and resumes.

Owns the snapshot type, the counts and figures of the last pause and resume as the Region's operations
leave them (:class:`Timings`), and turning those into seconds and GB/s; a non-blocking resume's time is
read from its CUDA events once they have completed, never waited for.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RegionStats", "Timings"]


@dataclass(frozen=True)
class RegionStats:
    """A snapshot of a Region's sizes and its last pause and resume.

    Times are wall-clock seconds from the call until the memory was released (pause) or the contents were
    back on the device (resume); ``*_gbps`` is bytes copied over that time, in GB/s (1e9 bytes per second).
    Figures of a non-blocking resume that has not finished yet are None.
    """

    name: str
    device: str
    nbytes: int
    chunk_bytes: int
    used_bytes: int
    resident_bytes: int
    backup_bytes: int
    paused: bool
    pauses: int
    resumes: int
    last_pause_kept: bool | None
    last_pause_bytes: int
    last_pause_s: float | None
    last_pause_gbps: float | None
    last_resume_bytes: int
    last_resume_s: float | None
    last_resume_gbps: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Timings:
    """The counts of a Region's pauses and resumes and the figures of the last of each.

    ``last_pause`` holds ``kept`` (None before any pause), ``bytes`` copied and ``s``; ``last_resume`` holds
    ``bytes``, ``s`` and, for a non-blocking resume whose time is not known yet, ``events`` (its start and
    done CUDA events). The Region writes them under its lock as its operations go.
    """

    def __init__(self) -> None:
        self.pauses = 0
        self.resumes = 0
        self.last_pause: dict[str, Any] = {"kept": None, "bytes": 0, "s": None}
        self.last_resume: dict[str, Any] = {"bytes": 0, "s": None, "events": None}

    def pause_began(self, keep: bool, *, again: bool) -> None:
        """A pause starts: its figures reset, and counted unless ``again`` (a pause of a Region already
        paused, releasing what a pause that failed part-way left)."""
        if not again:
            self.pauses += 1
        self.last_pause = {"kept": keep, "bytes": 0, "s": None}

    def pause_ended(self, copied: int, t0: float) -> None:
        """The pause begun at ``t0`` (``time.perf_counter()``) has released the memory; ``copied`` bytes
        were kept."""
        self.last_pause["bytes"] = copied
        self.last_pause["s"] = time.perf_counter() - t0

    def resume_ended(self, copied: int, t0: float, events: tuple[Any, Any] | None) -> None:
        """The resume begun at ``t0`` has copied ``copied`` bytes back: done now (``events`` None), or
        queued between the CUDA ``events`` (start, done), its time read from them later."""
        s = None if events is not None else time.perf_counter() - t0
        self.last_resume = {"bytes": copied, "s": s, "events": events}

    def figures(self) -> dict[str, Any]:
        """The :class:`RegionStats` fields these give, a pending resume's time filled in once its events
        have completed."""
        lr = self.last_resume
        if lr["s"] is None and lr["events"] is not None:
            start, done = lr["events"]
            if done.query():
                lr["s"] = start.elapsed_time(done) / 1e3
                lr["events"] = None
        lp = self.last_pause
        return {
            "pauses": self.pauses,
            "resumes": self.resumes,
            "last_pause_kept": lp["kept"],
            "last_pause_bytes": lp["bytes"],
            "last_pause_s": lp["s"],
            "last_pause_gbps": _gbps(lp["bytes"], lp["s"]),
            "last_resume_bytes": lr["bytes"],
            "last_resume_s": lr["s"],
            "last_resume_gbps": _gbps(lr["bytes"], lr["s"]),
        }


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    """``nbytes`` over ``seconds`` in GB/s; None where there is no figure (nothing copied, no time)."""
    if seconds is None or nbytes == 0 or seconds <= 0:
        return None
    return nbytes / seconds / 1e9
