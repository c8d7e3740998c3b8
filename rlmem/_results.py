"""The base of rlmem's typed results: frozen dataclasses a reader looks up by attribute, with ``as_dict()``
for JSON and logs."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Result"]


class Result:
    """Mixin for frozen result dataclasses."""

    def as_dict(self) -> dict[str, Any]:
        """The fields, nested results and containers included, as plain dicts and lists."""
        assert dataclasses.is_dataclass(self)
        return dataclasses.asdict(self)  # type: ignore[call-overload]
