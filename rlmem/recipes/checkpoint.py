"""Checkpoints of ``rlmem train``: ``out_dir/checkpoint-STEP/`` holds the policy (``save_pretrained``, so
``AutoModelForCausalLM.from_pretrained`` loads it), the tokenizer when the run has one, and
``trainer_state.pt`` (optimizer state, the step, RNG states, the data position, the config). ``resume``
restores all of it so that the resumed run's losses equal an uninterrupted run's.

Under FSDP2 the state is gathered to full tensors on CPU (``torch.distributed.checkpoint.state_dict`` with
``full_state_dict``) and rank 0 writes one Hugging Face checkpoint: a user loads it with transformers alone,
and the policies this recipe trains fit one host. Sharded ``torch.distributed.checkpoint`` files would save
faster at scale but need torch.distributed to read back. A checkpoint is written to a temporary directory
and renamed when complete, so an interrupted save never leaves one half written.

A run must never end without its state on disk: :func:`preflight`, before the first step, proves that a
checkpoint of this model, tokenizer and trainer state can be written there (and that the disk has room for
one), and refuses the run in one line if not; if a save fails later anyway (a full disk, a serialiser that
refuses), :func:`save` writes the weights and the trainer state with ``torch.save`` alone to
``out_dir/fallback-STEP/`` and raises :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CheckpointError", "latest", "load", "preflight", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written. ``fallback``: where the weights and trainer state went instead
    (``torch.save`` files), or None if nothing could be written."""

    def __init__(self, message: str, fallback: Path | None) -> None:
        super().__init__(message)
        self.fallback = fallback


_NAME = re.compile(r"^checkpoint-(\d+)$")
# What makes two models the same for a resume: the weights' shapes follow from these.
_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")


def latest(out_dir: str | Path) -> Path | None:
    """The checkpoint of the highest step under ``out_dir``, or None."""
    d = Path(out_dir)
    if not d.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in d.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def _full_state(model: nn.Module, opt: torch.optim.Optimizer, world: int) -> tuple[dict, dict]:
    if world == 1:
        return model.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=o), get_optimizer_state_dict(model, opt, options=o)


