"""Checkpoints of ``rlmem train``: ``out_dir/checkpoint-STEP/`` holds the policy (``save_pretrained``, so
``AutoModelForCausalLM.from_pretrained`` loads it), the tokenizer when the run has one, and
``trainer_state.pt`` (optimizer state, the step, RNG states, the data position, the config). ``resume``
restores all of it so that the resumed run's losses equal an uninterrupted run's.

Under FSDP2 the state is gathered to full tensors on CPU (``torch.distributed.checkpoint.state_dict`` with
``full_state_dict``) and rank 0 writes one Hugging Face checkpoint: a user loads it with transformers alone,
and the policies this recipe trains fit one host. Sharded ``torch.distributed.checkpoint`` files would save
faster at scale but need torch.distributed to read back. A checkpoint is written to a temporary directory
and renamed when complete, so an interrupted save never leaves one half written.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["latest", "load", "save"]

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
    """Write ``out_dir/checkpoint-{step}`` (every rank calls it; rank 0 writes). Returns its path."""
    final = Path(out_dir) / f"checkpoint-{step}"
    model_sd, opt_sd = _full_state(model, optimizer, world)
    if rank == 0:
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp), state_dict=model_sd)
        if tokenizer is not None and hasattr(tokenizer, "save"):
            tokenizer.save(tmp)
        torch.save(
            {
                "step": step,
                "optimizer": opt_sd,
                "rng": rng_state(rng),
                "data": data,
                "config": config,
                **(extra or {}),
            },
            tmp / "trainer_state.pt",
        )
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    if world > 1:
        dist.barrier()
    return final


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
    path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, world: int
) -> dict[str, Any]:
    """Load the weights and optimizer state of checkpoint ``path`` into ``model`` and ``optimizer``;
    returns the rest of its trainer state (step, RNG states, data position, config).

    Raises:
        ValueError: ``path`` is not a checkpoint, or one of another model; nothing is loaded then.
    """
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"resume: {str(p)!r} does not exist")
    _check_same_model(p, model)
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(p.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    if not weights:
        raise ValueError(f"resume: {str(p)!r} holds no model weights (*.safetensors)")
    state = torch.load(p / "trainer_state.pt", map_location="cpu", weights_only=False)
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
