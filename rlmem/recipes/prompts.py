"""Where ``rlmem train``'s prompts come from and how their completions are scored: the embedded sort-digits
task, or a user's data set, tokenizer and reward, behind one small protocol (:class:`PromptSource`).

A source takes a step's prompts, scores completions, evaluates an engine on held-out prompts (where it has
them) and saves its reading position in checkpoints; the loop never asks which one it has.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..models.tiny import CharTokenizer
from ..models.tokenizer import TextTokenizer, load_tokenizer
from ..rollout.engine import generation_length
from . import arithmetic
from .config import GRPOConfig
from .rewards import load_reward, score
from .task import SortDigitsTask
from .user_data import Example, PromptData

__all__ = ["Batch", "DataPrompts", "PromptSource", "TaskPrompts", "make_prompts"]


@dataclass(frozen=True)
class Batch:
    """This rank's prompts of one step: each as the source knows it (``items``) and as token ids."""

    items: list[Any]
    ids: list[list[int]]


class PromptSource(Protocol):
    """What the loop needs of its prompts.

    ``max_len`` is the longest sequence a rollout makes (prompt and completion), ``max_new_tokens`` the
    completion limit (:func:`rlmem.rollout.engine.generation_length`'s, resolved here once), ``vocab``,
    ``pad_id`` and ``eos_id`` what the policy and sampler are built with, and ``tokenizer`` what a
    checkpoint saves beside the model (None for the embedded task).
    """

    max_len: int
    max_new_tokens: int
    vocab: int
    pad_id: int
    eos_id: int
    tokenizer: TextTokenizer | None

    def take(self, n: int, rng: random.Random, rank: int, world: int) -> Batch:
        """The step's ``n`` prompts over all ranks; returns this rank's share."""
        ...

    def score(self, batch: Batch, completions: list[list[int]], group: int) -> torch.Tensor:
        """The reward of each completion; ``completions`` are ``group`` per prompt, in the batch's order."""
        ...

    def evaluate(self, engine: Any, rank: int, world: int, group: Any = None) -> float | None:
        """The mean reward of greedy completions of the held-out prompts (None without them)."""
        ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...


class TaskPrompts:
    """The embedded task: sort the digits of the prompt, scored position by position (``task.py``)."""

    tokenizer = None

    def __init__(self, cfg: GRPOConfig) -> None:
        self.tok = CharTokenizer()
        self.task = SortDigitsTask(min_digits=cfg.min_digits, max_digits=cfg.max_digits)
        # the task knows its room: an answer and two more tokens
        self.max_new_tokens = generation_length(cfg.max_new_tokens, room=self.task.max_answer_tokens + 2)
        self.max_len = 2 + self.task.max_digits + self.max_new_tokens  # BOS, digits, '=', completion
        self.vocab, self.pad_id, self.eos_id = self.tok.vocab_size, self.tok.PAD, self.tok.EOS

    def take(self, n: int, rng: random.Random, rank: int, world: int) -> Batch:
        mine = self.task.prompts(n, rng)[_share(n, rank, world)]
        return Batch(mine, [self.tok.encode(p, bos=True) for p in mine])

    def score(self, batch: Batch, completions: list[list[int]], group: int) -> torch.Tensor:
        pairs = zip(_repeat(batch.items, group), completions, strict=True)
        return torch.tensor([self.task.reward(p, c, self.tok) for p, c in pairs])

    def evaluate(self, engine: Any, rank: int, world: int, group: Any = None) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None  # the prompts are drawn from the run's rng, which the checkpoint keeps

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        pass


class DataPrompts:
    """A user's prompts and answers (``data.py``), their tokenizer and a reward (``rewards.py``), and held-out
    prompts scored the same way.

    Raises:
        ValueError: the tokenizer, the data, or the reward (tried on the first row) is unusable.
    """

    def __init__(self, cfg: GRPOConfig, say: Any = print) -> None:
        assert cfg.data is not None
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, chat_template=cfg.chat_template)
        self.data = self._read(cfg, cfg.data, "train")
        self.spec = "math" if cfg.reward == "auto" else cfg.reward
        self.reward = load_reward(self.spec)
        first = self.data.examples[0]  # a reward that raises is caught here, before anything is written
        score(self.reward, self.spec, [first.prompt], [""], [first.answer], [first.row])
        self.held_out = None if cfg.eval_data is None else self._read(cfg, cfg.eval_data, "eval")
        self.max_new_tokens = generation_length(cfg.max_new_tokens)
        longest = max(self.data.longest, self.held_out.longest if self.held_out is not None else 0)
        self.max_len = longest + self.max_new_tokens
        tok = self.tokenizer
        self.vocab, self.pad_id, self.eos_id = tok.vocab_size, tok.pad_id, tok.eos_id
        say(
            f"data: {len(self.data)} prompts from {cfg.data} "
            f"({self.data.dropped} longer than max_prompt_len={cfg.max_prompt_len} dropped)"
        )

    def _read(self, cfg: GRPOConfig, path: str, split: str) -> PromptData:
        """Training and evaluation data are read the same way; ``arithmetic`` (unless a file of that name
        exists) is the built-in task's ``split``."""
        builtin = path == arithmetic.NAME and not Path(path).exists()
        return PromptData(
            path,
            self.tokenizer,
            prompt_key="prompt" if builtin else cfg.prompt_key,
            answer_key="answer" if builtin else cfg.answer_key,
            max_prompt_len=cfg.max_prompt_len,
            seed=cfg.seed,
            rows=arithmetic.rows(split) if builtin else None,
        )

    def take(self, n: int, rng: random.Random, rank: int, world: int) -> Batch:
        mine = self.data.take(n)[_share(n, rank, world)]
        return Batch(mine, [e.ids for e in mine])

    def score(self, batch: Batch, completions: list[list[int]], group: int) -> torch.Tensor:
        return torch.tensor(self._score(_repeat(batch.items, group), completions))

    def _score(self, examples: Sequence[Example], completions: list[list[int]]) -> list[float]:
        return score(
            self.reward,
            self.spec,
            [e.prompt for e in examples],
            [self.tokenizer.decode(c) for c in completions],
            [e.answer for e in examples],
            [e.row for e in examples],
        )

    def evaluate(self, engine: Any, rank: int, world: int, group: Any = None) -> float | None:
        """Each rank scores its share; summed over ``group`` (a Gloo group, where the NCCL ones are
        suspended during rollout) or the default group."""
        if self.held_out is None:
            return None
        mine = self.held_out.examples[rank::world]
        comps = engine.generate([e.ids for e in mine], max_new_tokens=self.max_new_tokens, temperature=0.0)
        got = self._score(mine, comps)
        total = torch.tensor([sum(got), len(got)], dtype=torch.float64)
        if world > 1 and group is not None:
            dist.all_reduce(total, group=group)
        elif world > 1:
            dev = next(engine.model.parameters()).device
            total = total.to(dev)
            dist.all_reduce(total)
            total = total.cpu()
        return total[0].item() / max(total[1].item(), 1.0)

    def state_dict(self) -> dict[str, Any] | None:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.data.load_state_dict(state)


def make_prompts(cfg: GRPOConfig, say: Any = print) -> PromptSource:
    """The embedded task without ``data``, else the user's data."""
    return TaskPrompts(cfg) if cfg.data is None else DataPrompts(cfg, say)


def _share(n: int, rank: int, world: int) -> slice:
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def _repeat(items: list[Any], group: int) -> list[Any]:
    return [x for x in items for _ in range(group)]
