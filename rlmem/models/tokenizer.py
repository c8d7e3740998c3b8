"""A Hugging Face tokenizer as rlmem uses one (:class:`TextTokenizer`: prompts in, through the chat template
when it has one; completions out; the pad and EOS ids rollout needs) and :func:`load_tokenizer`, which finds
it in a model's directory or GGUF file. Imports no torch (and transformers only when loading), so
``rlmem train --help`` answers at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._tokenize import chat_ids

__all__ = ["CHAT_TEMPLATES", "TextTokenizer", "load_tokenizer"]

CHAT_TEMPLATES = ("auto", "none")


class TextTokenizer:
    """A Hugging Face tokenizer as rlmem uses it: prompts in (chat template applied when asked and
    present), ids of the completion out, and the pad and EOS ids rollout needs.

    Args:
        tok: a ``transformers`` tokenizer.
        chat_template: ``"auto"`` (use the tokenizer's template when it has one) or ``"none"``.
        name: where it came from, for messages.
    """

    def __init__(self, tok: Any, *, chat_template: str = "auto", name: str = "tokenizer") -> None:
        if chat_template not in CHAT_TEMPLATES:
            raise ValueError(
                f"chat_template must be one of {', '.join(CHAT_TEMPLATES)}; got {chat_template!r}"
            )
        self.tok = tok
        self.name = name
        self.use_template = chat_template == "auto" and bool(getattr(tok, "chat_template", None))
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError(f"{name} has no EOS token: rollout cannot tell where a completion ends")
        self.eos_id = int(eos)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tok)

    def encode_prompt(self, prompt: Any) -> list[int]:
        """Token ids of a prompt: a string, or a list of chat messages (which needs a chat template)."""
        if isinstance(prompt, list):
            if not self.use_template:
                raise ValueError(
                    f"a prompt is a list of chat messages but {self.name} "
                    + (
                        "has no chat template"
                        if not getattr(self.tok, "chat_template", None)
                        else "is used with chat_template=none"
                    )
                )
            return list(self._template(prompt))
        if self.use_template:
            return list(self._template([{"role": "user", "content": prompt}]))
        return list(self.tok(prompt, add_special_tokens=True)["input_ids"])

    def _template(self, messages: list[dict[str, Any]]) -> list[int]:
        return chat_ids(self.tok, [messages])[0]

    def decode(self, ids: list[int]) -> str:
        """Text of a completion, up to its EOS, special tokens left out."""
        cut = list(ids)
        if self.eos_id in cut:
            cut = cut[: cut.index(self.eos_id)]
        return self.tok.decode(cut, skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        self.tok.save_pretrained(str(path))


def load_tokenizer(path: str, *, chat_template: str = "auto") -> TextTokenizer:
    """The tokenizer saved in directory ``path`` (``AutoTokenizer``), or the one in the GGUF file ``path``
    names (see ``gguf.find``), left padding for rollout.

    Raises:
        ValueError: ``path`` is not a directory or holds no tokenizer (one line, naming the path).
    """
    from . import gguf

    found = gguf.find(path)
    if found is not None:
        tok = gguf.load_tokenizer(found)
        tok.padding_side = "left"
        return TextTokenizer(tok, chat_template=chat_template, name=f"the tokenizer in {str(found)!r}")
    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"tokenizer: {str(p)!r} is not a directory (give the model's directory, or tokenizer=DIR)"
        )
    files = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"}
    if not any((p / f).is_file() for f in files):
        raise ValueError(
            f"tokenizer: {str(p)!r} has no tokenizer files ({', '.join(sorted(files))}); save one there with "
            "tokenizer.save_pretrained() or pass tokenizer=DIR"
        )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(p))
    tok.padding_side = "left"
    return TextTokenizer(tok, chat_template=chat_template, name=f"the tokenizer in {str(p)!r}")
