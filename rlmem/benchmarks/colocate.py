"""Two processes on one GPU: a rollout process attaching the trainer's shared memory, and weight syncs.

A trainer process (this one) and a rollout process (started here, unrelated but for a Unix socket between
them) on the same GPU:

* ``attach``: the rollout process maps an 8 GiB shareable Region the trainer exported (``Region.attach``),
  timed there, median of ``--repeat``;
* ``sync``: the 2.7B Qwen2 shape's fp32 policy made bf16 rollout weights in the other process, three ways,
  each checked by a checksum of every weight on the rollout side: rlmem's shared Region (``SharedWeights``:
  the trainer's in-place cast-copy into memory the rollout process maps, then a message), a
  ``torch.multiprocessing.reductions.reduce_tensor`` CUDA IPC handle per tensor, rebuilt there and copied
  into its own weights (as OpenRLHF does), and one reusable 512 MiB bucket whose handle is sent once and
  refilled bucket by bucket (as verl and slime do); against the HBM bound measured in the same run (one flat
  fp32 -> bf16 cast-copy of as many elements). ``extra_bytes``: the device memory each way needs beyond the
  trainer's own weights (the rollout side's weights count where they are a second copy).

* ``handoff``: ``--handoffs`` one-way handoffs through a broker run here (it makes no CUDA context) between a
  train-like and a rollout-like process (:mod:`~rlmem.benchmarks.colocate_roles`), each holding ``--frac`` of
  the device, so that they never fit together: the trainer's state backed up to host memory and brought
  back, the rollout's KV-cache-like Region discarded and re-taken, every release fenced and every acquire
  admitted. A handoff is timed from the first call of the switch to the last (the train side's reload
  included); its copy time is the same state's backed-up pause (or resume) timed alone in the same process
  just before. The ledger is sampled here every 0.5 ms: ``over_capacity`` counts samples where the two
  processes' holdings add up to more than the device. ``handoffs_intact``: every byte of the state equal to
  the pattern written at the start, and every sync's weights read by the rollout process.

Summary: ``attach_8gib_ms``, ``sync_ms``, ``sync_vs_bound``, ``sync_speedup_vs_ipc``,
``sync_speedup_vs_bucketed``, ``handoff_ms``, ``handoff_over_copy_ms``, ``handoffs_intact``,
``over_capacity``.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from ._common import format_table
from ._harness import Run

NAME = "colocate"
PARTS = ("handoff", "attach", "sync")
TARGETS = {
    "attach_8gib_ms": ("<", 10.0),
    "sync_vs_bound": (">=", 0.7),
    "sync_speedup_vs_ipc": (">=", 50.0),
    "sync_speedup_vs_bucketed": (">=", 3.0),
    "handoff_over_copy_ms": ("<", 50.0),
    "over_capacity": ("==", 0),
    "handoffs_intact": ("==", True),
}
_BUCKET = 512 << 20


def _encode(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _rebuild(text: str) -> torch.Tensor:
    """The tensor a ``reduce_tensor`` handle names, opened in this process."""
    fn, args = _decode(text)
    return fn(*args)


def _decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text))  # from the trainer process of this benchmark only


def _checksum(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum() for t in tensors.values()))


def rollout_main(fd: int) -> int:
    """The rollout process: serves the trainer's requests over socket ``fd`` until it closes."""
    from ..colocate import attach_weights
    from ..memory.region import Region
    from ..memory.sharing import SharedLayout

    sock = socket.socket(fileno=fd)
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    Region(2 << 20, dev).close()  # the driver and the context up before anything is timed
    own: dict[str, torch.Tensor] = {}
    shared = bucket = None
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 22, 64)
        if not msg:
            return 0
        cmd = json.loads(msg)
        op, out = cmd["op"], {}
        if op == "attach_region":
            t0 = time.perf_counter()
            r = Region.attach(SharedLayout.from_dict(cmd["layout"]), fds)
            out = {"attach_ms": (time.perf_counter() - t0) * 1e3}
            r.close()
        elif op == "weights":
            shared = attach_weights(cmd["spec"], fds)
        elif op == "own":
            own = {n: torch.empty(s, dtype=torch.bfloat16, device=dev) for n, s in cmd["shapes"]}
        elif op == "tensor":
            own[cmd["name"]].copy_(_rebuild(cmd["handle"]))
            torch.cuda.synchronize(dev)
        elif op == "bucket_handle":
            bucket = _rebuild(cmd["handle"])
        elif op == "bucket":
            assert bucket is not None
            for n, off, start, numel in cmd["items"]:
                dst = own[n].view(-1)[start : start + numel]
                dst.copy_(bucket[off : off + 2 * numel].view(torch.bfloat16))
            torch.cuda.synchronize(dev)
        elif op == "checksum":
            tensors = own if cmd["which"] == "own" else (shared.tensors if shared is not None else {})
            out = {"sum": _checksum(tensors)}
        for f in fds:
            os.close(f)
        sock.send(json.dumps(out).encode())


