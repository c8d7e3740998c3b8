"""A section of keys: a keyword-only dataclass owned by the component that reads it, taken whole from a
flat config (``rlmem train``'s ``GRPOConfig`` composes them)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Section"]


class Section:
    """Base of a section dataclass: :meth:`of` takes it whole from any object with its keys as attributes."""

    @classmethod
    def of(cls, config: Any) -> Any:
        """This section of ``config`` (``GRPOConfig``, or any object with these keys as attributes)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
