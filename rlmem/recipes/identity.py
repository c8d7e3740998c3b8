"""Which run a folder's results and a checkpoint belong to: ``resume`` goes on with the same run only, and
a run never writes over another run's log, summary, config or checkpoints.

A run's identity is the config keys that decide what it learns (:data:`KEYS`): the model, the data and how
it is read, the reward, the seed, GRPO's hyperparameters and the precision. It leaves out ``steps``: a run
resumed with more steps is the same run made longer, which is what resuming is for. It leaves out where and
how the run computes (:data:`OTHER`): the device and the memory settings give the same results bit for bit
(offload, comms, the engine, CUDA graphs, the KV budget) or change only the order of float sums
(micro-batching), and a run may go on with other values on other hardware; and what it reports and where and
when it saves. Two configs that agree on :data:`KEYS` are one run; its name is a hash of those values
(``run 3f2a9c1b``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import GRPOConfig
from .yaml_config import read

__all__ = ["KEYS", "OTHER", "check_checkpoint", "check_folder", "differences", "identity", "run_name"]

KEYS = (
    "model",
    "tokenizer",
    "chat_template",
    "data",
    "prompt_key",
    "answer_key",
    "max_prompt_len",
    "reward",
    "min_digits",
    "max_digits",
    "seed",
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "temperature",
    "top_p",
    "lr",
    "weight_decay",
    "max_grad_norm",
    "clip_eps",
    "kl_coef",
    "updates_per_step",
    "precision",
    "rollout_dtype",  # a bf16 copy samples other tokens than the fp32 weights under autocast
)
# Every other key, and why a run may change it and stay the same run.
OTHER = {
    "steps": "how long it runs: a resumed run is the same run made longer",
    "save_every": "when it saves",
    "resume": "where it goes on from",
    "out_dir": "where it writes",
    "eval_data": "evaluations score the policy; they do not train it",
    "eval_every": "evaluations score the policy; they do not train it",
    "eval_before_train": "evaluations score the policy; they do not train it",
    "logger": "what it reports to",
    "progress": "what it draws",
    "plot": "what it draws",
    "device": "where it computes",
    "micro_batch_size": "the order of float sums only (the loss is normalised per mini-batch)",
    "dynamic_batching": "the order of float sums only",
    "max_tokens_per_micro_batch": "the order of float sums only",
    "gradient_checkpointing": "memory: the same results",
    "share_prompts": "memory and speed: the same results within fp32 rounding",
    "offload": "memory: the same results bit for bit",
    "kv_budget": "memory: the rollout's batch",
    "cuda_graphs": "speed: the same decode",
    "comms": "memory: the same results bit for bit",
    "overlap_offload": "memory: the same results",
    "engine": "where the rollout runs: the same results bit for bit",
    "engine_url": "where the rollout runs",
}
_PATHS = ("model", "tokenizer", "data")  # compared as the files they name where those exist


def _value(key: str, v: Any) -> Any:
    """``v`` as two configs of one run spell it alike: a path that exists made absolute, a whole number
    as an int (``temperature=1.0`` is ``1``), ``rollout_dtype`` ``None`` as ``"none"``."""
    if key in _PATHS and isinstance(v, str) and Path(v).exists():
        return str(Path(v).resolve())
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        f = float(v)
        return int(f) if f.is_integer() else f
    if key == "rollout_dtype" and v is None:
        return "none"
    return v


def identity(config: Mapping[str, Any] | GRPOConfig) -> dict[str, Any]:
    """The identity of a run of ``config`` (a :class:`GRPOConfig`, or one as saved: a mapping, where a key
    it lacks has GRPOConfig's default)."""
    given = dataclasses.asdict(config) if isinstance(config, GRPOConfig) else dict(config)
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    return {k: _value(k, given.get(k, defaults[k])) for k in KEYS}


def run_name(ident: Mapping[str, Any]) -> str:
    """``run`` and 8 hex digits of a hash of the identity: the same for every config of one run."""
    digest = hashlib.sha256(json.dumps(dict(ident), sort_keys=True, default=str).encode()).hexdigest()
    return f"run {digest[:8]}"


def differences(there: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """``key X there, Y here`` for each identity key whose values differ."""
    return [f"{k} {there[k]!r} there, {here[k]!r} here" for k in KEYS if there[k] != here[k]]


def _other_run(there: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """None for the same run; else both runs' names and the keys that differ, for a message."""
    diff = differences(there, here)
    if not diff:
        return None
    return f"{run_name(there)} there, {run_name(here)} here; " + "; ".join(diff)


def check_folder(cfg: GRPOConfig) -> None:
    """Refuse a run whose ``out_dir`` holds another run's results (its ``config.yaml`` says which), before
    anything is written there. A folder without one, or with this run's, is fine.

    Raises:
        ValueError: naming the folder, both runs and the keys that differ, and what to do.
    """
    out = Path(cfg.out_dir)
    saved = out / "config.yaml"
    if not saved.is_file():
        return
    try:
        theirs = identity(read(saved))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"out_dir {str(out)!r} holds a config.yaml that cannot be read ({e}): another run's results may "
            "be there; give this run an out_dir of its own (out_dir=DIR), or remove that folder"
        ) from None
    why = _other_run(theirs, identity(cfg))
    if why is not None:
        raise ValueError(
            f"out_dir {str(out)!r} holds another run's results ({why}): give this run an out_dir of its own "
            f"(out_dir=DIR), the keys of that run to go on with it (resume=auto), or remove {str(out)!r}"
        )


def check_checkpoint(where: Path, saved: Mapping[str, Any] | None, cfg: GRPOConfig) -> None:
    """Refuse to resume from checkpoint ``where`` of another run (``saved``: the config in its trainer
    state). Called before anything is loaded.

    Raises:
        ValueError: naming the checkpoint, both runs and the keys that differ, and what to do.
    """
    if saved is None:
        raise ValueError(f"resume: {str(where)!r} holds no config of the run that wrote it")
    why = _other_run(identity(saved), identity(cfg))
    if why is not None:
        raise ValueError(
            f"resume: {str(where)!r} is a checkpoint of another run ({why}); resume goes on with the run "
            f"that wrote it, under its keys. model={where} starts a new run from its weights"
        )
