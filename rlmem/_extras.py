"""rlmem's optional packages come in extras (``pyproject.toml``): a command that needs one that is not
installed says which extra brings it and how to install it, in one line, instead of a traceback ending in
``ModuleNotFoundError``."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["install_hint", "need", "require"]


def install_hint(extra: str) -> str:
    """How to install rlmem's extra ``extra``: from a checkout (``-e``), or the published package."""
    return f'pip install -e ".[{extra}]" (in a checkout of rlmem; else pip install "rlmem[{extra}]")'


def need(module: str, *, extra: str, what: str) -> ModuleType:
    """Import ``module``, which ``what`` (a command or a setting, for the message) needs from ``extra``.

    Raises:
        ValueError: ``module``, or a package it imports, is not installed; the message names ``module``,
            the missing package, ``extra`` and :func:`install_hint`.

    Example:
        >>> uvicorn = need("uvicorn", extra="serve", what="rlmem serve")  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = (e.name or module).split(".")[0]
        why = f"{module} is not installed"
        if missing != module.split(".")[0]:  # installed, but a package of its own is not
            why = f"{module} cannot be imported: {missing} is not installed"
        raise ValueError(f"{what} needs rlmem's [{extra}] extra ({why}): {install_hint(extra)}") from None


def require(extra: str, *modules: str, what: str) -> None:
    """:func:`need` each of ``modules``, in order (the first missing one is named)."""
    for m in modules:
        need(m, extra=extra, what=what)