class _Rollout:
    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(600)
        cmd = [sys.executable, "-m", "rlmem.benchmarks.colocate", "--rollout", str(theirs.fileno())]
        self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()])
        theirs.close()

    def ask(self, op: str, fds: list[int] | None = None, **kw: Any) -> dict[str, Any]:
        socket.send_fds(self.sock, [json.dumps({"op": op, **kw}).encode()], fds or [])
        for f in fds or []:
            os.close(f)
        reply = self.sock.recv(1 << 20)
        if not reply:
            raise RuntimeError(f"the rollout process died (exit {self.proc.poll()})")
        return json.loads(reply)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()  # until the device has done it (the syncs below wait themselves)
        out.append(time.perf_counter() - t0)
    return out


def measure_attach(ro: _Rollout, gib: int, repeat: int) -> dict[str, Any]:
    from ..memory.region import Region

    times = []
    for _ in range(repeat):
        r = Region(gib << 30, "cuda", shareable=True, name="attach")
        layout, fds = r.export()
        times.append(ro.ask("attach_region", fds, layout=layout.as_dict())["attach_ms"])
        r.close()
    return {
        "gib": gib,
        "chunks": len(layout.chunks),
        "attach_ms": times,
        "median_ms": statistics.median(times),
    }


def _bound(n: int, dev: torch.device, repeat: int) -> float:
    """The HBM bound: one flat cast-copy of ``n`` elements (4 bytes read, 2 written each), median."""
    src = torch.empty(n, dtype=torch.float32, device=dev).normal_()
    dst = torch.empty(n, dtype=torch.bfloat16, device=dev)
    out = statistics.median(_timed(lambda: dst.copy_(src), repeat))
    torch.cuda.synchronize()
    return out


