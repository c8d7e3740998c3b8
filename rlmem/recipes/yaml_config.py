"""Recipe configs: a keyword-only dataclass filled from a YAML file plus ``key=value`` overrides."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is a dependency of the train extra
        raise RuntimeError("config files need PyYAML: pip install 'rlmem[train]'") from e
    return yaml


# YAML 1.2 floats. PyYAML implements YAML 1.1, whose float pattern needs a dot, so `lr: 1e-5` arrives as the
# string "1e-5". A loader with this resolver reads it as a number; OmegaConf (verl's, torchtune's choice)
# would too, but brings interpolation semantics and a dependency that a flat recipe config does not need.
_FLOAT = re.compile(
    r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
)


@functools.cache
def _loader() -> Any:
    """The YAML loader with the 1.2 float resolver, built once (every override is parsed with it)."""
    yaml = _yaml()

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Loader


def _parse(text: str) -> Any:
    return _yaml().load(text, Loader=_loader())


def load(cls: type[T], path: str | os.PathLike[str] | None, overrides: list[str]) -> T:
    """An instance of the dataclass ``cls`` from the YAML file at ``path`` (optional) and ``key=value``s.

    Values are parsed as YAML scalars (``lr=3e-4``, ``offload=false``, ``out_dir=runs/x``).

    Raises:
        ValueError: an unknown key (the message lists the valid ones), an override without ``=``, a file
            that is not a mapping, or a value the dataclass rejects.
    """
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        data = _parse(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping of keys to values")
        values.update(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value")
        values[key.strip()] = _scalar(raw)
    unknown = sorted(k for k in values if k not in names)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(names)}"
        )
    return cls(**values)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping a YAML config file holds, as written (no dataclass: a run's saved ``config.yaml`` is read
    back whatever keys it has).

    Raises:
        ValueError: the file is not YAML, or not a mapping.
        OSError: it cannot be read.
    """
    try:
        data = _parse(Path(path).read_text()) or {}
    except _yaml().YAMLError as e:
        raise ValueError(f"{str(path)!r} is not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a mapping of keys to values")
    return data


def _scalar(raw: str) -> Any:
    """A command-line value as the config file's YAML would read it (``3e-4`` is a number)."""
    if not raw.strip():
        return ""
    return _parse(raw)


def dump(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write the dataclass ``obj`` as YAML (what a run used, re-loadable with :func:`load`)."""
    Path(path).write_text(_yaml().safe_dump(dataclasses.asdict(obj), sort_keys=False))
