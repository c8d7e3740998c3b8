"""Where ``rlmem train`` reports a step besides ``log.jsonl``: a ``tqdm`` progress bar on a terminal, and
optional TensorBoard (``logger=tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` under
``out_dir/tb``) and Weights & Biases (``logger=wandb``; ``WANDB_MODE=offline`` is honoured by wandb itself).
Each optional logger is imported only when asked for, and a missing package is an error that names it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["LOGGERS", "Loggers", "Progress"]

LOGGERS = ("tensorboard", "wandb")
# Scalars sent to TensorBoard / W&B (the rest of a step's record stays in log.jsonl).
_SCALARS = (
    "reward",
    "loss",
    "kl",
    "grad_norm",
    "tokens_per_s",
    "rollout_s",
    "train_s",
    "switch_s",
    "step_s",
    "skipped_updates",
)  # eval/reward goes by log_eval(), at the updates made before the evaluation


def parse_loggers(spec: str | None) -> list[str]:
    """``"tensorboard"``, ``"wandb"``, both comma-separated, or None.

    Raises:
        ValueError: an unknown name (naming the valid ones).
    """
    if spec is None or spec == "":
        return []
    names = [s.strip() for s in str(spec).split(",") if s.strip()]
    bad = [n for n in names if n not in LOGGERS]
    if bad:
        raise ValueError(
            f"logger must be one or more of {', '.join(LOGGERS)} (comma-separated); got {spec!r}"
        )
    return names


class Loggers:
    """The optional loggers of one run (rank 0 only)."""

    def __init__(self, names: list[str], out_dir: Path, config: dict[str, Any], *, resume: bool) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        if "tensorboard" in names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError(
                    "logger=tensorboard needs the tensorboard package: pip install tensorboard"
                ) from e
            self._tb = SummaryWriter(log_dir=str(out_dir / "tb"))
        if "wandb" in names:
            try:
                import wandb
            except ImportError as e:
                raise ValueError("logger=wandb needs the wandb package: pip install wandb") from e
            self._wandb = wandb.init(
                project="rlmem", dir=str(out_dir), config=config, resume="allow" if resume else None
            )

    def log(self, rec: dict[str, Any]) -> None:
        scalars = {k: float(rec[k]) for k in _SCALARS if isinstance(rec.get(k), (int, float))}
        step = int(rec["step"]) + 1
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k if "/" in k else f"train/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_eval(self, updates: int, reward: float) -> None:
        """An evaluation made after ``updates`` updates, at that step of the x axis (step records are at
        their step + 1, so both agree)."""
        if self._tb is not None:
            self._tb.add_scalar("eval/reward", reward, updates)
        if self._wandb is not None:
            self._wandb.log({"eval/reward": reward}, step=updates)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class Progress:
    """A ``tqdm`` bar on stderr, only on a terminal; the per-step lines go to stdout around it."""

    def __init__(self, total: int, initial: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def clear(self) -> None:
        if self._bar is not None:
            self._bar.clear()

    def update(self, reward: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{reward:.3f}", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
