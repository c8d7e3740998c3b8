"""Benchmark of the rollout/train switch: rlmem against naive ``.to()``, the pinned-copy bound and
torch_memory_saver, on a model with all of its training state (one real step taken, gradients kept).

Each contender runs in its own fresh process on the same model (same preset and seed):

* ``rlmem``: ``PhaseManager`` with params, grads and optimizer offloaded; the first cycle right after
  construction (pinned backups still being reserved in the background), then steady cycles. Entering train
  is timed until the state is back (``TrainState.synchronize``). The pinned-copy bound is measured in the
  same process, on the same number of bytes, while the state is offloaded.
* ``naive``: ``model.to("cpu")`` (parameters and gradients) and every optimizer state ``.to("cpu")``, then
  back, then ``torch.cuda.empty_cache()``, as RL frameworks do.
* ``tms``: torch_memory_saver (``hook_mode="torch"``, CPU backup), its region around model and optimizer
  creation and the first step; default mode, then ``retain_cpu_backup=True``. Skipped if not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from .._units import GiB as _GiB
from ..models.presets import PRESETS, build, vocab_size
from ._common import (
    format_table,
    median,
)
from ._harness import Run

NAME = "phase_switch"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _used(device: torch.device, empty_cache: bool = True) -> int:
    """Device memory in use (after returning PyTorch's cached free blocks, unless told not to)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    if empty_cache:
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _model_and_step(preset: str, device: torch.device, seq: int) -> tuple[torch.nn.Module, Any, int]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(preset, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size(preset), (1, seq), generator=g).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # gradients are kept: every category exists
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nbytes += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    nbytes += sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.device == device
    )
    return model, opt, nbytes


def _checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().float().sum().item() for p in model.parameters()))


def part_rlmem(preset: str, device: torch.device, cycles: int, seq: int) -> dict[str, Any]:
    from ..train.phases import OffloadConfig, PhaseManager

    model, opt, state_bytes = _model_and_step(preset, device, seq)
    check = _checksum(model)
    _used(device)
    t0 = time.perf_counter()
    pm = PhaseManager(
        model,
        opt,
        OffloadConfig(offload_during_rollout=True, params="offload", grads="offload", optimizer="offload"),
    )
    construct_s = time.perf_counter() - t0
    assert pm.state is not None
    rows = []
    bound: dict[str, float] = {}
    for c in range(cycles):
        resident = _used(device)
        _sync(device)
        t0 = time.perf_counter()
        with pm.rollout():
            _sync(device)
            rollout_s = time.perf_counter() - t0
            during = _used(device)
            if c == 1:
                bound = _pinned_bound(state_bytes, device)
        _sync(device)
        t0 = time.perf_counter()
        with pm.train():
            host_s = time.perf_counter() - t0
            pm.state.synchronize()
            train_s = time.perf_counter() - t0
        rows.append(
            {
                "cycle": c,
                "rollout_s": rollout_s,
                "train_s": train_s,
                "train_host_s": host_s,
                "freed_bytes": resident - during,
            }
        )
    intact = _checksum(model) == check
    steady = rows[2:] or rows[-1:]
    out = {
        "state_bytes": state_bytes,
        "construct_s": construct_s,
        "first_cycle_s": rows[0]["rollout_s"] + rows[0]["train_s"],
        "first_rollout_s": rows[0]["rollout_s"],
        "first_train_s": rows[0]["train_s"],
        "offload_s": median([r["rollout_s"] for r in steady]),
        "reload_s": median([r["train_s"] for r in steady]),
        "reload_host_s": median([r["train_host_s"] for r in steady]),
        "freed_bytes": median([r["freed_bytes"] for r in steady]),
        "intact": intact,
        "cycles": rows,
        **bound,
    }
    out["offload_gbps"] = state_bytes / out["offload_s"] / 1e9
    out["reload_gbps"] = state_bytes / out["reload_s"] / 1e9
    return out


def _pinned_bound(nbytes: int, device: torch.device) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h, h2d = [], []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        _sync(device)
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.copy_(host, non_blocking=True)
        _sync(device)
        h2d.append(time.perf_counter() - t0)
    del src, host
    _used(device)
    return {"pinned_d2h_gbps": nbytes / median(d2h) / 1e9, "pinned_h2d_gbps": nbytes / median(h2d) / 1e9}