def rng_state(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {"python": rng.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(rng: random.Random, state: dict[str, Any]) -> None:
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    out_dir: str | Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    rng: random.Random,
    data: dict[str, int] | None,
    config: dict[str, Any],
    world: int,
    rank: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``out_dir/checkpoint-{step}`` (every rank calls it; rank 0 writes). Returns its path.

    Raises:
        CheckpointError: on every rank, if rank 0 could not write it; the weights and trainer state are then
            in ``out_dir/fallback-{step}/`` (``model_state.pt``, ``trainer_state.pt``) where the disk allowed.
    """
    final = Path(out_dir) / f"checkpoint-{step}"
    model_sd, opt_sd = _full_state(model, optimizer, world)
    failed: CheckpointError | None = None
    if rank == 0:
        trainer = {
            "step": step,
            "optimizer": opt_sd,
            "rng": rng_state(rng),
            "data": data,
            "config": config,
            **(extra or {}),
        }
        tmp = final.with_name(final.name + ".tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            model.save_pretrained(str(tmp), state_dict=model_sd)
            if tokenizer is not None and hasattr(tokenizer, "save"):
                tokenizer.save(tmp)
            torch.save(trainer, tmp / "trainer_state.pt")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            failed = _fall_back(Path(out_dir), step, model_sd, trainer, e)
    if world > 1:
        flag = torch.tensor([float(failed is not None)], device=_device_of(model))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if failed is None and flag.item():
            failed = CheckpointError(
                f"checkpoint-{step} could not be written on rank 0 (see its output)", None
            )
    if failed is not None:
        raise failed
    return final


def _fall_back(
    out: Path, step: int, model_sd: dict[str, Any], trainer: dict[str, Any], error: BaseException
) -> CheckpointError:
    """Write what can be written without the model's serialiser; the error to raise, naming it."""
    why = _first_line(error)
    where = out / f"fallback-{step}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in model_sd.items()}, where / "model_state.pt")
        torch.save(trainer, where / "trainer_state.pt")
    except Exception as e2:
        return CheckpointError(
            f"checkpoint-{step} could not be written ({why}), and neither could the fallback in {where} "
            f"({_first_line(e2)})",
            None,
        )
    return CheckpointError(
        f"checkpoint-{step} could not be written ({why}); the weights and trainer state are in {where} "
        "(torch.load them: model_state.pt is the model's state_dict, trainer_state.pt the optimizer's and "
        "the run's)",
        where,
    )


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def checkpoint_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, world: int) -> int:
    """About what a checkpoint takes on disk: the weights as the model holds them, and the optimizer's
    states (all ranks' shards)."""

    def local(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    weights = sum(local(p) for p in model.parameters()) * world
    states = sum(local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    return weights + states * world


def preflight(
    out_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    rng: random.Random,
    data: dict[str, int] | None,
    config: dict[str, Any],
    world: int,
    rank: int,
) -> None:
    """Prove, before the first step, that a checkpoint can be written to ``out_dir``: a dry save (the model's
    format with one tiny tensor, the tokenizer, the trainer state's parts) to a temporary directory beside it,
    removed after, and room on the disk for a whole checkpoint. Writes nothing in ``out_dir`` itself.

    Raises:
        ValueError: one line naming what cannot be saved (every rank raises when rank 0 found it).
    """
    problem = None
    if rank == 0:
        problem = _dry_save(Path(out_dir), model, optimizer, tokenizer, rng, data, config, world)
    if world > 1:
        flag = torch.tensor([float(problem is not None)], device=_device_of(model))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if problem is None and flag.item():
            problem = "rank 0 found a checkpoint cannot be written (see its output)"
    if problem is not None:
        raise ValueError(f"checkpoint: {problem}; nothing was trained. Fix it, or run with save_every=0")


def _dry_save(
    out: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokenizer: Any,
    rng: random.Random,
    data: dict[str, int] | None,
    config: dict[str, Any],
    world: int,
) -> str | None:
    """What stops a checkpoint from being written to ``out``, or None."""
    base = out
    while not base.exists():  # the nearest existing directory: out_dir is made only once the run starts
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK):
        return f"{str(base)!r} is not a writable directory (out_dir={str(out)!r})"
    free = shutil.disk_usage(base).free
    need = checkpoint_bytes(model, optimizer, world)
    if free < need:
        return (
            f"{free / 2**30:.2f} GiB free on the disk of {str(base)!r}, a checkpoint takes about "
            f"{need / 2**30:.2f} GiB"
        )
    steps = (
        ("the model's save_pretrained", lambda d: model.save_pretrained(str(d), state_dict=_one_tensor())),
        ("the tokenizer's save", lambda d: tokenizer.save(d) if tokenizer is not None else None),
        (
            "the trainer state (torch.save)",
            lambda d: torch.save(
                {
                    "rng": rng_state(rng),
                    "data": data,
                    "config": config,
                    "groups": optimizer.state_dict()["param_groups"],
                },
                d / "trainer_state.pt",
            ),
        ),
    )
    try:
        with tempfile.TemporaryDirectory(prefix=".rlmem-preflight-", dir=base) as d:
            for what, step in steps:
                try:
                    step(Path(d))
                except Exception as e:
                    first = _first_line(e)
                    return f"{what} fails: {first}"
    except OSError as e:
        return f"cannot write in {str(base)!r}: {e}"
    return None


def _one_tensor() -> dict[str, torch.Tensor]:
    return {"rlmem.preflight": torch.zeros(1)}


def _check_same_model(path: Path, model: nn.Module) -> None:
    import json

    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not (path / "trainer_state.pt").is_file():
        raise ValueError(
            f"resume: {str(path)!r} is not a checkpoint of rlmem train (no config.json / trainer_state.pt)"
        )
    saved = json.loads(cfg_file.read_text())
    mine = model.config.to_dict()
    diff = [k for k in _SHAPE_KEYS if saved.get(k) != mine.get(k)]
    if diff:
        what = ", ".join(f"{k} {saved.get(k)!r} vs {mine.get(k)!r}" for k in diff)
        raise ValueError(f"resume: {str(path)!r} is a checkpoint of another model ({what})")


def load(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    world: int,
    accept: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load the weights and optimizer state of checkpoint ``path`` into ``model`` and ``optimizer``;
    returns the rest of its trainer state (step, RNG states, data position, config).

    Args:
        accept: called with the trainer state before anything is loaded; it raises to refuse the checkpoint
            (``rlmem train`` checks that it is one of the same run).

    Raises:
        ValueError: ``path`` is not a checkpoint, one of another model, or refused by ``accept``; nothing is
            loaded then.
    """
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"resume: {str(p)!r} does not exist")
    _check_same_model(p, model)
    state = torch.load(p / "trainer_state.pt", map_location="cpu", weights_only=False)
    if accept is not None:
        accept(state)
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(p.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    if not weights:
        raise ValueError(f"resume: {str(p)!r} holds no model weights (*.safetensors)")
    if world == 1:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"resume: {str(p)!r} does not match the model (missing {sorted(set(missing) - tied)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]})"
            )
        optimizer.load_state_dict(state["optimizer"])
    else:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        o = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=o)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=o)
    return state
