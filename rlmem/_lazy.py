"""Names of a package imported on first use (PEP 562), so importing the package loads none of their modules:
``rlmem --help`` answers without torch, and ``rlmem.train`` takes the engine protocol from ``rlmem.rollout``
without the sampler."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``where`` comes from its module (relative to
    ``package``, or absolute) when first asked for, and is kept in the package's namespace after."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
