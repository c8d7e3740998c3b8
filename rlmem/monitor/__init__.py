"""Watching memory: a timeline of device and host memory by phase and category across steps, with leak
detection (a phase whose memory grows step after step). Reads :mod:`rlmem.memory` for host backups; nothing
else of rlmem.
"""

from .timeline import Leak, MemoryLeakWarning, MemoryTimeline, PhaseRecord, PhaseSummary

__all__ = ["Leak", "MemoryLeakWarning", "MemoryTimeline", "PhaseRecord", "PhaseSummary"]
