"""Recipe configs: a keyword-only dataclass filled from a YAML file plus ``key=value`` overrides."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is a dependency of the train extra
        raise RuntimeError("config files need PyYAML: pip install 'rlmem[train]'") from e
    return yaml


def load(cls: type[T], path: str | os.PathLike[str] | None, overrides: list[str]) -> T:
    """An instance of the dataclass ``cls`` from the YAML file at ``path`` (optional) and ``key=value``s.

    Values are parsed as YAML scalars (``lr=3e-4``, ``offload=false``, ``out_dir=runs/x``).

    Raises:
        ValueError: an unknown key (the message lists the valid ones), an override without ``=``, a file
            that is not a mapping, or a value the dataclass rejects.
    """
    yaml = _yaml()
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping of keys to values")
        values.update(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value")
        values[key.strip()] = _scalar(yaml, raw)
    unknown = sorted(k for k in values if k not in names)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(names)}"
        )
    return cls(**values)


def _scalar(yaml: Any, raw: str) -> Any:
    """A command-line value as YAML would read it, plus numbers YAML 1.1 leaves as text (``3e-4``)."""
    if not raw.strip():
        return ""
    v = yaml.safe_load(raw)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    return v


def dump(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write the dataclass ``obj`` as YAML (what a run used, re-loadable with :func:`load`)."""
    Path(path).write_text(_yaml().safe_dump(dataclasses.asdict(obj), sort_keys=False))
