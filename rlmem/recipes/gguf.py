"""Moved to :mod:`rlmem.models.gguf` (models load in one place, for the recipe and ``rlmem serve`` alike);
these names keep working for one release, each with a ``DeprecationWarning``."""

from .._lazy import moved_names

__getattr__ = moved_names(
    __name__, dict.fromkeys(("INSTALL", "find", "load_model", "load_tokenizer"), "rlmem.models.gguf")
)
