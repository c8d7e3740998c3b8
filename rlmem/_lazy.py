"""Names of a package imported on first use (PEP 562), so importing the package loads none of their modules:
``rlmem --help`` answers without torch, and ``rlmem.train`` takes the engine protocol from ``rlmem.rollout``
without the sampler; names that moved keep their old place for one release, with a warning."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names", "moved_names"]


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


def moved_names(old: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for module ``old``, whose names in ``where`` moved to the (absolute) module
    named there: each still resolves from ``old``, with a ``DeprecationWarning`` naming its new place, until
    the next release removes it.

    Example:
        >>> __getattr__ = moved_names(__name__, {"build": "rlmem.models.presets"})
    """

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} has moved to {module}.{name}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)

    return __getattr__
