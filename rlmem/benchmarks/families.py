"""``rlmem train`` on every model family users train, at every precision the recipe offers: a matrix of
two-step runs that keeps breaks like Qwen3's under autocast (its first rollout failed at bf16-mixed, the GPU
default) or Qwen3-MoE's and Mixtral's (their experts' grouped GEMM, off torch's bf16 kernel, copied to the
host in the sampler's CUDA-graph capture: fp32 weights under autocast, fp16) from reaching users.

Each cell is ``rlmem train model=DIR data=FILE reward=rlmem.benchmarks.assets:text_reward steps=2 ...`` in
a process of its own, on a tiny random model of the family saved with ``save_pretrained`` and a tokenizer
trained here (:mod:`.assets`): a family x ``precision`` x ``rollout_dtype`` (``none``: the rollout runs the
training weights; ``bf16``: a copy), then ``engine=server`` on each family's default cell, whose rewards,
losses, sampled tokens, KL and gradient norms must equal the in-process engine's bit for bit (the reward is
one the sampled text moves: ``math`` gives a random model 0.0 on every sample, and so zero losses whatever it
sampled). A cell passes when its run exits 0 with every step's loss finite. Off a GPU the matrix is the fp32
cells (CI runs them).

Summary: ``cells``, ``passed``, ``failed`` (the names of the cells that did not pass), ``all_passed``.
"""

from __future__ import annotations

import json
import math
import os
import queue
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ._common import format_table, package_version, visible_gpus
from ._harness import Run
from .assets import FAMILIES, model_dir, tokenizer_and_data

NAME = "families"
TARGETS = {"all_passed": ("==", True)}
# A reward the sampled text moves, so that rewards, losses and gradients differ from zero (math's would be
# 0.0 for every sample of a random model) and a server cell's equality with its twin says something.
_TRAIN = ["reward=rlmem.benchmarks.assets:text_reward", "prompts_per_step=4", "group_size=2"]
_TRAIN += ["max_new_tokens=8", "save_every=0", "progress=false", "plot=false", "max_prompt_len=64"]


# Besides rewards and losses, what a server cell must equal its twin in, step by step (the sampled tokens'
# count, the KL to the reference and the gradient norm of the update).
_COMPARED = ("tokens", "kl", "grad_norm")


def cell_name(c: dict[str, Any]) -> str:
    return f"{c['family']}/{c['precision']}/{c['rollout_dtype']}/{c['engine']}"


def run_cell(
    cell: dict[str, Any], assets: Path, device: str, steps: int, gpu: str | None = None
) -> dict[str, Any]:
    """One ``rlmem train`` run in a process of its own (on GPU ``gpu``, a ``CUDA_VISIBLE_DEVICES`` entry, if
    given); the cell with what it gave."""
    out = assets / "runs" / cell_name(cell).replace("/", "-")
    argv = [sys.executable, "-m", "rlmem", "train", f"model={assets / cell['family']}"]
    data = assets / "arith.jsonl" if cell.get("data", "file") == "file" else "arithmetic"
    argv += [f"data={data}", f"device={device}", f"precision={cell['precision']}"]
    argv += [f"rollout_dtype={cell['rollout_dtype']}", f"engine={cell['engine']}", f"out_dir={out}"]
    argv += [*_TRAIN, f"steps={steps}"]
    # cuBLAS reduces deterministically only with a fixed workspace: the server cell is compared bit for bit
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    res = {**cell, "exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    if gpu is not None:
        res["gpu"] = gpu
    summary = out / "summary.json"
    if proc.returncode == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        res.update(losses=s["losses"], rewards=s["rewards"], steps=s["steps"])
        rows = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines() if ln.strip()]
        for k in _COMPARED:
            res[k] = [r[k] for r in rows if "step" in r and k in r]
    ok = res.get("steps") == steps and all(math.isfinite(x) for x in res.get("losses", [math.nan]))
    res["passed"] = proc.returncode == 0 and ok
    if not res["passed"]:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        res["error"] = "\n".join(lines[-12:])
    print(f"{cell_name(cell)}: {'ok' if res['passed'] else 'FAIL'} in {res['seconds']} s", flush=True)
    return res


