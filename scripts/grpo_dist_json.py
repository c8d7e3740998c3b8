"""Collects the runs of `scripts/gpu_check.sh grpo-dist` into bench/results/grpo_dist-<machine>.json.

Usage (on the GPU machine, in the environment the runs had, LD_PRELOAD included):
    python3 scripts/grpo_dist_json.py OUT_DIR MACHINE
reads OUT_DIR/grpo_dist_{keep,suspend}_summary.json and _log.jsonl, writes OUT_DIR/grpo_dist-MACHINE.json with
the device, versions, the NCCL torch loaded, and per run: step, rollout, train and switch seconds,
tokens/s, memory used per phase, and with comms=suspend the communicators' suspend/resume seconds and the
bytes freed per rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlmem.benchmarks._common import environment, write_json
from rlmem.comm import _nccl

KEYS = (
    "step_s",
    "rollout_s",
    "train_s",
    "logprobs_s",
    "switch_s",
    "tokens_per_s",
    "used_rollout",
    "used_train",
)
COMM = ("comm_suspend_s", "comm_resume_s", "comm_freed_bytes")
BY_RANK = ("comm_freed_bytes_by_rank",)  # a list per row (every rank's), not averaged into "steady"


def main(out: Path, machine: str) -> None:
    lib = _nccl.library()
    payload = {"benchmark": "grpo_dist", "machine": machine, **environment(torch.device("cuda", 0))}
    payload["nccl"] = f"NCCL {lib.version_string} ({lib.path})"
    payload["runs"] = {}
    for comms in ("keep", "suspend"):
        f = out / f"grpo_dist_{comms}_summary.json"
        if not f.is_file():
            continue
        summary = json.loads(f.read_text())
        rows = [json.loads(r) for r in (out / f"grpo_dist_{comms}_log.jsonl").read_text().splitlines() if r]
        # the first step compiles and captures; the later ones are the steady state
        steady = rows[1:] or rows
        payload["runs"][comms] = {
            "model": summary["config"]["model"],
            "world_size": summary["world_size"],
            "precision": summary["precision"],
            "rollout_dtype": summary["config"].get("rollout_dtype"),
            "steps": summary["steps"],
            "steps_per_row": [{k: r[k] for k in (*KEYS, *COMM, *BY_RANK) if k in r} for r in rows],
            "steady": {k: sum(r[k] for r in steady) / len(steady) for k in (*KEYS, *COMM) if k in steady[0]},
            "phases": summary["phases"],
            "leaks": summary["leaks"],
        }
    write_json(out / f"grpo_dist-{machine}.json", payload)
    for comms, run in payload["runs"].items():
        print(comms, json.dumps(run["steady"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