def part_naive(preset: str, device: torch.device, cycles: int, seq: int) -> dict[str, Any]:
    model, opt, state_bytes = _model_and_step(preset, device, seq)
    check = _checksum(model)

    def move(dev: torch.device | str) -> None:
        model.to(dev)  # parameters and their gradients
        for s in opt.state.values():
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    s[k] = v.to(dev)

    rows = []
    for _ in range(cycles):
        resident = _used(device)
        t0 = time.perf_counter()
        move("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _sync(device)
        out_s = time.perf_counter() - t0
        during = _used(device)
        t0 = time.perf_counter()
        move(device)
        _sync(device)
        rows.append({"out_s": out_s, "in_s": time.perf_counter() - t0, "freed_bytes": resident - during})
    steady = rows[1:] or rows
    return {
        "state_bytes": state_bytes,
        "offload_s": median([r["out_s"] for r in steady]),
        "reload_s": median([r["in_s"] for r in steady]),
        "freed_bytes": median([r["freed_bytes"] for r in steady]),
        "first_cycle_s": rows[0]["out_s"] + rows[0]["in_s"],
        "intact": _checksum(model) == check,
        "cycles": rows,
    }


def part_tms(preset: str, device: torch.device, cycles: int, seq: int) -> dict[str, Any]:
    try:
        from torch_memory_saver import torch_memory_saver as tms
    except ImportError:
        return {"skipped": "torch_memory_saver is not installed"}
    from importlib.metadata import version

    tms.hook_mode = "torch"
    with tms.region(tag="train", enable_cpu_backup=True):
        model, _opt, state_bytes = _model_and_step(preset, device, seq)
    check = _checksum(model)
    out: dict[str, Any] = {"state_bytes": state_bytes, "version": version("torch_memory_saver")}
    for mode in ("default", "retain"):
        if mode == "retain":
            tms.retain_cpu_backup = True
        rows = []
        for _ in range(cycles):
            # No empty_cache() here: torch_memory_saver's pool frees its cached blocks through a hook that
            # aborts outside its region; those blocks are its own and pause() releases them anyway.
            resident = _used(device, empty_cache=False)
            t0 = time.perf_counter()
            tms.pause("train")
            _sync(device)
            pause_s = time.perf_counter() - t0
            during = _used(device, empty_cache=False)
            t0 = time.perf_counter()
            tms.resume("train")
            _sync(device)
            rows.append(
                {"pause_s": pause_s, "resume_s": time.perf_counter() - t0, "freed_bytes": resident - during}
            )
        steady = rows[2:] or rows[-1:]
        out[mode] = {
            "first_cycle_s": rows[0]["pause_s"] + rows[0]["resume_s"],
            "offload_s": median([r["pause_s"] for r in steady]),
            "reload_s": median([r["resume_s"] for r in steady]),
            "freed_bytes": median([r["freed_bytes"] for r in steady]),
            "cycles": rows,
        }
    out["intact"] = _checksum(model) == check
    return out


PARTS = {"rlmem": part_rlmem, "naive": part_naive, "tms": part_tms}


def _run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "rlmem.benchmarks.phase_switch",
        "--part",
        part,
        "--preset",
        args.preset,
        "--device",
        args.device,
        "--cycles",
        str(args.cycles),
        "--seq",
        str(args.seq),
    ]
    print(f"  running {part} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    out = json.loads(lines[-1])
    if proc.returncode != 0:
        out["exit_note"] = f"exit {proc.returncode} after reporting: {proc.stderr[-500:].strip()}"
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    r, n, t = res["rlmem"], res["naive"], res.get("tms", {})
    s: dict[str, Any] = {
        "state_gib": r["state_bytes"] / _GiB,
        "offload_s": r["offload_s"],
        "reload_s": r["reload_s"],
        "first_cycle_s": r["first_cycle_s"],
        "freed_fraction": r["freed_bytes"] / r["state_bytes"],
        "speedup_vs_naive": (n["offload_s"] + n["reload_s"]) / (r["offload_s"] + r["reload_s"]),
        "intact": bool(r["intact"] and n["intact"]),
    }
    if "pinned_d2h_gbps" in r:
        s["offload_vs_pinned"] = r["offload_gbps"] / r["pinned_d2h_gbps"]
        s["reload_vs_pinned"] = r["reload_gbps"] / r["pinned_h2d_gbps"]
    if "retain" in t:
        ours = (r["offload_s"] + r["reload_s"]) / r["freed_bytes"]
        theirs = (t["retain"]["offload_s"] + t["retain"]["reload_s"]) / max(t["retain"]["freed_bytes"], 1)
        s["speedup_vs_torch_memory_saver"] = theirs / ours
        s["tms_freed_fraction"] = t["retain"]["freed_bytes"] / t["state_bytes"]
        s["intact"] = s["intact"] and bool(t["intact"])
    return s


TARGETS = {
    "offload_vs_pinned": (">=", 0.90),
    "reload_vs_pinned": (">=", 0.90),
    "freed_fraction": (">=", 0.99),
    "speedup_vs_naive": (">=", 20.0),
    "speedup_vs_torch_memory_saver": (">", 1.0),
    "first_cycle_s": ("<", 3.0),
}


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument(
        "--preset", default=None, choices=PRESETS, help="model (default: qwen2-2.5b on CUDA, mlp-tiny on CPU)"
    )
    p.add_argument(
        "--cycles", type=int, default=4, help="switch cycles per contender (steady state: from the 3rd)"
    )
    p.add_argument("--seq", type=int, default=512, help="tokens of the one training step")
    p.add_argument("--parts", default="rlmem,naive,tms", help="contenders to run")
    p.add_argument("--part", default=None, choices=sorted(PARTS), help=argparse.SUPPRESS)
    args = run_.parse(argv)
    device = run_.device
    args.device = str(device)
    args.preset = args.preset or ("qwen2-2.5b" if device.type == "cuda" else "mlp-tiny")
    if args.cycles < 2:
        run_.error("--cycles must be at least 2")
    if args.part:
        print(json.dumps(PARTS[args.part](args.preset, device, args.cycles, args.seq)), flush=True)
        if args.part == "tms":
            # torch_memory_saver's pool aborts when its blocks are freed outside its region, which
            # interpreter teardown does: leave without running destructors, results already printed.
            os._exit(0)
        return 0
    parts = [x for x in args.parts.split(",") if x]
    if "rlmem" not in parts or "naive" not in parts or any(x not in PARTS for x in parts):
        run_.error(f"--parts must include rlmem and naive, from {', '.join(PARTS)}")
    machine = run_.machine
    res = {part: _run_part(part, args) for part in parts}
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    if failed:
        for k, v in failed.items():
            print(f"{k} failed:\n{v}", file=sys.stderr)
        return 1
    summary = summarize(res)
    table = []
    r, n = res["rlmem"], res["naive"]
    table.append(
        {
            "who": "rlmem",
            "off": r["offload_s"],
            "on": r["reload_s"],
            "freed": r["freed_bytes"] / _GiB,
            "first": r["first_cycle_s"],
        }
    )
    table.append(
        {
            "who": "naive .to()",
            "off": n["offload_s"],
            "on": n["reload_s"],
            "freed": n["freed_bytes"] / _GiB,
            "first": n["first_cycle_s"],
        }
    )
    if "pinned_d2h_gbps" in r:
        table.append(
            {
                "who": "pinned bound",
                "off": r["state_bytes"] / r["pinned_d2h_gbps"] / 1e9,
                "on": r["state_bytes"] / r["pinned_h2d_gbps"] / 1e9,
            }
        )
    for mode in ("default", "retain"):
        if mode in res.get("tms", {}):
            t = res["tms"][mode]
            table.append(
                {
                    "who": f"tms {mode}",
                    "off": t["offload_s"],
                    "on": t["reload_s"],
                    "freed": t["freed_bytes"] / _GiB,
                    "first": t["first_cycle_s"],
                }
            )
    print(f"state: {r['state_bytes'] / _GiB:.2f} GiB ({args.preset} on {machine})")
    print(
        format_table(
            table,
            [
                ("who", "contender", ""),
                ("off", "enter rollout s", ".3f"),
                ("on", "enter train s", ".3f"),
                ("freed", "freed GiB", ".2f"),
                ("first", "first cycle s", ".3f"),
            ],
        )
    )
    run_.finish(
        summary,
        config={"preset": args.preset, "cycles": args.cycles, "seq": args.seq, "parts": parts},
        results=res,
    )
    return 0 if summary["intact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
