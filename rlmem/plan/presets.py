"""Moved to :mod:`rlmem.models.presets` (models load in one place: the planner, the recipe, ``rlmem serve``
and the benchmarks); these names keep working for one release, each with a ``DeprecationWarning``."""

from .._lazy import moved_names

__getattr__ = moved_names(
    __name__, dict.fromkeys(("LLAMA", "PRESETS", "QWEN2", "build", "vocab_size"), "rlmem.models.presets")
)
