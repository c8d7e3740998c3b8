"""Co-located GRPO with and without rlmem offload: what KV cache fits, and what it buys in rollout tokens/s.

Every part runs the GRPO recipe (``rlmem.recipes.grpo``) in its own process on the same workload:
``prompts x group`` sequences of ``max_new_tokens`` per step, ``steps`` steps (figures from the last). The
default model is ``qwen2-2.7b-mha``: docs/design.md's 2.47B Qwen2 shape with 16 KV heads instead of 2 (2.68B
parameters; fp32 weights, bf16 autocast, AdamW: 40 GiB of train state, 30 GiB of it resident during a rollout
without offload). With 2 KV heads a 52 GiB cache holds 1.9M tokens, and one GRPO step over them takes
minutes here; with 16 it holds 240k. Parts differ only in the KV-cache budget and the offload switch:

* ``big-nooffload``: the big budget without offload: expected to run out of memory (the optimizer states
  and the cache cannot be resident together);
* ``big-offload``: the same budget with offload: the cache holds the whole rollout at once;
* ``half-nooffload``: half the big budget without offload: the rollout fits, but the train phase (40 GiB of
  state, ~12 GiB of activations and logits, and the cache) runs out of memory on an 80 GB H100;
* ``fit-nooffload``: a budget that fits beside the resident train state in both phases (``--kv-fit-gib``):
  the rollout runs in several batches.

Summary: ``oom_without_offload``, ``rollout_tokens_per_s_offload`` (big-offload),
``rollout_tokens_per_s_no_offload`` (fit-nooffload), ``switch_share_of_step`` (big-offload's phase
switches over its step time), and ``step_s_*``, ``peak_*`` per phase.

``--engine server`` (JSON ``grpo_server-*``): the rollout in ``rlmem serve``, a process of its own on the
same GPU (``rlmem train engine=server``), against the one-process recipe:

* ``server-big-nooffload``: two processes without rlmem's handoff, each keeping its memory (the server's
  cache the big budget): expected out of memory;
* ``server-fit-nooffload``: the same with the budget that fits beside the resident train state;
* ``server-big-offload``: two processes handing the device over through the broker at each switch;
* ``big-offload``: the one-process recipe, as above;
* ``server-big-suspend`` (asked for by name, several GPUs only): ``server-big-offload`` with the trainer's
  NCCL communicators suspended while its server samples (``comms=suspend``, which needs an NCCL that can
  suspend: ``--suspend-nccl PATH`` has this part's ranks load one, and no other part's).

Summary: ``fits_with_rlmem``, ``oom_or_smaller_kv_without``, ``step_vs_single_process`` (server-big-offload's
step time over big-offload's), ``sync_s`` (the shared weights' sync), ``switch_share`` (its exposed switch
time over its step time), tokens/s and each process's peak per part; with ``server-big-suspend``, the same
figures suffixed ``_server_suspend``, ``step_suspend_vs_keep`` (its step over server-big-offload's),
``comm_freed_bytes_by_rank`` (what each rank's suspend freed in the last step) and its least in GiB
(``comm_freed_gib_min``), ``comm_suspend_s`` / ``comm_resume_s`` (the lead rank's). Each part records the
NCCL its ranks loaded (``nccl``) where there are several. ``--time-budget`` bounds a call's parts together.

``--gpus N``: every part under torchrun, a rank per GPU, each with the one-GPU workload (``--prompts`` is
per GPU) and, for the server parts, its own server; ``world_size``, and each rank's peaks (its trainer's and
its server's, per phase) in ``rank_peaks_gib_server`` and ``rank_peaks_gib_single``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .._units import GiB as _GiB
from ._common import format_table, spawn_part
from ._harness import Run

NAME = "grpo_colocated"


def _gib(v: float | None) -> float | None:
    return None if v is None else v / _GiB


PARTS = ("big-nooffload", "big-offload", "big-overlap", "half-nooffload", "fit-nooffload")
SERVER_PARTS = ("server-big-nooffload", "server-fit-nooffload", "server-big-offload", "big-offload")
# Run only when named: it needs several GPUs and an NCCL that can suspend, which a plain run may not have.
SERVER_EXTRA_PARTS = ("server-big-suspend",)
MIN_PART_S = 30.0  # --time-budget: less than this left, a part is not started
TARGETS = {
    "switch_share_of_step": ("<", 0.05),
    "tokens_per_s_gain": (">", 1.0),
}
SERVER_TARGETS = {
    "fits_with_rlmem": ("==", True),
    "oom_or_smaller_kv_without": ("==", True),
    "step_vs_single_process": ("<=", 1.05),
    "sync_s": ("<=", 0.05),
    "switch_share": ("<", 0.05),
}


def _config(args: argparse.Namespace, part: str, out_dir: str) -> Any:
    from ..recipes.grpo import GRPOConfig

    server = part.startswith("server-")
    size = part.removeprefix("server-").split("-")[0]
    budget = {"big": args.kv_big_gib, "half": args.kv_big_gib / 2, "fit": args.kv_fit_gib}[size]
    return GRPOConfig(
        engine="server" if server else "local",
        model=args.model,
        # the recipe takes a kind of device, not the harness's "cuda:0"
        device=torch.device(args.device).type,
        steps=args.steps,
        prompts_per_step=args.prompts * args.gpus,  # each GPU the same workload
        group_size=args.group,
        max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch,
        rollout_dtype=args.rollout_dtype,
        updates_per_step=1,
        precision="bf16-mixed",
        offload=not part.endswith("-nooffload"),
        overlap_offload=part.endswith("-overlap"),
        comms="suspend" if part.endswith("-suspend") else "keep",
        kv_budget=f"{budget}GiB",
        out_dir=out_dir,
        progress=False,
        plot=False,
        save_every=0,  # the benchmark times steps; a 2.7B checkpoint at the end would only add minutes
    )


def run_part(args: argparse.Namespace, part: str) -> dict[str, Any] | None:
    """One part in this process (a rank of it under torchrun): what the lead rank measured, else None."""
    from ..recipes.grpo import run

    rank = int(os.environ.get("RANK", "0"))
    # The ranks share the run's directory (the lead writes the log, each rank its timeline).
    d = args.part_dir or tempfile.mkdtemp(prefix="rlmem-bench-")
    rows: list[dict[str, Any]] = []
    try:
        cfg = _config(args, part, d)
        try:
            s = run(cfg, echo=lambda *a, **k: print(*a, file=sys.stderr, **k))
        except torch.OutOfMemoryError as e:
            return {
                "oom": True,
                "rank": rank,
                "oom_message": str(e).splitlines()[0][:400],
                "allocated_at_oom": torch.cuda.memory_allocated(),
            }
        if rank:
            return None
        rows = _logged_steps(d)
        nccl = _nccl_loaded() if s["world_size"] > 1 and cfg.device == "cuda" else None
    finally:
        if args.part_dir is None:
            shutil.rmtree(d, ignore_errors=True)
    return _result(cfg, s, rows, nccl)


def _result(cfg: Any, s: dict[str, Any], rows: list[dict[str, Any]], nccl: str | None) -> dict[str, Any]:
    """A part's figures: its run's summary ``s`` and step rows (figures from the last)."""
    return {
        "oom": False,
        "kv_budget": cfg.kv_budget,
        "engine": cfg.engine,
        "world_size": s["world_size"],
        "steps": rows,
        "last": rows[-1],
        "phases": s["phases"],
        **({"phases_by_rank": s["phases_by_rank"]} if "phases_by_rank" in s else {}),
        "precision": s["precision"],
        **({"comms": cfg.comms, "nccl": nccl} if nccl is not None else {}),
    }


def _logged_steps(d: str) -> list[dict[str, Any]]:
    """The step rows the run in ``d`` logged (``log.jsonl``; an evaluation's rows are not steps)."""
    lines = (Path(d) / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "eval_step" not in r]


def finished_past_time(args: argparse.Namespace, part: str, d: str) -> dict[str, Any] | None:
    """The figures of a part killed past its time after its run had ended: every step logged and the
    summary written in its directory ``d`` (what the lead rank would have printed), else None. Its
    ``nccl`` is not known here (the ranks loaded it); ``ended_past_time`` says how it ended."""
    try:
        s = json.loads((Path(d) / "summary.json").read_text())
        rows = _logged_steps(d)
    except (OSError, ValueError):
        return None
    if s.get("steps") != args.steps or len(rows) != args.steps:
        return None
    return {**_result(_config(args, part, d), s, rows, None), "ended_past_time": True}


def _nccl_loaded() -> str:
    """Which libnccl this process loaded (torch's own, or one put first with ``LD_PRELOAD``): the parts of
    one file may have run with different ones."""
    from ..comm import nccl_driver

    try:
        return nccl_driver().describe
    except Exception as e:  # what it was is provenance: it never costs the part's measured figures
        return f"unknown ({e})"


def _server_peak(r: dict[str, Any], phase: str) -> float | None:
    """The server's most in a phase (its ledger entry: cache and PyTorch's reserved memory), GiB."""
    ph = r.get("phases", {}).get(phase, {})
    parts = [ph.get("max_server_kv_cache"), ph.get("max_server_torch_cache")]
    return None if parts[0] is None else sum(p or 0 for p in parts) / _GiB


def _rank_peaks(phases: dict[str, Any]) -> dict[str, float | None]:
    out = {f"{ph}": _gib(phases.get(ph, {}).get("peak")) for ph in ("rollout", "train")}
    out.update({f"server_{ph}": _server_peak({"phases": phases}, ph) for ph in ("rollout", "train")})
    return out


def summarize_server(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    without, fit = res.get("server-big-nooffload", {}), res.get("server-fit-nooffload", {})
    with_, one = res.get("server-big-offload", {}), res.get("big-offload", {})
    if "oom" in with_:
        s["fits_with_rlmem"] = not with_["oom"]
    if "oom" in without and with_.get("last"):
        smaller = not without["oom"] and without["last"]["kv_bytes"] < with_["last"]["kv_bytes"]
        s["oom_or_smaller_kv_without"] = bool(without["oom"]) or smaller
    susp = res.get("server-big-suspend", {})
    for key, r in (("server", with_), ("server_fit", fit), ("single", one), ("server_suspend", susp)):
        last = r.get("last")
        if not last:
            continue
        s[f"step_s_{key}"] = last["step_s"]
        s[f"rollout_tokens_per_s_{key}"] = last["tokens_per_s"]
        s[f"kv_gib_{key}"] = last["kv_bytes"] / _GiB
        s[f"switch_s_{key}"] = last["switch_s"]
        s[f"sync_s_{key}"] = last.get("sync_s")
        s[f"peak_rollout_gib_{key}"] = _gib(last["peak_rollout"])
        s[f"peak_train_gib_{key}"] = _gib(last["peak_train"])
        if key != "single":
            s[f"server_peak_rollout_gib_{key}"] = _server_peak(r, "rollout")
            s[f"server_peak_train_gib_{key}"] = _server_peak(r, "train")
    if with_.get("world_size"):
        s["world_size"] = with_["world_size"]
    for key, r in (("server", with_), ("single", one), ("server_suspend", susp)):
        if r.get("phases_by_rank"):  # each rank's trainer, and its server, at their most in each phase (GiB)
            s[f"rank_peaks_gib_{key}"] = [_rank_peaks(ph) for ph in r["phases_by_rank"]]
    if with_.get("last"):
        w = with_["last"]
        s["sync_s"] = w.get("sync_s")
        s["switch_share"] = w["switch_s"] / w["step_s"]
        if one.get("last"):
            s["step_vs_single_process"] = w["step_s"] / one["last"]["step_s"]
    if susp.get("last"):
        u = susp["last"]
        s["switch_share_server_suspend"] = u["switch_s"] / u["step_s"]
        if with_.get("last"):
            s["step_suspend_vs_keep"] = u["step_s"] / with_["last"]["step_s"]
        s["comm_method"] = u.get("comm_method")
        s["comm_suspend_s"] = u.get("comm_suspend_s")
        s["comm_resume_s"] = u.get("comm_resume_s")
        # the step record's list, gathered over the ranks (the part runs at several only)
        by_rank = u.get("comm_freed_bytes_by_rank")
        s["comm_freed_bytes_by_rank"] = by_rank
        if by_rank:
            s["comm_freed_gib_min"] = min(by_rank) / _GiB
    return {k: v for k, v in s.items() if v is not None}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    if "oom" in res.get("big-nooffload", {}):
        s["oom_without_offload"] = bool(res["big-nooffload"].get("oom"))
    big, fit = res.get("big-offload", {}), res.get("fit-nooffload", {})
    if big.get("last"):
        b = big["last"]
        s["rollout_tokens_per_s_offload"] = b["tokens_per_s"]
        s["switch_share_of_step"] = b["switch_s"] / b["step_s"]
        s["step_s_offload"] = b["step_s"]
        s["kv_gib_offload"] = b["kv_bytes"] / _GiB
        s["peak_rollout_gib_offload"] = _gib(b["peak_rollout"])
        s["peak_train_gib_offload"] = _gib(b["peak_train"])
    if fit.get("last"):
        f = fit["last"]
        s["rollout_tokens_per_s_no_offload"] = f["tokens_per_s"]
        s["step_s_no_offload"] = f["step_s"]
        s["kv_gib_no_offload"] = f["kv_bytes"] / _GiB
        s["peak_rollout_gib_no_offload"] = _gib(f["peak_rollout"])
        s["peak_train_gib_no_offload"] = _gib(f["peak_train"])
    ov = res.get("big-overlap", {})
    if ov.get("last"):
        o = ov["last"]
        s["switch_share_of_step_overlap"] = o["switch_s"] / o["step_s"]
        s["step_s_overlap"] = o["step_s"]
        if big.get("last"):
            b = big["last"]
            # What the overlap leaves on the step: its own switches, plus what the rollout lost to the
            # copies running beside it.
            s["overlap_exposed_s"] = o["switch_s"] + max(0.0, o["rollout_s"] - b["rollout_s"])
            s["overlap_saved_s"] = (b["switch_s"] + b["rollout_s"]) - (o["switch_s"] + o["rollout_s"])
    if "rollout_tokens_per_s_offload" in s and "rollout_tokens_per_s_no_offload" in s:
        s["tokens_per_s_gain"] = s["rollout_tokens_per_s_offload"] / s["rollout_tokens_per_s_no_offload"]
    return s


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", choices=("local", "server"), default="local")
    server = pre.parse_known_args(argv)[0].engine == "server"
    parts_of = SERVER_PARTS if server else PARTS
    named_only = SERVER_EXTRA_PARTS if server else ()
    if server:
        run_ = Run("grpo_server", "Co-located GRPO with the rollout in rlmem serve", SERVER_TARGETS)
    else:
        run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument(
        "--engine",
        choices=("local", "server"),
        default="local",
        help="server: the rollout in rlmem serve, its own process (JSON grpo_server-*)",
    )
    p.add_argument(
        "--model", default="qwen2-2.7b-mha", help="'tiny', a preset of rlmem.models.presets, or a directory"
    )
    p.add_argument("--kv-big-gib", type=float, default=52.0, help="the big KV budget (GiB)")
    p.add_argument(
        "--kv-fit-gib", type=float, default=20.0, help="a KV budget that fits without offload (GiB)"
    )
    p.add_argument("--prompts", type=int, default=29, help="prompts per step per GPU (29 x 16 fill 52 GiB)")
    p.add_argument("--gpus", type=int, default=1, help="each part under torchrun, a rank per GPU")
    p.add_argument("--part-timeout", type=float, default=3600.0, help="a part's longest run (s)")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds for all the parts of this call: a part gets at most what is left, one is not started "
        f"with under {MIN_PART_S:g} s left; the JSON is written with what ran",
    )
    p.add_argument("--group", type=int, default=16, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward")
    p.add_argument("--rollout-dtype", default=None, help="the recipe's rollout_dtype (default: None)")
    p.add_argument("--steps", type=int, default=2, help="steps per part; figures from the last")
    p.add_argument(
        "--parts",
        default=",".join(parts_of),
        help=f"which of {', '.join(parts_of + named_only)} (default: all but {', '.join(named_only) or '-'})",
    )
    p.add_argument("--merge", action="store_true", help="keep the other parts of an existing JSON file")
    p.add_argument(
        "--suspend-nccl",
        default=None,
        help="a libnccl that can suspend, loaded (LD_PRELOAD) by server-big-suspend's ranks only: the other "
        "parts keep the NCCL torch loads",
    )
    p.add_argument(
        "--part", default=None, choices=PARTS + SERVER_PARTS + SERVER_EXTRA_PARTS, help=argparse.SUPPRESS
    )
    p.add_argument("--part-dir", default=None, help=argparse.SUPPRESS)
    args = run_.parse(argv)
    args.device = str(run_.device)
    if args.part:
        out = run_part(args, args.part)
        if out is not None:
            print(json.dumps(out), flush=True)
        if args.gpus > 1:
            import torch.distributed as dist

            if out is not None and out.get("oom"):
                # A rank out of memory alone (in its train phase) leaves the others waiting in a collective
                # until it times out: failing ends them at once (torchrun stops every rank), and the parent
                # takes the line just printed as the part's outcome.
                sys.stderr.flush()
                os._exit(3)

            if dist.is_initialized():
                dist.destroy_process_group()
            sys.stdout.flush()
            os._exit(0)  # as rlmem train does under torchrun: not through the interpreter's teardown
        return 0
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in parts_of + named_only for x in parts):
        run_.error(f"--parts must be a comma-separated subset of {', '.join(parts_of + named_only)}")
    if args.gpus < 1:
        run_.error(f"--gpus must be at least 1, got {args.gpus}")
    for flag, v in (("--part-timeout", args.part_timeout), ("--time-budget", args.time_budget)):
        if v is not None and v <= 0:
            run_.error(f"{flag} must be positive, got {v:g}")
    if args.suspend_nccl is not None and not os.path.isfile(args.suspend_nccl):
        run_.error(f"--suspend-nccl: no file {args.suspend_nccl!r}")
    if args.gpus == 1 and any(x.endswith("-suspend") for x in parts):
        # comms=suspend releases the communicators of several ranks; the recipe refuses it at one.
        run_.error("--parts server-big-suspend needs --gpus 2 or more")
    args.forward = [a for a in argv if a != "--merge"]
    res: dict[str, Any] = run_.previous() if args.merge else {}
    t0 = time.monotonic()
    skipped = []
    for part in parts:
        timeout_s = args.part_timeout
        if args.time_budget is not None:
            left = args.time_budget - (time.monotonic() - t0)
            if left < MIN_PART_S:
                # not run rather than cut short: a merged file keeps what an earlier call measured
                print(f"{part}: not started, {left:.0f} s of --time-budget left", file=sys.stderr)
                skipped.append(part)
                continue
            timeout_s = min(timeout_s, left)
        d = tempfile.mkdtemp(prefix="rlmem-bench-")
        try:
            env = None
            if args.suspend_nccl and part.endswith("-suspend"):
                # before torch starts in the ranks: the library they load is the one they keep
                pre = os.environ.get("LD_PRELOAD")
                env = {"LD_PRELOAD": os.path.abspath(args.suspend_nccl) + (f":{pre}" if pre else "")}
            res[part] = spawn_part(
                "rlmem.benchmarks.grpo_colocated",
                part,
                [*args.forward, "--part-dir", d],
                env=env,
                nproc=args.gpus,
                timeout_s=timeout_s,  # the net under a rank left waiting in a collective
                outcome_key="oom",  # a rank out of memory ends its peers by failing (below)
            )
            if res[part].get("error", "").startswith("ran past"):
                # killed in its teardown, its run done: the figures it wrote stand
                res[part] = finished_past_time(args, part, d) or res[part]
        finally:
            shutil.rmtree(d, ignore_errors=True)
        # Parts merged from earlier calls keep their own stamp: a summary across parts of different dates
        # compares different versions of the rollout.
        res[part]["measured"] = {"date": time.strftime("%Y-%m-%d"), "rlmem": __version__}
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    for k, v in failed.items():
        print(f"{k} failed:\n{v}", file=sys.stderr)
    summary = summarize_server(res) if server else summarize(res)
    rows = []
    for part in parts_of + named_only:
        r = res.get(part)
        if not r or "error" in r:
            continue
        if r["oom"]:
            rows.append({"part": part, "status": "out of memory"})
            continue
        last = r["last"]
        rows.append(
            {
                "part": part,
                "status": "ran",
                "kv": last["kv_bytes"] / _GiB,
                "batch": last["kv_batch"],
                "tps": last["tokens_per_s"],
                "roll": last["rollout_s"],
                "train": last["train_s"],
                "switch": last["switch_s"],
                "step": last["step_s"],
                "pr": _gib(last["peak_rollout"]),
                "pt": _gib(last["peak_train"]),
                "sync": last.get("sync_s"),
                "sp": _server_peak(r, "rollout"),
            }
        )
    print(
        format_table(
            rows,
            [
                ("part", "part", ""),
                ("status", "status", ""),
                ("kv", "KV GiB", ".1f"),
                ("batch", "KV seqs", "d"),
                ("tps", "rollout tok/s", ",.0f"),
                ("roll", "rollout s", ".1f"),
                ("train", "train s", ".1f"),
                ("switch", "switch s", ".3f"),
                ("step", "step s", ".1f"),
                ("pr", "peak rollout GiB", ".1f"),
                ("pt", "peak train GiB", ".1f"),
                ("sync", "sync s", ".4f"),
                ("sp", "server peak GiB", ".1f"),
            ],
        )
    )
    if "comm_freed_bytes_by_rank" in summary:
        freed = ", ".join(f"{b / _GiB:.2f}" for b in summary["comm_freed_bytes_by_rank"])
        print(
            f"server-big-suspend ({summary.get('comm_method')}): NCCL memory freed per rank, GiB: {freed}; "
            f"suspend {summary.get('comm_suspend_s', float('nan')):.3f} s, "
            f"resume {summary.get('comm_resume_s', float('nan')):.3f} s (rank 0)"
        )
    skip = ("forward", "part", "json", "merge", "machine")
    run_.finish(summary, config={k: v for k, v in vars(args).items() if k not in skip}, results=res)
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    raise SystemExit(main())
