"""What ``rlmem train`` prints and sums up: the step line, the run summary, the plot's title, and
``rlmem report`` (re-print a run's memory table and plot). Imports no training code, so ``rlmem report``
answers without loading the loop."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from .._units import GiB, MiB
from ..monitor.timeline import MemoryTimeline, metric_order, text_table
from .config import GRPOConfig

__all__ = ["banner", "comm_figures", "eval_line", "max_used", "report", "step_line", "summarize", "title"]


def _gib(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{v / GiB:.{digits}f}"


def comm_figures(switches: Any) -> dict[str, Any]:
    """This step's communicator suspend and resume on this rank (``PhaseManager.stats().switches``): how,
    seconds, and the device bytes the suspend freed."""
    sus, res = switches.comm_suspend, switches.comm_resume
    if sus is None or res is None:
        return {}
    return {
        "comm_method": sus.method,
        "comm_suspend_s": sus.seconds,
        "comm_resume_s": res.seconds,
        "comm_freed_bytes": sus.freed_bytes,
    }


def max_used(tl: MemoryTimeline, phase: str, step: int) -> int | None:
    """Most device memory in use (driver's view: PyTorch's allocations, rlmem's Regions, the context) in a
    phase's samples; PyTorch's own peak misses the Regions."""
    used = []
    for s in reversed(tl.samples):  # this step's samples are the newest: stop at the previous step's
        if s["step"] < step:
            break
        if s["phase"] == phase and s["step"] == step and "used" in s and not s.get("entry"):
            used.append(s["used"])
    return max(used) if used else None


def step_line(r: dict[str, Any], steps: int) -> str:
    """One line per step, within 100 columns: reward, loss, KL, rollout throughput, rollout + train seconds,
    device GiB in use during rollout / train (the switch seconds and the rest are in ``log.jsonl``)."""
    return (
        f"step {r['step'] + 1:>{len(str(steps))}}/{steps} | reward {r['reward']:.3f} | loss {r['loss']:+.4f} "
        f"| kl {r['kl']:.2g} | {r['tokens_per_s']:,.0f} tok/s | {r['rollout_s']:.1f}+{r['train_s']:.1f}s "
        f"| GiB {_gib(r['used_rollout'], 1)}/{_gib(r['used_train'], 1)}"
    )


def banner(
    cfg: GRPOConfig, n_params: int, world: int, device: torch.device, precision: str, offload: bool
) -> str:
    """The run's first line: model, size, ranks, device, precision, offload and the step shape."""
    return (
        f"rlmem GRPO | model {cfg.model} ({n_params / 1e6:.2f}M params"
        f"{', FSDP2 x' + str(world) if world > 1 else ''}) | {device.type} | precision {precision} | "
        f"offload {'on' if offload else 'off'} | {cfg.steps} steps x {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size} samples"
    )


def eval_line(r: dict[str, Any], steps: int) -> str:
    """One line per evaluation: the updates made before it and the mean reward of the held-out prompts."""
    done = f"{r['eval_step']:>{len(str(steps))}}/{steps}"
    return f"eval after {done} updates | eval reward {r['eval/reward']:.3f}"


def title(cfg: GRPOConfig, offload: bool, device: torch.device) -> str:
    return f"rlmem GRPO: {cfg.model} on {device.type}, offload {'on' if offload else 'off'}"


def summarize(
    cfg: GRPOConfig,
    hist: list[dict[str, Any]],
    tl: MemoryTimeline,
    offload: bool,
    precision: str,
    world: int,
    device: torch.device,
    wall_s: float,
    evals: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    def mean(key: str, rows: list[dict[str, Any]]) -> float:
        return sum(r[key] for r in rows) / max(len(rows), 1)

    k = min(5, len(hist))
    return {
        "config": dataclasses.asdict(cfg),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "world_size": world,
        "offload": offload,
        "precision": precision,
        "steps": len(hist),
        "reward_first5": mean("reward", hist[:k]),
        "reward_last5": mean("reward", hist[-k:]),
        "losses": [r["loss"] for r in hist],
        "rewards": [r["reward"] for r in hist],
        "step_s_mean": mean("step_s", hist),
        "rollout_tokens_per_s_mean": mean("tokens_per_s", hist),
        "switch_s_mean": mean("switch_s", hist),
        **(
            {k + "_mean": mean(k, hist) for k in ("comm_suspend_s", "comm_resume_s", "comm_freed_bytes")}
            if hist and all("comm_suspend_s" in r for r in hist)
            else {}
        ),
        "skipped_updates": sum(int(r.get("skipped_updates", 0)) for r in hist),
        "wall_s": wall_s,  # the whole run, set-up and the end's report included
        "steps_s": sum(r["step_s"] for r in hist),
        "phases": {k: v.as_dict() for k, v in tl.summary().items()},
        "leaks": [f.as_dict() for f in tl.leaks()],
        "evals": [[r["eval_step"], r["eval/reward"]] for r in evals],  # (updates made, eval reward)
    }


def rank_table(ranks: list[dict[str, dict[str, Any]]]) -> str:
    """Every rank's memory by phase (MiB, maxima over the run): its peak and what its trainer and its
    rollout (the engine here, or the rank's server) held, from each rank's ``summary["phases"]``."""
    cats: list[str] = []
    for phases in ranks:
        for v in phases.values():
            cats += [k for k in v if k.startswith("max_") and k not in cats and k != "max_rss"]
    cats.sort(key=lambda k: metric_order(k.removeprefix("max_")))
    rows = [["phase", "rank", "peak alloc", *(c.removeprefix("max_") for c in cats)]]
    for name in dict.fromkeys(n for phases in ranks for n in phases):
        for r, phases in enumerate(ranks):
            v = phases.get(name, {})
            rows.append([name, str(r), *(_mib(v.get(k)) for k in ("peak", *cats))])
    return "memory by rank and phase (MiB; maxima over the run)\n" + text_table(rows)


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / MiB:.2f}"


def report(run_dir: str | os.PathLike[str], *, echo: Any = print, plot: bool = True) -> int:
    """Re-print a finished run's memory table and reward summary and re-draw its plot.

    Raises:
        ValueError: ``run_dir`` holds no ``timeline.jsonl``.
    """
    d = Path(run_dir)
    if not (d / "timeline.jsonl").is_file():
        raise ValueError(f"run_dir {str(d)!r} has no timeline.jsonl (is it the out_dir of rlmem train?)")
    tl = MemoryTimeline.load(d / "timeline.jsonl")
    echo(tl.report())
    if (d / "log.jsonl").is_file():
        rows = [json.loads(line) for line in (d / "log.jsonl").read_text().splitlines() if line.strip()]
        evals = [r for r in rows if "eval_step" in r]
        rows = [r for r in rows if "reward" in r]  # the steps (evals are rows of their own)
        if evals:
            curve = ", ".join(f"{r['eval_step']}: {r['eval/reward']:.3f}" for r in evals)
            echo(f"eval reward by updates made: {curve}")
        if rows:
            k = min(5, len(rows))
            first = sum(r["reward"] for r in rows[:k]) / k
            last = sum(r["reward"] for r in rows[-k:]) / k
            echo(f"{len(rows)} steps | reward: first 5 {first:.3f} -> last 5 {last:.3f}")
    if plot:
        echo(f"timeline plot: {tl.plot(d / 'memory.png', title=f'rlmem GRPO: {d.name}')}")
    for f in tl.leaks():
        echo(
            f"warning: memory grows in phase {f.phase!r}: {f.category} {f.bytes_per_step / MiB:.1f} MiB/step"
        )
    return 0
