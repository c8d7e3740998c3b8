"""What a run of ``rlmem train`` writes and prints: ``config.yaml``, ``log.jsonl`` (rewritten on resume to
the steps before the one resumed from), the optional loggers and progress bar, the step line, one record per
step (built in one place), the memory timeline's categories, and, at the end, the summary, the memory table
and the plot. Only the lead rank writes, but for each rank's own timeline."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..monitor.timeline import MemoryTimeline
from .config import GRPOConfig
from .loggers import Loggers, Progress, parse_loggers
from .report import comm_figures, eval_line, max_used, rank_table, step_line, summarize, title
from .runtime import Runtime
from .yaml_config import dump

__all__ = ["RunLog", "StepResult", "track"]


@dataclass
class StepResult:
    """What one step measured on this rank (the record sums it over the ranks)."""

    step: int
    rewards: torch.Tensor
    tokens: int  # rollout tokens sampled
    resp_tokens: float  # completion tokens trained on
    loss: float
    kl: float
    grad_norm: float
    skipped: int
    rollout_s: float
    score_s: float
    train_s: float
    switch_s: float
    step_s: float
    eval_reward: float | None = None
    sync_s: float | None = None  # the rollout weights' sync, within the switch to rollout
    logprobs_s: float | None = None  # within train_s: the log-probs before the update (policy, reference)


class RunLog:
    """Opened once the run is known to start (a run refused earlier has written nothing over an earlier one).

    Args:
        cfg: the run's config (written to ``out_dir/config.yaml``).
        rt: the runtime (only the lead rank writes and prints).
        start: the step the run starts at (> 0 on resume: earlier log rows are kept, later ones dropped).
        say: where lines go.
        t0: when the run began (``time.perf_counter()``; the summary's wall time counts set-up too).
    """

    def __init__(self, cfg: GRPOConfig, rt: Runtime, start: int, say: Any, *, t0: float) -> None:
        self.cfg, self.rt, self.say = cfg, rt, say
        self.out = Path(cfg.out_dir)
        self.t0 = t0
        self.history: list[dict[str, Any]] = []  # a record per step
        self.evals: list[dict[str, Any]] = []  # a row per evaluation
        self._file = None
        self.loggers: Loggers | None = None
        if rt.lead:
            self.out.mkdir(parents=True, exist_ok=True)
            dump(cfg, self.out / "config.yaml")
            # Only the lead reads the earlier log: it rewrites that file below, and another rank reading it
            # meanwhile could see it empty. Decisions every rank must agree on count steps, not log rows.
            log = self.out / "log.jsonl"
            kept: list[dict[str, Any]] = []
            if start and log.is_file():
                rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
                kept = [r for r in rows if r.get("step", r.get("eval_step", start)) < start]
                self.history = [r for r in kept if "step" in r]
                self.evals = [r for r in kept if "eval_step" in r]
            self._file = log.open("w")
            for r in kept:  # what the resumed run had logged, without the steps it will repeat
                self._file.write(json.dumps(r) + "\n")
            names = parse_loggers(cfg.logger)
            self.loggers = Loggers(names, self.out, dataclasses.asdict(cfg), resume=bool(start))
        self.bar = Progress(cfg.steps, start, enabled=cfg.progress and rt.lead)

    def record(self, r: StepResult, tl: MemoryTimeline, engine: Any, switches: Any) -> dict[str, Any]:
        """The step's record, summed over the ranks: what ``log.jsonl``, the loggers and the line show."""
        world = self.rt.world
        # PyTorch's allocator retries a failed cudaMalloc after freeing its cache and synchronizing: a
        # train phase that slows for no change in its work often does that (cumulative, over the ranks)
        dev = self.rt.device
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) if dev.type == "cuda" else 0
        mine = [r.rewards.sum().item(), len(r.rewards), r.loss, r.kl, r.resp_tokens, r.tokens, retries]
        stats = self.rt.all_reduce(torch.tensor(mine, dtype=torch.float64))
        cfg = self.cfg
        return {
            "step": r.step,
            "reward": stats[0].item() / stats[1].item(),
            "loss": stats[2].item() / world,
            "kl": stats[3].item() / max(stats[4].item(), 1),
            "grad_norm": r.grad_norm,
            "tokens": int(stats[5].item()),
            "tokens_per_s": stats[5].item() / world / max(r.rollout_s, 1e-9),
            "rollout_s": r.rollout_s,
            "score_s": r.score_s,
            "train_s": r.train_s,
            "logprobs_s": r.logprobs_s,
            "switch_s": r.switch_s,
            "sync_s": r.sync_s,
            "step_s": r.step_s,
            "peak_rollout": tl.phases[-2].peak,
            "peak_train": tl.phases[-1].peak,
            "used_rollout": max_used(tl, "rollout", r.step),
            "used_train": max_used(tl, "train", r.step),
            "skipped_updates": r.skipped,
            "alloc_retries": int(stats[6].item()),  # so far
            **({"eval/reward": r.eval_reward} if r.eval_reward is not None else {}),
            "kv_batch": engine.batch_size,
            "graph_captures": engine.captures,  # so far: the same after step 0 unless the weights moved
            "kv_bytes": engine.kv_bytes,
            **(self._comm(switches) if switches is not None and cfg.comms == "suspend" else {}),
            **({"overlapped": switches.overlapped} if switches is not None and cfg.overlap_offload else {}),
        }

    def _comm(self, switches: Any) -> dict[str, Any]:
        """The lead's communicator figures, and the bytes each rank's suspend freed (``..._by_rank``)."""
        figs = comm_figures(switches)
        if self.rt.world > 1:
            mine = torch.zeros(self.rt.world, dtype=torch.float64)
            mine[self.rt.rank] = float(figs.get("comm_freed_bytes") or 0)
            figs["comm_freed_bytes_by_rank"] = [int(x) for x in self.rt.all_reduce(mine).tolist()]
        return figs

    def step(self, rec: dict[str, Any]) -> None:
        """Keep, write and show one step's record."""
        self.history.append(rec)
        self._write(rec)
        self.bar.clear()
        self.say(step_line(rec, self.cfg.steps))
        self.bar.update(rec["reward"])
        if self.loggers is not None:
            self.loggers.log(rec)

    def eval(self, updates: int, reward: float | None) -> None:
        """Keep, write and show an evaluation made after ``updates`` updates (nothing for None: no
        held-out prompts)."""
        if reward is None:
            return
        row = {"eval_step": updates, "eval/reward": reward}
        self.evals.append(row)
        self._write(row)
        self.bar.clear()
        self.say(eval_line(row, self.cfg.steps))
        if self.loggers is not None:
            self.loggers.log_eval(updates, reward)

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
        if self.loggers is not None:
            self.loggers.close()

    def finish(
        self,
        tl: MemoryTimeline,
        offload: bool,
        *,
        done: int,
        interrupted: bool,
        together: bool = True,
        by: str | None = None,
    ) -> dict[str, Any]:
        """The run's summary (written with the timeline, on the lead), the memory table, plot and reward.
        Under torchrun each rank writes its own timeline and, where the ranks ended ``together`` (not a
        second Ctrl-C), the lead's summary and table have every rank's memory by phase. ``by``: the signal
        that stopped the run (``"SIGTERM"``), also the summary's ``stopped_by``."""
        cfg, rt, out, say = self.cfg, self.rt, self.out, self.say
        wall = time.perf_counter() - self.t0
        summary = summarize(
            cfg, self.history, tl, offload, rt.precision, rt.world, rt.device, wall, self.evals
        )
        if by is not None:
            summary["stopped_by"] = by
        ranks: list[Any] = [summary["phases"]]
        if rt.world > 1 and together:
            ranks = [None] * rt.world
            torch.distributed.all_gather_object(ranks, summary["phases"], group=rt.ctl)
            summary["phases_by_rank"] = ranks
        if not rt.lead:
            tl.save(out / f"timeline-rank{rt.rank}.jsonl")
            return summary
        tl.save(out / "timeline.jsonl")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        say("")
        say(tl.report())
        if len(ranks) > 1:
            say(rank_table(ranks))
        if cfg.plot:
            try:
                say(f"timeline plot: {tl.plot(out / 'memory.png', title=title(cfg, offload, rt.device))}")
            except RuntimeError as e:
                say(f"(no plot: {e})")
        if self.history:
            say(
                f"reward: first 5 steps {summary['reward_first5']:.3f} -> last 5 steps "
                f"{summary['reward_last5']:.3f} | {summary['wall_s']:.1f} s | logs in {out}"
            )
        if interrupted or by is not None:
            why = f" ({by})" if by is not None else ""
            say(f"interrupted after {done} steps{why}: log, timeline and summary in {out}")
        return summary


def _local_bytes(tensors: Any) -> int:
    n = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        n += t.numel() * t.element_size()
    return n


def track(tl: MemoryTimeline, policy: Any) -> None:
    """The timeline's categories: bytes on this device, rlmem's own counts where it holds the tensors (the
    PhaseManager's TrainState, the reference's), else the tensors; the engine's KV cache and graphs."""
    pm, model, opt, ref, ref_state = policy.pm, policy.model, policy.opt, policy.ref, policy.ref_state

    def cat(name: str) -> int:
        if pm.state is not None:
            return pm.state.stats().categories[name].resident_bytes
        if name == "params":
            return _local_bytes(model.parameters())
        if name == "grads":
            return _local_bytes(p.grad for p in model.parameters())
        return _local_bytes(
            v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
        )

    tl.track("params", lambda: cat("params"))
    tl.track("grads", lambda: cat("grads"))
    tl.track("optimizer", lambda: cat("optimizer"))
    if ref is not None:
        tl.track(
            "reference",
            lambda: (
                ref_state.stats().categories["params"].resident_bytes
                if ref_state is not None
                else _local_bytes(ref.parameters())
            ),
        )
    for c in policy.engine_categories:
        tl.track(c, lambda c=c: policy.engine_memory().get(c, 0))
