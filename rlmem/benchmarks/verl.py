"""verl's FSDP engine offloading through rlmem, against verl's own offload, each in a process of its own.

Every part builds the same FSDP2 model (``--preset``, a 3B Qwen2 shape by default, fp32, ``fully_shard`` per
decoder layer and the root, as verl wraps it) with AdamW under verl's ``FSDPEngineWithLMHead`` (from verl's
wheel; made with ``object.__new__`` as verl's CPU tests make engines, its offload flags on) and moves its
state with ``FSDPEngine.to`` and the train mode, as verl's workers do. Part ``verl`` runs verl's own helpers;
``rlmem`` loads ``rlmem.integrations.verl`` through ``VERL_USE_EXTERNAL_MODULES``; ``rlmem-step`` adds
``RLMEM_VERL_OPTIMIZER=step``; ``none`` (the reference) runs the same steps with nothing ever offloaded. Per
part, after a train step has made the optimizer states:

- the first offload and reload (verl: its pinned caching allocator's blocks made; rlmem: adoption and the
  pinned backups), then ``--cycles`` steady ones, as fractions of the pinned link measured here first;
- host memory held: the process's resident growth over the cycles (and each side's own count: PyTorch's
  pinned caching allocator, the Regions' backups); free device memory in "rollout" (everything offloaded);
- ``--frag-cycles`` train-mode cycles with a rollout between (a KV-cache-sized allocation of most of the free
  memory, then given back to the driver, as vLLM's sleep does): PyTorch's reserved-minus-allocated bytes
  right after the step of the last cycle, and after its offload;
- the bytes a model-only reload (the eval mode, the weight sync) brings back, and where the optimizer is;
- the device's peak over an update (forward, backward, verl's ``optimizer_step``) on a batch whose
  activations exceed the optimizer states, sampled from the driver's free memory;
- hashes of the weights and optimizer states after each stage (every part runs the same steps on the same
  data: each must equal the reference's).

Writes bench/results/verl-<machine>.json: ``rlmem bench verl --machine nvidia-h200-x1``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
import types
from typing import Any

import torch

from ._common import format_table, link_rates, median, spawn_part, timed
from ._harness import Run

NAME = "verl"
TARGETS: dict[str, tuple[str, float]] = {
    "offload_vs_pinned": (">=", 0.9),
    "reload_vs_pinned": (">=", 0.9),
    "steady_vs_verl": (">=", 1.0),
    "first_cycle_speedup_vs_verl": (">=", 3.0),
    "host_bytes_vs_verl": ("<=", 0.7),
    "fragmentation_vs_verl": ("<=", 0.5),
    "update_peak_drop_vs_optimizer": (">=", 0.9),
    "bit_identical": ("==", 1.0),
}
PARTS = {
    "none": {"VERL_USE_EXTERNAL_MODULES": ""},
    "verl": {"VERL_USE_EXTERNAL_MODULES": ""},
    "rlmem": {"VERL_USE_EXTERNAL_MODULES": "rlmem.integrations.verl", "RLMEM_VERL_OPTIMIZER": "offload"},
    "rlmem-step": {"VERL_USE_EXTERNAL_MODULES": "rlmem.integrations.verl", "RLMEM_VERL_OPTIMIZER": "step"},
}


def fsdp_engine(module: torch.nn.Module, optimizer: Any, hf_config: Any, *, offload: bool, world: int) -> Any:
    """verl's ``FSDPEngineWithLMHead`` over an FSDP-wrapped model and its optimizer, made with
    ``object.__new__`` and given the attributes ``FSDPEngine.__init__`` and ``initialize`` set that its
    offload (``to``), train and eval modes, weight sync (``get_per_tensor_param``) and ``optimizer_step``
    read; ``offload``: verl's ``param_offload`` and ``optimizer_offload``."""
    import torch.distributed as dist
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    e = object.__new__(FSDPEngineWithLMHead)
    e.module = module
    e.optimizer = optimizer
    e.lr_scheduler = None
    e.engine_config = types.SimpleNamespace(forward_only=False, fsdp_size=world)
    e.optimizer_config = types.SimpleNamespace(clip_grad=1.0)
    e.model_config = types.SimpleNamespace(lora={}, hf_config=hf_config)
    e.mode = None
    e.rank = dist.get_rank()
    e.scaler = None
    e.ulysses_parallel_group = None
    e._is_offload_param = offload
    e._is_offload_optimizer = offload
    e._uses_fsdp2_cpu_offload_policy = False
    e._qat_enabled = False
    e._is_lora = False
    return e


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_tensors(e: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    # the parameters' own local tensors (``p.data`` of a DTensor is an alias, a new tensor object)
    params = [_local(p) for p in e.module.parameters()]
    states = [
        _local(v)
        for p in e.module.parameters()
        for v in e.optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    return params, states


def _everything(e: Any) -> list[torch.Tensor]:
    params, states = _state_tensors(e)
    return params + states


def _digest(ts: list[torch.Tensor]) -> str:
    """A fingerprint of the tensors' bits, computed where they are: per chunk of each tensor's 32-bit words
    (bytes for other sizes), their sum and a position-weighted sum; then SHA-256 of those numbers."""
    h = hashlib.sha256()
    for t in ts:
        flat = t.detach().reshape(-1)
        flat = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.uint8)
        for chunk in flat.split(1 << 26):
            w = torch.arange(chunk.numel(), device=chunk.device, dtype=torch.int64) % 65521 + 1
            x = chunk.to(torch.int64)
            h.update(f"{int(x.sum())},{int((x * w).sum())};".encode())
    return h.hexdigest()[:16]


def _meminfo(key: str) -> int:
    with open("/proc/self/status" if key.startswith("Vm") else "/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _PeakSampler:
    """The device's used memory (the driver's total minus free), sampled from a thread until stopped."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free)
            time.sleep(0.0005)

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize(self.device)
        self._stop.set()
        self._thread.join()
        free, total = torch.cuda.mem_get_info(self.device)
        self.peak = max(self.peak, total - free)


def pinned_link(device: torch.device, gib: float = 4.0) -> dict[str, float]:
    """GB/s of one large copy each way between the device and pinned host memory (``link_rates``' best)."""
    n = int(gib * 2**30)
    d2h, h2d = link_rates(device, n)
    return {"d2h_gbps": d2h / 1e9, "h2d_gbps": h2d / 1e9, "bytes": n}


def _part(name: str, preset: str, cycles: int, frag_cycles: int, port: int) -> dict[str, Any]:
    """One part, in its own process: see the module's docstring."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..models.presets import build, vocab_size

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401  (patched here where the part loads rlmem)

    out: dict[str, Any] = {"part": name}
    if name.startswith("rlmem"):
        import rlmem.integrations.verl as rv

        out["patched"] = rv.patched()
        out["settings"] = vars(rv.settings())
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build(preset, device, torch.float32, seed=0)
    mesh = init_device_mesh("cuda", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    moves = name != "none"  # the reference: the same steps on the same data, nothing ever offloaded
    e = fsdp_engine(model, opt, model.config, offload=moves, world=1)
    vocab = vocab_size(preset)

    def batch(i: int, rows: int = 1, seq: int = 512) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randint(0, vocab, (rows, seq), generator=g).to(device)

    losses: list[float] = []
    out["losses"] = losses
    out["grad_norms"] = norms = []

    def step(x: torch.Tensor) -> None:
        loss = e.module(input_ids=x).logits.float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.item())
        del loss
        norms.append(e.optimizer_step())
        e.optimizer_zero_grad()

    step(batch(0))  # the optimizer states exist from here
    params, states = _state_tensors(e)
    stages = {"first step": _digest(params + states)}
    pbytes = sum(t.numel() * t.element_size() for t in params)
    obytes = sum(t.numel() * t.element_size() for t in states)
    out.update(param_bytes=pbytes, optimizer_bytes=obytes, tensors=len(params) + len(states))
    # held here, they would keep verl's offloaded device tensors alive (it replaces them with new ones)
    del params, states
    rss0, avail0 = _meminfo("VmRSS"), _meminfo("MemAvailable")

    def off() -> None:
        if moves:
            e.to("cpu", model=True, optimizer=True, grad=True)

    def on() -> None:
        if moves:
            e.to("cuda", model=True, optimizer=True, grad=True)

    out["first_offload_s"] = timed(off, device)
    out["first_reload_s"] = timed(on, device)
    print(
        f"{name}: first offload {out['first_offload_s']:.2f} s, reload {out['first_reload_s']:.2f} s",
        flush=True,
    )
    offs, ons = [], []
    for _ in range(cycles):
        offs.append(timed(off, device))
        ons.append(timed(on, device))
    out["offload_s"], out["reload_s"] = median(offs), median(ons)
    stages["offload cycles"] = _digest(_everything(e))
    out["offload_gbps"] = (pbytes + obytes) / out["offload_s"] / 1e9
    out["reload_gbps"] = (pbytes + obytes) / out["reload_s"] / 1e9
    # what "rollout" has: everything offloaded
    off()
    torch.cuda.empty_cache()
    out["free_in_rollout"] = torch.cuda.mem_get_info(device)[0]
    # What the process holds in host memory for the state: its resident growth (pinned pages are resident),
    # and each side's own count (PyTorch's pinned caching allocator's peak of blocks in use; the Regions'
    # backups).
    out["host_bytes"] = _meminfo("VmRSS") - rss0
    if hasattr(torch.cuda, "host_memory_stats"):
        out["host_memory_stats"] = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}
    if name.startswith("rlmem"):
        st = rv.state_of(e)
        out["pinned_own_count"] = sum(c.backup_bytes for c in st.stats().categories.values())
    else:
        out["pinned_own_count"] = out.get("host_memory_stats", {}).get("active_bytes.peak")
    out["mem_available_drop"] = avail0 - _meminfo("MemAvailable")
    # a model-only reload, as the eval mode and the weight sync ask
    with e.eval_mode():
        if name.startswith("rlmem"):
            out["model_only_reload_bytes"] = st.stats().last.reload_bytes
            out["optimizer_away_in_eval"] = st.paused("optimizer")
        else:
            out["model_only_reload_bytes"] = pbytes  # verl's helper moves the model's tensors
            out["optimizer_away_in_eval"] = all(t.device.type == "cpu" for t in _state_tensors(e)[1])
    print(f"{name}: steady {out['offload_s']:.3f} / {out['reload_s']:.3f} s", flush=True)
    # train-mode cycles with a rollout between
    for i in range(frag_cycles):
        with e.train_mode():
            step(batch(1 + i))
            if i == frag_cycles - 1:
                torch.cuda.synchronize(device)
                out["frag_after_step"] = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
                    device
                )
        free = torch.cuda.mem_get_info(device)[0]
        kv = torch.empty(int(free * (0.80 + 0.05 * (i % 3))), dtype=torch.uint8, device=device)
        del kv
        torch.cuda.empty_cache()  # the rollout's memory back to the driver, as vLLM's sleep gives it
    out["frag_after_offload"] = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    on()
    stages["train cycles"] = _digest(_everything(e))
    off()
    # the update's peak: activations sized past the optimizer states
    with e.train_mode():
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        probe = 1024
        loss = e.module(input_ids=batch(99, 1, probe)).logits.float().logsumexp(-1).mean()
        per_token = (torch.cuda.max_memory_allocated(device) - base) / probe
        del loss
        e.optimizer_zero_grad()
    # one sequence whose activations are 1.3x the optimizer states (rounded up to 256 tokens)
    rows, seq = 1, max(256, -(-int(1.3 * obytes / per_token) // 256) * 256)
    out.update(update_rows=rows, update_seq=seq, activation_bytes_per_token=per_token)
    torch.cuda.empty_cache()
    base_used = torch.cuda.mem_get_info(device)[1] - torch.cuda.mem_get_info(device)[0]
    torch.cuda.reset_peak_memory_stats(device)
    with _PeakSampler(device) as peak, e.train_mode():
        step(batch(200, rows, seq))
    out["update_peak_bytes"] = peak.peak - base_used
    out["update_allocator_peak"] = torch.cuda.max_memory_allocated(device)
    print(f"{name}: update peak {out['update_peak_bytes'] / 2**30:.1f} GiB ({rows}x{seq} tokens)", flush=True)
    on()
    params, states = _state_tensors(e)
    out["hash_params"], out["hash_optimizer"] = _digest(params), _digest(states)
    out["hashes"] = {**stages, "update": _digest(params + states)}
    dist.destroy_process_group()
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def summarize(by: dict[str, dict[str, Any]], parts: list[str], link: dict[str, float]) -> dict[str, Any]:
    """The summary of the parts that finished (``by`` part name; each is marked ``equals_reference``):
    rlmem's steady rates against the pinned ``link``, rlmem against verl side by side, ``step`` against
    rlmem, and whether every part asked for ran and equals the reference at every stage."""
    ref = by.get("none")
    for r in by.values():
        r["equals_reference"] = None if ref is None else r["hashes"] == ref["hashes"]
    ours, theirs, step = by.get("rlmem"), by.get("verl"), by.get("rlmem-step")
    summary: dict[str, Any] = {}
    if ours:
        summary["offload_vs_pinned"] = ours["offload_gbps"] / link["d2h_gbps"]
        summary["reload_vs_pinned"] = ours["reload_gbps"] / link["h2d_gbps"]
    if ours and theirs:
        summary["steady_vs_verl"] = _ratio(
            theirs["offload_s"] + theirs["reload_s"], ours["offload_s"] + ours["reload_s"]
        )
        summary["first_cycle_speedup_vs_verl"] = _ratio(
            theirs["first_offload_s"] + theirs["first_reload_s"],
            ours["first_offload_s"] + ours["first_reload_s"],
        )
        summary["host_bytes_vs_verl"] = _ratio(ours["host_bytes"], theirs["host_bytes"])
        summary["fragmentation_vs_verl"] = _ratio(ours["frag_after_step"], theirs["frag_after_step"])
    if ours and step:
        summary["update_peak_drop_vs_optimizer"] = (
            ours["update_peak_bytes"] - step["update_peak_bytes"]
        ) / ours["optimizer_bytes"]
    summary["bit_identical"] = float(
        ref is not None and len(by) == len(parts) and all(r["equals_reference"] for r in by.values())
    )
    return {k: v for k, v in summary.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    run = Run(NAME, __doc__.splitlines()[0], TARGETS)
    run.parser.add_argument("--preset", default="qwen2-3b", help="the model (rlmem.models.presets)")
    run.parser.add_argument("--cycles", type=int, default=5, help="steady offload/reload cycles")
    run.parser.add_argument("--frag-cycles", type=int, default=20, help="train-mode cycles with a rollout")
    run.parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(PARTS)
    )
    run.parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    run.parser.add_argument("--port", type=int, default=29511, help=argparse.SUPPRESS)
    args = run.parse(argv)
    if args.part is not None:
        print(json.dumps(_part(args.part, args.preset, args.cycles, args.frag_cycles, args.port)), flush=True)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if not parts or any(p not in PARTS for p in parts):
        run.parser.error(f"--parts: of {', '.join(PARTS)}, got {args.parts!r}")
    if run.device.type != "cuda":
        run.parser.error("rlmem bench verl measures on a GPU (verl's engines offload to the host from one)")
    link = pinned_link(run.device)
    print(f"pinned link: D2H {link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} GB/s", flush=True)
    torch.cuda.empty_cache()
    common = ["--preset", args.preset, "--cycles", str(args.cycles), "--frag-cycles", str(args.frag_cycles)]
    rows: list[dict[str, Any]] = []
    for i, p in enumerate(parts):
        got = spawn_part(__name__, p, [*common, "--port", str(args.port + i)], env=PARTS[p], timeout_s=900)
        got.setdefault("part", p)
        rows.append(got)
        if "error" in got:
            print(f"{p}: {got['error'][-2000:]}", flush=True)
    cols = [
        ("part", "part", ""),
        ("first_offload_s", "first off s", ".2f"),
        ("first_reload_s", "first on s", ".2f"),
        ("offload_s", "off s", ".3f"),
        ("reload_s", "on s", ".3f"),
        ("offload_gbps", "off GB/s", ".1f"),
        ("reload_gbps", "on GB/s", ".1f"),
    ]
    cols += [("host_bytes", "host B", ".3g"), ("frag_after_step", "frag B", ".3g")]
    cols += [("update_peak_bytes", "update peak B", ".3g"), ("equals_reference", "= none", "")]
    by = {r["part"]: r for r in rows if "error" not in r}
    summary = summarize(by, parts, link)
    print(format_table(list(by.values()), cols))
    run.finish(
        summary,
        config={
            "preset": args.preset,
            "cycles": args.cycles,
            "frag_cycles": args.frag_cycles,
            "parts": parts,
        },
        pinned_link=link,
        results=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