def measure_sync(ro: _Rollout, model_name: str, repeat: int) -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    from ..colocate import SharedWeights
    from ..models import presets

    dev = torch.device("cuda", 0)
    model = presets.build(model_name, dev, torch.float32, seed=0)
    params = dict(model.named_parameters())
    n = sum(p.numel() for p in params.values())
    with torch.no_grad():
        want = _checksum({k: p.to(torch.bfloat16) for k, p in params.items()})

    bound = _bound(n, dev, repeat)

    shared = SharedWeights(model, torch.bfloat16, name="rollout-weights")
    spec, fds = shared.export()
    ro.ask("weights", fds, spec=spec)

    def via_shared() -> None:
        shared.sync()
        ro.ask("synced")  # what tells the rollout process: its views hold the new weights

    t_shared = _timed(via_shared, repeat)
    ok_shared = ro.ask("checksum", which="shared")["sum"] == want

    ro.ask("own", shapes=[[k, list(p.shape)] for k, p in params.items()])

    def via_ipc() -> None:
        for k, p in params.items():
            with torch.no_grad():
                cast = p.to(torch.bfloat16)
            ro.ask("tensor", name=k, handle=_encode(reduce_tensor(cast)))
            del cast

    t_ipc = _timed(via_ipc, max(2, repeat // 2))
    ok_ipc = ro.ask("checksum", which="own")["sum"] == want

    bucket = torch.empty(_BUCKET, dtype=torch.uint8, device=dev)
    ro.ask("bucket_handle", handle=_encode(reduce_tensor(bucket)))

    def via_bucket() -> None:
        items: list[list[Any]] = []
        off = 0
        for k, p in params.items():
            flat, start = p.detach().view(-1), 0
            while start < flat.numel():  # a tensor larger than what is left of the bucket goes in pieces
                if off == _BUCKET:
                    torch.cuda.synchronize()
                    ro.ask("bucket", items=items)
                    items, off = [], 0
                numel = min(flat.numel() - start, (_BUCKET - off) // 2)
                bucket[off : off + 2 * numel].view(torch.bfloat16).copy_(flat[start : start + numel])
                items.append([k, off, start, numel])
                off += 2 * numel
                start += numel
        torch.cuda.synchronize()
        ro.ask("bucket", items=items)

    with torch.no_grad():
        for p in params.values():  # fresh values: the bucket's copy is checked, not the IPC one's
            p.mul_(-1)
        want_after = _checksum({k: p.to(torch.bfloat16) for k, p in params.items()})
    t_bucket = _timed(via_bucket, repeat)
    ok_bucket = ro.ask("checksum", which="own")["sum"] == want_after
    weights_bytes = 2 * n
    big = max(2 * p.numel() for p in params.values())
    return {
        "model": model_name,
        "params": n,
        "bound_s": bound,
        "bound_tbps": 6 * n / bound / 1e12,
        "shared_s": t_shared,
        "ipc_s": t_ipc,
        "bucketed_s": t_bucket,
        "intact": {"shared": ok_shared, "ipc": ok_ipc, "bucketed": ok_bucket},
        "extra_bytes": {  # beyond the trainer's own fp32 weights, on the device
            "shared": weights_bytes,  # the rollout weights themselves: one copy, mapped by both processes
            "ipc": weights_bytes + big,  # the rollout's own weights, and the cast tensor in flight
            "bucketed": weights_bytes + _BUCKET,
        },
        "tensors": len(params),
    }


def measure_handoff(handoffs: int, frac: float, timeout: float) -> dict[str, Any]:
    """Two processes handing the device over ``handoffs`` times through a broker in this process."""
    import tempfile
    import threading

    from ..colocate import Broker

    path = os.path.join(tempfile.mkdtemp(prefix="rlmem-bench-"), "run", "broker.sock")
    broker = Broker(path).start()
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            led = broker.ledger()
            held = sum(sum(m["holdings"].values()) for m in led["members"])
            samples.append((held, led["device"].get("total", 0)))
            time.sleep(0.0005)

    threading.Thread(target=sample, daemon=True).start()
    roles = [sys.executable, "-m", "rlmem.benchmarks.colocate_roles"]
    common = ["--path", path, "--device", "cuda", "--frac", str(frac), "--timeout", str(timeout)]
    ro = subprocess.Popen([*roles, "rollout", *common], stdout=subprocess.PIPE, text=True)
    try:
        tr = subprocess.run(
            [*roles, "train", *common, "--handoffs", str(handoffs)],
            capture_output=True,
            text=True,
            timeout=timeout * 4,
        )
    finally:
        stop.set()
        try:
            ro.wait(timeout=60)
        except subprocess.TimeoutExpired:
            ro.kill()
        broker.close()
    sys.stderr.write(tr.stderr[-4000:])
    lines = [x for x in tr.stdout.splitlines() if x.startswith("{")]
    if tr.returncode != 0 or not lines:
        return {"error": f"exit {tr.returncode}: {tr.stderr[-3000:]}"}
    out = json.loads(lines[-1])
    total = max((t for _, t in samples), default=0)
    out["ledger_samples"] = len(samples)
    out["ledger_peak_bytes"] = max((h for h, _ in samples), default=0)
    out["device_total_bytes"] = total
    out["over_capacity"] = sum(1 for h, t in samples if t and h > t)
    out["rollout_exit"] = ro.returncode
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    h = res.get("handoff")
    if h and "handoffs" in h:
        times, over = [], []
        for r in h["handoffs"]:
            times += [r["to_rollout_s"], r["to_train_s"]]
            over += [r["to_rollout_s"] - h["copy_out_s"], r["to_train_s"] - h["copy_in_s"]]
        s["handoff_ms"] = statistics.median(times) * 1e3
        s["handoff_over_copy_ms"] = statistics.median(over) * 1e3
        s["handoffs"] = len(times)
        s["handoffs_intact"] = bool(h["intact"] and h["weights_seen"] and h["rollout_exit"] == 0)
        s["over_capacity"] = h["over_capacity"]
    a = res.get("attach")
    if a:
        s["attach_8gib_ms"] = a["median_ms"]
    y = res.get("sync")
    if y:
        shared = statistics.median(y["shared_s"])
        s["sync_ms"] = shared * 1e3
        s["sync_vs_bound"] = y["bound_s"] / shared
        s["sync_speedup_vs_ipc"] = statistics.median(y["ipc_s"]) / shared
        s["sync_speedup_vs_bucketed"] = statistics.median(y["bucketed_s"]) / shared
        s["sync_intact"] = all(y["intact"].values())
    return s


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rollout"]:
        return rollout_main(int(argv[1]))
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)}")
    p.add_argument("--model", default="qwen2-2.7b-mha", help="the sync part's model preset")
    p.add_argument("--attach-gib", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--handoffs", type=int, default=100, help="the handoff part's one-way handoffs")
    p.add_argument("--frac", type=float, default=0.6, help="the share of the device each side holds")
    p.add_argument("--merge", action="store_true", help="keep the other parts of an existing JSON file")
    args = run_.parse(argv)
    if not run_.needs_cuda():
        return 2
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PARTS for x in parts):
        run_.error(f"--parts must be a comma-separated subset of {', '.join(PARTS)}")
    res: dict[str, Any] = run_.previous() if args.merge else {}
    if "handoff" in parts:  # first: this process has no CUDA context yet, and holds nothing
        res["handoff"] = measure_handoff(args.handoffs, args.frac, timeout=300.0)
    if "attach" in parts or "sync" in parts:
        ro = _Rollout()
        try:
            if "attach" in parts:
                res["attach"] = measure_attach(ro, args.attach_gib, args.repeat)
            if "sync" in parts:
                res["sync"] = measure_sync(ro, args.model, args.repeat)
        finally:
            ro.close()
    summary = summarize(res)
    if "handoff_ms" in summary:
        h = res["handoff"]
        print(
            f"handoff of {h['state_bytes'] / 2**30:.1f} GiB each way: median {summary['handoff_ms']:.1f} ms, "
            f"{summary['handoff_over_copy_ms']:.1f} ms over the copy alone "
            f"(out {h['copy_out_s'] * 1e3:.1f} / in {h['copy_in_s'] * 1e3:.1f} ms); "
            f"intact {summary['handoffs_intact']}; "
            f"over capacity {summary['over_capacity']} of {h['ledger_samples']} samples"
        )
    y = res.get("sync")
    if y:
        rows = [
            {"how": h, "ms": statistics.median(y[f"{h}_s"]) * 1e3, "extra": y["extra_bytes"][h] / 2**30}
            for h in ("shared", "bucketed", "ipc")
        ]
        rows.append({"how": "HBM bound", "ms": y["bound_s"] * 1e3, "extra": None})
        print(
            format_table(
                rows, [("how", "weight sync", ""), ("ms", "ms", ".2f"), ("extra", "extra GiB", ".2f")]
            )
        )
    skip = ("json", "machine", "merge")
    run_.finish(summary, config={k: v for k, v in vars(args).items() if k not in skip}, results=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
