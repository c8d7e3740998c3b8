"""Prompts for ``rlmem train`` from a user's files and tokenizer.

A data set is a local JSONL, JSON, CSV or Parquet file, or a directory of files of one of those kinds, read
with the ``datasets`` library's local loaders (no download). Each row has a prompt (``prompt_key``: a string,
or a list of chat messages ``{"role": ..., "content": ...}``) and an answer (``answer_key``) the reward
compares the completion with, as text whatever type the file gives it (a CSV column of numbers reaches
the reward as ``"72"``, not ``72``). Prompts are tokenized once, through the model's chat template when it has
one; prompts longer than ``max_prompt_len`` tokens are dropped and counted, never cut. Rows are shuffled by
``seed``, again each epoch, and read in order; the position is part of a checkpoint, so a resumed run sees
the rows an uninterrupted one would.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._extras import need
from .._lazy import moved_names

if TYPE_CHECKING:
    from ..models.tokenizer import TextTokenizer

__all__ = ["EXTENSIONS", "Example", "PromptData", "as_text"]
# the tokenizer's loading is rlmem.models' (serve loads one too); the old names here keep working one release
__getattr__ = moved_names(
    __name__, dict.fromkeys(("CHAT_TEMPLATES", "TextTokenizer", "load_tokenizer"), "rlmem.models.tokenizer")
)

# file suffix -> the datasets builder that reads it
EXTENSIONS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class Example:
    """One prompt: as written in the file (text or messages), its token ids, its answer and its row."""

    prompt: Any
    ids: list[int]
    answer: Any
    row: int


def _files(path: str) -> tuple[str, list[str]]:
    p = Path(path)
    if p.is_file():
        kind = EXTENSIONS.get(p.suffix.lower())
        if kind is None:
            raise ValueError(f"data: {str(p)!r} is not one of {', '.join(EXTENSIONS)}")
        return kind, [str(p)]
    if p.is_dir():
        found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in EXTENSIONS)
        kinds = {EXTENSIONS[f.suffix.lower()] for f in found}
        if not found:
            raise ValueError(f"data: directory {str(p)!r} holds no {', '.join(EXTENSIONS)} files")
        if len(kinds) > 1:
            raise ValueError(
                f"data: directory {str(p)!r} mixes file kinds ({', '.join(sorted(kinds))}); keep one"
            )
        return kinds.pop(), [str(f) for f in found]
    raise ValueError(f"data: {str(p)!r} does not exist")


def _read(path: str) -> tuple[list[str], Any]:
    """The columns and rows of the data set at ``path``, through ``datasets``' local loaders."""
    kind, files = _files(path)
    datasets = need("datasets", extra="train", what=f"reading {path!r}")
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=files, split="train")
    except Exception as e:  # the loaders' own errors name the file but run to many lines
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"data: could not read {path!r} as {kind}: {first}") from e
    return list(ds.column_names), ds


def as_text(answer: Any) -> str:
    """An answer as a reward function receives it: strings as they are, whole numbers without a decimal
    point (``72``, ``72.0`` -> ``"72"``), other numbers as Python prints them, anything else as JSON."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, bool):
        return str(answer)
    if isinstance(answer, int) or (isinstance(answer, float) and answer.is_integer()):
        return str(int(answer))
    if isinstance(answer, float):
        return repr(answer)
    return json.dumps(answer, ensure_ascii=False, default=str)


def _check_prompt(prompt: Any, row: int, key: str, where: str) -> None:
    if isinstance(prompt, str) and prompt:
        return
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        return
    raise ValueError(
        f"data: row {row} of {where}: {key!r} must be a non-empty string or a list of "
        f"{{'role', 'content'}} messages, got {prompt!r:.80}"
    )


class PromptData:
    """The prompts of a local data set, tokenized, shuffled per epoch, read in order.

    Args:
        path: a file or a directory (see the module docstring).
        tokenizer: how prompts become ids.
        prompt_key, answer_key: the columns; ``answer_key`` may be ``""`` for rewards that need no answer.
        max_prompt_len: prompts longer than this many tokens are dropped (counted in :attr:`dropped`).
        seed: the shuffle's seed (each epoch reshuffles with ``seed`` and the epoch number).
        rows: the rows themselves (a built-in task's), instead of reading ``path``, which names them.

    Raises:
        ValueError: a missing file or key, a malformed row, or no prompt short enough; one line naming it.
    """

    def __init__(
        self,
        path: str,
        tokenizer: TextTokenizer,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        max_prompt_len: int = 512,
        seed: int = 0,
        rows: list[dict[str, Any]] | None = None,
    ) -> None:
        columns, ds = (list(rows[0]) if rows else [], rows) if rows is not None else _read(path)
        where = repr(path)
        for key, what in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
            if key and key not in columns:
                raise ValueError(
                    f"data: {where} has no column {key!r} ({what}); its columns are {', '.join(columns)}"
                )
        self.path = path
        self.examples: list[Example] = []
        self.dropped = 0
        self.longest = 0
        for row, rec in enumerate(ds):
            prompt = rec[prompt_key]
            _check_prompt(prompt, row, prompt_key, where)
            answer = rec[answer_key] if answer_key else None
            if answer_key and answer is None:
                raise ValueError(f"data: row {row} of {where} has no {answer_key!r} (answer_key)")
            answer = None if answer is None else as_text(answer)
            ids = tokenizer.encode_prompt(prompt)
            if len(ids) > max_prompt_len:
                self.dropped += 1
                continue
            self.longest = max(self.longest, len(ids))
            self.examples.append(Example(prompt=prompt, ids=ids, answer=answer, row=row))
        if not self.examples:
            raise ValueError(
                f"data: every one of the {self.dropped} prompts of {where} is longer than max_prompt_len "
                f"({max_prompt_len} tokens)"
            )
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.examples)

    def take(self, n: int) -> list[Example]:
        """The next ``n`` prompts, into the next epoch when this one runs out."""
        out = []
        for _ in range(n):
            if self.index == len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._shuffled(self.epoch)
            out.append(self.examples[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Where reading stands (saved in a checkpoint)."""
        return {"epoch": self.epoch, "index": self.index, "size": len(self.examples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``.

        Raises:
            ValueError: it was saved for a data set of another size.
        """
        if state.get("size") != len(self.examples):
            raise ValueError(
                f"resume: the checkpoint read a data set of {state.get('size')} prompts; {self.path!r} has "
                f"{len(self.examples)} (other data, or another max_prompt_len)"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._shuffled(self.epoch)
