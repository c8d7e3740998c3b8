"""The configuration of ``rlmem train``: :class:`GRPOConfig` (every key, validated on construction) and the
command line that fills it. Imports no torch, so ``rlmem train --help`` answers at once."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from .._lazy import moved_names
from .._section import Section
from .._units import parse_bytes
from ..models.tokenizer import CHAT_TEMPLATES
from ..rollout.engine import Sampling
from ..rollout.sampler.config import CUDA_GRAPHS
from .task import SortDigitsTask

__all__ = [
    "PRECISIONS",
    "ROLLOUT_DTYPES",
    "SECTIONS",
    "DataKeys",
    "GRPOConfig",
    "OffloadKeys",
    "RolloutKeys",
    "RunKeys",
    "Sampling",
    "UpdateKeys",
    "is_fraction",
    "keys_help",
    "train_parser",
]
# the embedded model's shape is rlmem.models' (serve builds it too); its old name keeps working one release
__getattr__ = moved_names(__name__, {"TINY": "rlmem.models.tiny"})

PRECISIONS = ("auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16")
# rollout_dtype's values: none, or a name of the one dtype table (this module imports no torch); "auto" is
# resolved by the runtime
ROLLOUT_DTYPES = (None, "none", "bf16", "fp16")


ENGINES = ("local", "server")
COMMS = ("keep", "suspend")  # OffloadConfig.comms's values


def _need(config: Any, name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {what}, got {getattr(config, name)!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(kw_only=True)
class RunKeys(Section):
    """The run itself: what it trains, where, how long, and what it writes (the loop's keys).

    Args:
        model: ``"tiny"`` (embedded), a preset of :mod:`rlmem.models.presets` (random init), a directory
            saved with ``save_pretrained``, or a GGUF file (:func:`rlmem.models.load_model`).
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
        seed: seeds the model init, the prompts and the sampler.
        steps: rollout + train iterations.
        prompts_per_step: prompts per step over all ranks; ``group_size`` completions each.
        group_size: completions per prompt (>= 2: advantages compare the samples of a group).
        precision: ``"fp32"``, ``"bf16-mixed"`` (fp32 weights, bf16 autocast), ``"fp16-mixed"`` (fp32
            weights, fp16 autocast, dynamic loss scaling: skipped steps are logged), ``"bf16"`` (bf16
            weights) or ``"auto"`` (bf16-mixed on CUDA, fp32 on CPU).
        save_every: write ``out_dir/checkpoint-STEP/`` every this many steps and at the end; None: at the
            end only; 0: never.
        resume: ``"auto"`` (the latest checkpoint in ``out_dir``, if any) or a checkpoint directory.
        logger: ``"tensorboard"``, ``"wandb"`` or both comma-separated, besides ``log.jsonl``; None: none.
        out_dir: where the log, timeline, table and plot go.
        progress: draw a progress bar on a terminal.
        plot: write ``memory.png`` at the end (needs matplotlib).
    """

    model: str = "tiny"
    device: str = "auto"
    seed: int = 0
    steps: int = 200
    prompts_per_step: int = 32
    group_size: int = 8
    precision: str = "auto"
    save_every: int | None = None
    resume: str | None = None
    logger: str | None = None
    out_dir: str = "runs/grpo"
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        need = functools.partial(_need, self)
        need("model", isinstance(self.model, str) and bool(self.model), "'tiny', a preset or a directory")
        need("device", self.device in ("auto", "cpu", "cuda"), "'auto', 'cpu' or 'cuda'")
        need("seed", _is_int(self.seed) and self.seed >= 0, "an int >= 0")
        for f in ("steps", "prompts_per_step", "group_size"):
            need(f, _is_int(getattr(self, f)) and getattr(self, f) >= 1, "an int >= 1")
        need("group_size", self.group_size >= 2, "an int >= 2 (advantages compare samples of a group)")
        need("precision", self.precision in PRECISIONS, f"one of {', '.join(PRECISIONS)}")
        se = self.save_every
        need("save_every", se is None or (_is_int(se) and se >= 0), "None, 0 (never) or an int >= 1")
        need("resume", self.resume is None or (isinstance(self.resume, str) and bool(self.resume)), "a path")
        need("logger", self.logger is None or isinstance(self.logger, str), "tensorboard, wandb, or both")
        if self.logger:
            from .loggers import parse_loggers

            parse_loggers(self.logger)
        need("out_dir", isinstance(self.out_dir, str) and bool(self.out_dir), "a path")
        for f in ("progress", "plot"):
            need(f, isinstance(getattr(self, f), bool), "true or false")


@dataclass(kw_only=True)
class DataKeys(Section):
    """The prompts and how they are scored: the keys :func:`rlmem.recipes.prompts.make_prompts` takes.

    Args:
        data: a local JSONL, JSON, CSV or Parquet file (or a directory of them) of prompts and answers; None:
            the embedded sort-digits task.
        prompt_key, answer_key: the data's columns (a prompt is a string or a list of chat messages).
        reward: ``"auto"`` (``sort_digits`` for the toy task, ``math`` with ``data``), ``exact``, ``math``, or
            ``module:function`` / ``path.py:function`` of (prompt, completion, answer).
        tokenizer: a directory holding the tokenizer; None: the model's directory (with ``data``).
        chat_template: ``"auto"`` (the tokenizer's chat template when it has one) or ``"none"``.
        max_prompt_len: prompts longer than this (in tokens) are dropped and counted.
        eval_data: a data set like ``data`` (``arithmetic``: the built-in task's held-out split) scored with
            greedy decoding and the same reward (``eval/reward``): before the first update
            (``eval_before_train``), after every ``eval_every`` updates, and after the last one; each eval
            is a line of the step log and of ``log.jsonl`` (``eval_step``: the updates made before it).
        eval_every: 0: only the one before training.
        eval_before_train: evaluate the model as given before the first update (with ``eval_data``), so every
            curve starts at the model's own baseline.
        min_digits, max_digits: the toy task's prompt lengths.
    """

    data: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward: str = "auto"
    tokenizer: str | None = None
    chat_template: str = "auto"
    max_prompt_len: int = 512
    eval_data: str | None = None
    eval_every: int = 0
    eval_before_train: bool = True
    min_digits: int = 2
    max_digits: int = 5

    def __post_init__(self) -> None:
        need = functools.partial(_need, self)
        for f in ("data", "tokenizer", "eval_data"):
            v = getattr(self, f)
            need(f, v is None or (isinstance(v, str) and bool(v)), "a path")
        for f in ("prompt_key", "reward"):
            need(f, isinstance(getattr(self, f), str) and bool(getattr(self, f)), "a non-empty string")
        need("answer_key", isinstance(self.answer_key, str), "a string ('' for rewards that need no answer)")
        need("chat_template", self.chat_template in CHAT_TEMPLATES, "'auto' or 'none'")
        need("max_prompt_len", _is_int(self.max_prompt_len) and self.max_prompt_len >= 1, "an int >= 1")
        need("eval_before_train", isinstance(self.eval_before_train, bool), "true or false")
        need("eval_every", _is_int(self.eval_every) and self.eval_every >= 0, "an int >= 0 (0: never)")
        need(
            "eval_data",
            self.eval_data is None or self.data is not None,
            "unset without data= (the toy has none)",
        )
        need("eval_every", not self.eval_every or self.eval_data is not None, "0 without eval_data=")
        need(
            "reward",
            self.data is not None or self.reward in ("auto", "sort_digits"),
            "'auto' or 'sort_digits' without data= (the toy task scores itself)",
        )
        SortDigitsTask(min_digits=self.min_digits, max_digits=self.max_digits)  # validates both


@dataclass(kw_only=True)
class UpdateKeys(Section):
    """The train phase: the optimizer, the GRPO loss and how a batch is cut (the update's keys).

    Args:
        lr, weight_decay, max_grad_norm: AdamW and gradient clipping.
        clip_eps: PPO ratio clip.
        kl_coef: weight of the KL penalty to the initial policy; 0 builds no reference model.
        updates_per_step: optimizer steps per rollout batch (the batch is split into that many mini-batches).
        micro_batch_size: sequences per forward/backward.
        dynamic_batching: train micro-batches by token budget instead of ``micro_batch_size``
            (:func:`rlmem.token_budget_batches`, padded to each micro-batch's longest sequence, the same
            number of micro-batches on every rank).
        max_tokens_per_micro_batch: the budget with ``dynamic_batching`` (sequences x longest length).
        gradient_checkpointing: Hugging Face's activation checkpointing in the train phase.
        share_prompts: a group's prompt is held once: the sampler prefills it once per group and keeps its
            keys and values once, and the scoring and the update forward it once per group with the
            group's completions against it (equal to the unshared path within fp32 rounding); false: every
            sample carries its own copy, as before.
    """

    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    updates_per_step: int = 2
    micro_batch_size: int = 64
    dynamic_batching: bool = False
    max_tokens_per_micro_batch: int | None = None
    gradient_checkpointing: bool = False
    share_prompts: bool = True

    def __post_init__(self) -> None:
        need = functools.partial(_need, self)
        need("lr", _is_num(self.lr) and self.lr > 0, "a number > 0")
        for f in ("weight_decay", "kl_coef"):
            need(f, _is_num(getattr(self, f)) and getattr(self, f) >= 0, "a number >= 0")
        need("max_grad_norm", _is_num(self.max_grad_norm) and self.max_grad_norm > 0, "a number > 0")
        need("clip_eps", _is_num(self.clip_eps) and 0 < self.clip_eps < 1, "in (0, 1)")
        for f in ("updates_per_step", "micro_batch_size"):
            need(f, _is_int(getattr(self, f)) and getattr(self, f) >= 1, "an int >= 1")
        mt = self.max_tokens_per_micro_batch
        need("max_tokens_per_micro_batch", mt is None or (_is_int(mt) and mt >= 1), "None or an int >= 1")
        need(
            "max_tokens_per_micro_batch",
            not self.dynamic_batching or mt is not None,
            "set (an int >= 1) when dynamic_batching is true",
        )
        for f in ("dynamic_batching", "gradient_checkpointing", "share_prompts"):
            need(f, isinstance(getattr(self, f), bool), "true or false")


@dataclass(kw_only=True)
class RolloutKeys(Section):
    """Where and with what the rollout samples (the engine's keys).

    Args:
        engine: ``"local"`` (the sampler in this process) or ``"server"``: ``rlmem serve`` in a process of its
            own on the same GPU samples from this process's rollout copy of the policy (shared, not copied:
            ``rollout_dtype``, else the training dtype), handing the device over through a broker at each
            phase switch; its memory shows in the timeline and the table as ``server_*``. Under torchrun every
            rank has its own server on its GPU, sampling that rank's share of the prompts.
        engine_url: with ``engine=server``, a server already running (``rlmem serve --weights shared
            --broker PATH``, e.g. ``unix:///PATH`` or ``http://127.0.0.1:PORT``) instead of starting one;
            it must have joined a broker this process can reach (its ``/health`` says where). Under torchrun
            ``{local_rank}`` in it is each rank's local rank (``unix:///run/rlmem/serve-{local_rank}.sock``).
        kv_budget: KV cache size: bytes (``"16GiB"``), a fraction of the device's total memory (0 < x <= 1),
            or None for exactly one rollout batch. Never larger than the rollout needs.
        cuda_graphs: ``"auto"`` (on for CUDA), ``"on"`` or ``"off"``: the rollout's decode steps as CUDA
            graph replays (captured once per batch-size bucket, kept across phase switches); the sampler's
            own setting (:class:`rlmem.rollout.SamplerConfig`).
        rollout_dtype: ``"auto"`` (default: on a GPU under ``bf16-mixed`` or ``fp16-mixed``, the autocast
            dtype; otherwise none), ``"none"`` / ``None`` (the rollout runs the training weights) or
            ``"bf16"`` / ``"fp16"``: sample from a copy of the policy in that dtype, refreshed at the start
            of every rollout. With fp32 weights each decode step then reads half the bytes and casts
            nothing, the fp32 weights leave the device during rollout, and the CUDA graphs hold no casts of
            them (on the 2.7B example, 4.5 GiB of graph pool through the train phase under autocast against
            0.2 GiB); the matrix products see the same bf16 weights either way.
    """

    engine: str = "local"
    engine_url: str | None = None
    kv_budget: int | float | str | None = None
    cuda_graphs: str = "auto"
    rollout_dtype: str | None = "auto"

    def __post_init__(self) -> None:
        need = functools.partial(_need, self)
        need("engine", self.engine in ENGINES, "'local' or 'server'")
        eu = self.engine_url
        need(
            "engine_url",
            eu is None or (isinstance(eu, str) and eu.startswith(("http://", "https://", "unix:///"))),
            "None or a URL (http://HOST:PORT or unix:///PATH)",
        )
        need("engine_url", eu is None or self.engine == "server", "unset unless engine=server")
        if isinstance(eu, str):
            try:
                eu.format(local_rank=0)
            except (KeyError, IndexError, ValueError):
                need("engine_url", False, "a URL whose only placeholder is {local_rank}")
        need("cuda_graphs", self.cuda_graphs in CUDA_GRAPHS, "'auto', 'on' or 'off'")
        rd = self.rollout_dtype
        known = rd is None or (isinstance(rd, str) and (rd == "auto" or rd in ROLLOUT_DTYPES))
        need("rollout_dtype", known, "'auto', 'none' (or null), 'bf16' or 'fp16'")
        if self.kv_budget is not None:
            v = self.kv_budget
            if isinstance(v, float) or (isinstance(v, str) and is_fraction(v)):
                need("kv_budget", 0 < float(v) <= 1, "bytes like '16GiB' or a fraction in (0, 1]")
            else:
                parse_bytes(v, "kv_budget")


@dataclass(kw_only=True)
class OffloadKeys(Section):
    """How memory switches between the phases (the keys the recipe's one :class:`rlmem.PhaseManager` is
    built from, in :meth:`rlmem.recipes.policy.Policy.manage_memory`).

    Args:
        offload: switch memory between phases with rlmem; None: on for CUDA, off on CPU
            (:meth:`enabled`).
        comms: ``"keep"`` or ``"suspend"``: under torchrun on GPUs with offload on, the NCCL communicators
            give their GPU memory back during rollout (:func:`rlmem.comm.suspend`); FSDP's weights are
            gathered for the rollout before they go, and the rollout's own reductions use a Gloo group.
        overlap_offload: with offload on, the optimizer states' copies to host memory go on while the
            rollout's prefill runs, as far as the memory the previous rollout took allows
            (:class:`rlmem.OffloadConfig` ``overlap_offload``); off: the rollout starts once they are done.
    """

    offload: bool | None = None
    comms: str = "keep"
    overlap_offload: bool = False

    def __post_init__(self) -> None:
        need = functools.partial(_need, self)
        need("offload", self.offload in (None, True, False), "true, false or null (auto)")
        need("comms", self.comms in COMMS, "'keep' or 'suspend'")
        need("overlap_offload", isinstance(self.overlap_offload, bool), "true or false")

    def enabled(self, on_cuda: bool) -> bool:
        """Whether rlmem switches memory between phases: ``offload``, or on for CUDA where it is None."""
        return self.offload if self.offload is not None else on_cuda


SECTIONS = (RunKeys, DataKeys, Sampling, UpdateKeys, RolloutKeys, OffloadKeys)


@dataclass(kw_only=True)
class GRPOConfig(OffloadKeys, RolloutKeys, UpdateKeys, Sampling, DataKeys, RunKeys):
    """Everything a run takes; the YAML keys and ``key=value`` overrides of ``rlmem train``: the sections
    of the components that use them, flat (:data:`SECTIONS`: the run, the data, the sampling, the update,
    the rollout engine, the offload; each key is defined, defaulted and validated once, in its section,
    and each component takes its section whole with ``Section.of(config)``).

    Raises:
        ValueError: a key is out of range; the message names it.
    """

    def __post_init__(self) -> None:
        for section in SECTIONS:
            section.__post_init__(self)


def is_fraction(s: str) -> bool:
    """Whether ``s`` is written as a float (``"0.5"``, ``"1e-1"``): ``kv_budget`` reads it as a fraction."""
    try:
        float(s)
    except ValueError:
        return False
    return "." in s or "e" in s.lower()


def keys_help() -> str:
    """Every key of :class:`GRPOConfig` with its type and default, one per line, by section."""
    lines = ["config keys (YAML or key=value; GRPOConfig's fields), by section:"]
    for section in SECTIONS:
        lines.append(f"  {section.__name__}: {(section.__doc__ or '').splitlines()[0]}")
        for f in dataclasses.fields(section):
            default = f.default if f.default is not dataclasses.MISSING else None
            lines.append(f"    {f.name:<26} {f.type!s:<26} default {default!r}")
    return "\n".join(lines)


def train_parser() -> argparse.ArgumentParser:
    """The ``rlmem train`` command line (its help lists every config key)."""
    p = argparse.ArgumentParser(
        prog="rlmem train",
        description=_DESCRIPTION,
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="a YAML file (examples/*.yaml); keys as in GRPOConfig")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override a config key")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="same as device=...")
    p.add_argument("--model", help="same as model=... ('tiny', a preset, or a save_pretrained directory)")
    p.add_argument("--no-offload", action="store_true", help="same as offload=false")
    p.add_argument("--seed", type=int, help="same as seed=...")
    p.add_argument("--out-dir", help="same as out_dir=...")
    return p


_DESCRIPTION = (
    "Co-located GRPO: rollout and training on the same GPUs, memory switched between them by rlmem. "
    "Without data= it trains the embedded tiny model on the sort-digits task."
)
