"""The one table of dtype names rlmem's configs and flags take (``bf16``, ``fp16``, ``fp32``), and the
conversions both ways. Importing it loads no torch: the CLI's help answers without it."""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPE_NAMES", "dtype_name", "torch_dtype"]

# name -> the torch attribute
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str) -> Any:
    """The torch dtype of ``name`` (a key of :data:`DTYPE_NAMES`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return getattr(torch, DTYPE_NAMES[name])


def dtype_name(dtype: Any) -> str:
    """The name of a torch dtype in :data:`DTYPE_NAMES` (``torch.bfloat16`` -> ``"bf16"``).

    Raises:
        ValueError: a dtype without a name there.
    """
    for k, v in DTYPE_NAMES.items():
        if str(dtype) == f"torch.{v}":
            return k
    raise ValueError(
        f"dtype must be one of {', '.join(DTYPE_NAMES)} ({', '.join(DTYPE_NAMES.values())}), got {dtype!r}"
    )