def matrix(
    families: list[str],
    precisions: list[str],
    rollouts: list[str],
    server: list[str],
    default: tuple[str, str],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The local cells, and the server cells (each family's ``default`` precision and rollout dtype)."""
    local = [
        dict(family=f, precision=p, rollout_dtype=r, engine="local")
        for f in families
        for p in precisions
        for r in rollouts
    ]
    for f in server:  # the local twin of each server cell, if the matrix lacks it
        twin = dict(family=f, precision=default[0], rollout_dtype=default[1], engine="local")
        if twin not in local:
            local.append(twin)
    served = [dict(family=f, precision=default[0], rollout_dtype=default[1], engine="server") for f in server]
    return local, served


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [cell_name(c) for c in cells if not c["passed"]]
    return {
        "cells": len(cells),
        "passed": len(cells) - len(failed),
        "failed": failed,
        "all_passed": not failed,
    }


def _same_as_local(served: dict[str, Any], local: list[dict[str, Any]]) -> bool:
    """Whether a server cell's rewards, losses, tokens, KL and gradient norms equal its local twin's, bit
    for bit."""
    key = {k: served[k] for k in ("family", "precision", "rollout_dtype")}
    twin = next(c for c in local if {k: c[k] for k in key} == key)
    fields = ("losses", "rewards", *_COMPARED)
    return bool(twin["passed"]) and all(twin.get(f) == served.get(f) for f in fields)


def _table(cells: list[dict[str, Any]]) -> str:
    """A row per family, a column per precision / rollout dtype / engine."""
    status = {(c["family"], cell_name(c).split("/", 1)[1]): "ok" if c["passed"] else "FAIL" for c in cells}
    cols = sorted({col for _, col in status})
    families = dict.fromkeys(f for f, _ in status)
    rows = [{"family": f, **{col: status.get((f, col), "-") for col in cols}} for f in families]
    return format_table(rows, [("family", "family", "s")] + [(col, col, "s") for col in cols])


def _run_spread(
    cells: list[dict[str, Any]], jobs_per_gpu: int, gpus: list[str | None], run: Any
) -> list[dict[str, Any]]:
    """``run(cell, gpu)`` for every cell, at most ``jobs_per_gpu`` at once on each GPU; results in order."""
    free: queue.Queue[str | None] = queue.Queue()
    for g in gpus:
        for _ in range(jobs_per_gpu):
            free.put(g)

    def one(c: dict[str, Any]) -> dict[str, Any]:
        g = free.get()
        try:
            return run(c, g)
        finally:
            free.put(g)

    with ThreadPoolExecutor(jobs_per_gpu * len(gpus)) as pool:
        return list(pool.map(one, cells))


def _split(value: str, allowed: list[str] | tuple[str, ...], what: str, run_: Run) -> list[str]:
    got = [x for x in value.split(",") if x]
    bad = [x for x in got if x not in allowed]
    if bad:
        run_.error(f"{what}: {bad[0]!r} is not one of {', '.join(allowed)}")
    return got


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    p.add_argument("--precisions", default=None, help="default: bf16-mixed,fp16-mixed,bf16 (GPU), fp32 (CPU)")
    p.add_argument("--rollouts", default=None, help="rollout_dtype values (default: none,bf16 GPU, none CPU)")
    p.add_argument("--server", default=None, help="families run with engine=server too (default: all; none)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--jobs", type=int, default=None, help="local cells at once on each GPU (default: 6 GPU, 2 CPU)"
    )
    p.add_argument("--keep", default=None, help="make the models and runs here and keep them")
    p.add_argument("--merge", action="store_true", help="keep the cells of an existing JSON not run now")
    p.add_argument(
        "--data",
        default="file",
        choices=("file", "arithmetic"),
        help="the questions as a JSONL file (read through the datasets package) or the built-in task",
    )
    args = run_.parse(argv)
    gpu = run_.device.type == "cuda"
    families = _split(args.families, list(FAMILIES), "--families", run_)
    precs = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
    precisions = _split(
        args.precisions or ("bf16-mixed,fp16-mixed,bf16" if gpu else "fp32"), precs, "--precisions", run_
    )
    rollouts = _split(
        args.rollouts or ("none,bf16" if gpu else "none"), ("none", "bf16", "fp16"), "--rollouts", run_
    )
    server = (
        [] if args.server == "none" else _split(args.server or ",".join(families), families, "--server", run_)
    )
    # Each family's default cell, resolved: bf16-mixed and its bf16 copy on a GPU, fp32 on a CPU.
    default = ("bf16-mixed", "bf16") if gpu else ("fp32", "none")
    local, served = matrix(families, precisions, rollouts, server, default)
    for c in (*local, *served):
        c["data"] = args.data
    jobs = args.jobs or (6 if gpu else 2)
    device = run_.device.type  # rlmem train takes cpu or cuda (the rank picks the GPU)
    gpus: list[str | None] = list(visible_gpus()) if gpu else [None]
    with tempfile.TemporaryDirectory() as tmp:
        assets = Path(args.keep or tmp)
        tok, _ = tokenizer_and_data(assets)
        for f in families:
            model_dir(f, assets / f, tok)

        # Local cells side by side on every GPU; the server cells one at a time on each, since a fenced
        # handoff reads its device's free memory, which other processes on it would move.
        def cell(c: dict[str, Any], g: str | None) -> dict[str, Any]:
            return run_cell(c, assets, device, args.steps, g)

        done = _run_spread(local, jobs, gpus, cell)
        for r in _run_spread(served, 1, gpus, cell):
            r["same_as_local"] = r["passed"] and _same_as_local(r, done)
            r["passed"] = r["same_as_local"]
            done.append(r)
    for c in done:
        if not c["passed"]:
            print(
                f"FAILED {cell_name(c)} (exit {c['exit_code']}):\n{c.get('error', 'not bit-identical')}\n",
                file=sys.stderr,
            )
    kept = []
    if args.merge:  # cells of an earlier call not run now (a server cell's local twin always runs with it)
        now = {cell_name(c) for c in done}
        kept = [c for c in run_.previous().get("cells", []) if cell_name(c) not in now]
    done = kept + done
    print(_table(done))
    summary = summarize(done)
    config = dict(families=families, precisions=precisions, rollouts=rollouts, server=server)
    config.update(steps=args.steps, default_cell=list(default), train_args=_TRAIN, data=args.data)
    config["transformers"] = package_version("transformers")  # the families' code is transformers
    config["gpus"] = len(gpus) if gpu else 0
    config["kept_from_earlier_calls"] = [cell_name(c) for c in kept]
    run_.finish(summary, config=config, results={"cells": done})
    return 0 if summary["all_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
