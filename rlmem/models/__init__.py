"""Loading a model and its tokenizer, in one place for the recipe (``rlmem train``), ``rlmem serve``, the
planner and the benchmarks: :func:`load_model` (the embedded tiny model, a named preset, a directory saved
with ``save_pretrained``, a GGUF file), :func:`load_tokenizer` (a model's directory or GGUF file, as a
:class:`TextTokenizer`), the presets (``presets.py``: :data:`QWEN2`, :data:`LLAMA`, :func:`build`), GGUF files
(``gguf.py``), and the tiny model with its character tokenizer (``tiny.py``: :data:`TINY`, the one tiny
shape, and :class:`CharTokenizer`).

Imports nothing of rlmem but its base modules; its names load on first use, so the recipe's config (no
torch) takes the tokenizer's choices from here without loading torch.
"""

from __future__ import annotations

from .._lazy import lazy_names

_WHERE = {
    **dict.fromkeys(("empty_model", "load_model"), ".load"),
    **dict.fromkeys(("LLAMA", "PRESETS", "QWEN2", "build", "vocab_size"), ".presets"),
    **dict.fromkeys(("FAMILY_TINY", "TINY", "CharTokenizer", "tiny_model"), ".tiny"),
    **dict.fromkeys(("CHAT_TEMPLATES", "TextTokenizer", "load_tokenizer"), ".tokenizer"),
}
__all__ = sorted(_WHERE)
__getattr__ = lazy_names(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted(__all__)
