"""Sizes and counts as people write them, parsed and printed one way everywhere (CLIs, configs, messages).

Bytes: ``80GiB``, ``80G`` (a bare K/M/G/T is binary, as ``nvidia-smi`` and schedulers use it), ``85GB``
(decimal), ``512MiB``, ``1.5GiB``, ``4096B``. A number without a unit where bytes are meant is refused: ``80``
would be 80 bytes, never what was meant. Counts (tokens, sequences): ``8192``, ``8k`` (x 1000), ``8K``
(x 1024), ``1.5e9``, ``2M``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["GiB", "MiB", "format_bytes", "parse_bytes", "parse_count", "round_up"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


_BYTE_UNITS = {
    "b": 1,
    "k": KiB,
    "m": MiB,
    "g": GiB,
    "t": TiB,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
_SIZE = re.compile(_NUMBER + r"([A-Za-z]*)\s*")
BYTE_FORMS = "80GiB, 80G, 85GB, 512MiB or 4096B"
COUNT_FORMS = "8192, 8k (x1000), 8K (x1024) or 1.5e9"


def parse_bytes(value: Any, field: str, *, bare: bool = False, zero: bool = False) -> int:
    """``value`` as a number of bytes.

    Args:
        value: a string with a unit (see the module docstring), or an int where ``bare`` allows it.
        field: the argument or config key, named in errors.
        bare: accept a number without a unit as bytes (Python arguments whose name says bytes).
        zero: accept 0.

    Raises:
        ValueError: naming ``field`` and the accepted forms.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{field} must be a size such as {BYTE_FORMS}; got {value!r}")
    if isinstance(value, (int, float)):
        if not bare:
            raise ValueError(
                f"{field}: {value!r} has no unit; write a size such as {BYTE_FORMS} "
                f"(a bare number would be bytes)"
            )
        n = value
    else:
        m = _SIZE.fullmatch(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit is None or (unit and unit not in _BYTE_UNITS):
            raise ValueError(f"{field} must be a size such as {BYTE_FORMS}; got {value!r}")
        if not unit and not bare:
            raise ValueError(
                f"{field}: {value!r} has no unit; write a size such as {BYTE_FORMS} "
                f"(a bare number would be bytes)"
            )
        n = float(m.group(1)) * _BYTE_UNITS[unit or "b"]
    if n != int(n) and not isinstance(value, str):
        raise ValueError(f"{field} must be a whole number of bytes, got {value!r}")
    if n < 0 or (n == 0 and not zero):
        raise ValueError(f"{field} must be {'>= 0' if zero else 'positive'}, got {value!r}")
    return int(n)


def parse_count(value: Any, field: str, *, zero: bool = False) -> int:
    """``value`` as a whole count: an int, or a string such as ``8192``, ``8k``, ``8K``, ``1.5e9``.

    Raises:
        ValueError: naming ``field`` and the accepted forms.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{field} must be a count such as {COUNT_FORMS}; got {value!r}")
    if isinstance(value, int):
        n: float = value
    elif isinstance(value, float):
        n = value
    else:
        m = _SIZE.fullmatch(str(value))
        if m is None or m.group(2) not in _COUNT_UNITS:
            raise ValueError(f"{field} must be a count such as {COUNT_FORMS}; got {value!r}")
        n = float(m.group(1)) * _COUNT_UNITS[m.group(2)]
    if n != int(n):
        raise ValueError(f"{field} must be a whole number, got {value!r}")
    if n < 0 or (n == 0 and not zero):
        raise ValueError(f"{field} must be {'>= 0' if zero else 'positive'}, got {value!r}")
    return int(n)


def format_bytes(n: float, digits: int = 3) -> str:
    """``n`` bytes in GiB, e.g. ``"18.400 GiB"`` (one unit in every message: figures compare at a glance)."""
    return f"{n / GiB:.{digits}f} GiB"
