"""Fixed-seed runs of two checkouts, compared record by record: a change of shape leaves them bit-identical.

Runs, in each checkout (``PYTHONPATH`` set to it), on the CPU:
  1. the tiny default: ``rlmem train steps=30``;
  2. a user's model, data and reward with ``eval_data``: a tiny random Qwen2 and a tokenizer made in memory
     (``scripts/tiny_assets.py``), ``data=arith.jsonl reward=math eval_data=arith.jsonl eval_every=2``;
  3. ``engine=server``: the tiny default with the rollout in ``rlmem serve``.
and compares every step's record (rewards, losses, KL, gradient norms, token counts, eval rewards; not times
or memory). Usage: python scripts/same_runs.py OLD_CHECKOUT NEW_CHECKOUT [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = {
    "tiny": ["steps=30"],
    "user-model": [
        "model={work}/assets/qwen2",
        "tokenizer={work}/assets/tokenizer",
        "data={work}/assets/arith.jsonl",
        "reward=math",
        "eval_data={work}/assets/arith.jsonl",
        "eval_every=2",
        "steps=4",
        "prompts_per_step=4",
        "group_size=4",
        "max_new_tokens=8",
    ],
    "server": ["engine=server", "steps=6"],
}
# fields that are measured, not computed: they differ between any two runs
TIMED = ("time", "_s", "tok_per_s", "tokens_per_s", "gib", "bytes", "mem", "peak", "used", "alloc", "rss")


def _same(a: dict, b: dict) -> list[str]:
    keys = sorted(k for k in set(a) | set(b) if not any(t in k for t in TIMED))
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="rlmem-same-"))
    env = {**os.environ, "PYTHONPATH": str(Path(args.new).resolve()), "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(
        [
            sys.executable,
            f"{args.new}/scripts/tiny_assets.py",
            str(work / "assets"),
            "--rows",
            "64",
            "--family",
            "qwen2",
        ],
        check=True,
        env=env,
    )
    bad = 0
    for name, keys in RUNS.items():
        logs = []
        for side in ("old", "new"):
            root = Path(getattr(args, side)).resolve()
            out = work / f"{name}-{side}"
            cmd = [sys.executable, "-m", "rlmem", "train", *(k.format(work=work) for k in keys)]
            cmd += ["progress=false", "plot=false", "save_every=0", f"out_dir={out}"]
            r = subprocess.run(cmd, env={**env, "PYTHONPATH": str(root)}, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{name} ({side}) failed:\n{r.stderr[-2000:]}")
                return 1
            logs.append([json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()])
        diffs = [f"record {i}: {d}" for i, (a, b) in enumerate(zip(*logs, strict=False)) for d in _same(a, b)]
        if len(logs[0]) != len(logs[1]):
            diffs.append(f"{len(logs[0])} records against {len(logs[1])}")
        print(f"{name}: {len(logs[1])} records, {'identical' if not diffs else 'DIFFERENT'}")
        for d in diffs[:10]:
            print("  " + d)
        bad += bool(diffs)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
