"""Where activation offloading's step overhead goes, on one model of ``rlmem bench activations``: each step's
time (device events) and the host's time to issue forward and backward, for the step without rlmem, with
rlmem's hooks but nothing offloaded, with one name, with every name, and with a prefix of the budget plan.

Usage: python scripts/act_overhead.py [model] [bs x seq] [--profile]   (a CUDA device; prints a table;
``--profile``: the host's time by function over 3 steps without rlmem and 3 with its hooks, nothing offloaded)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time

import torch

from rlmem import offload_activations
from rlmem.activations.modmap import find_module_map
from rlmem.benchmarks.activations import _build, _step


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2-gqa-small"
    bs, seq = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "2x4096").split("x"))
    dev = torch.device("cuda", 0)
    model = _build(name, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (bs, seq), device=dev, generator=g)
    labels = torch.randint(0, model.config.vocab_size, (bs, 256), device=dev, generator=g)
    names = find_module_map(model).names()

    def timed(ctx_f, steps=6, warm=2):
        dev_t, host_f, host_b = [], [], []
        for i in range(warm + steps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            with ctx_f():
                loss = _step(model, ids, labels)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            b.record()
            torch.cuda.synchronize()
            if i >= warm:
                dev_t.append(a.elapsed_time(b))
                host_f.append((t1 - t0) * 1e3)
                host_b.append((t2 - t1) * 1e3)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        return med(dev_t), min(dev_t), max(dev_t), med(host_f), med(host_b)

    if "--profile" in sys.argv:
        import cProfile
        import pstats

        off = offload_activations(model, names, min_bytes=1 << 62)
        for label, f in (("without rlmem", contextlib.nullcontext), ("rlmem hooks", lambda: off)):
            timed(f, steps=1, warm=1)
            prof = cProfile.Profile()
            prof.enable()
            timed(f, steps=3, warm=0)
            prof.disable()
            print(f"--- host time by function, 3 steps {label}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        off.remove()
        return
    rows = [("none", timed(contextlib.nullcontext, steps=12), 0)]
    for label, mods, mb in [
        ("hooks, nothing offloaded", names, 1 << 62),
        ("attn_norm", ["attn_norm"], 1 << 20),
        ("qkv_linear", ["qkv_linear"], 1 << 20),
        ("all names", names, 1 << 20),
    ]:
        off = offload_activations(model, mods, min_bytes=mb)
        r = timed(lambda off=off: off)
        rows.append((label, r, off.stats().offloaded_bytes))
        off.remove()
    auto = offload_activations(model, budget="auto")
    n = 0
    while not auto.settled and n < 24:
        model.zero_grad(set_to_none=True)
        with auto:
            _step(model, ids, labels).backward()
        n += 1
    print(auto.plan)
    shape = auto._control.shapes[auto._control.expect]
    settled = shape.plan
    rows.append((f"auto settled ({n} steps)", timed(lambda: auto, steps=12), auto.stats().offloaded_bytes))
    full = shape.search._full  # the plan before the search shrank it
    for k in (1, 3, 6, 12, 24, len(full)):
        shape.plan = dataclasses.replace(auto.plan, chosen=full[:k])
        r = timed(lambda: auto, steps=12)
        rows.append((f"plan prefix {k}", r, auto.stats().offloaded_bytes))
        if k == 3 and "--trace" in sys.argv:
            import os

            from torch.profiler import ProfilerActivity, profile

            out = os.environ.get("OUT", ".")
            for label, f in (("none", contextlib.nullcontext), ("prefix3", lambda: auto)):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    timed(f, steps=1, warm=0)
                prof.export_chrome_trace(f"{out}/trace-{label}.json")
        if k == 3 and "--profile-prefix" in sys.argv:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            timed(lambda: auto, steps=3, warm=0)
            prof.disable()
            print("--- host time by function, 3 steps with plan prefix 3")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    shape.plan = settled
    rows.append(("none (again, last)", timed(contextlib.nullcontext, steps=12), 0))
    base = rows[0][1][0]
    head = ("who", "dev ms", "min", "max", "host fwd", "host bwd", "x none", "GiB off")
    print("{:32} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>8}".format(*head))
    for who, (d, lo, hi, hf, hb), nb in rows:
        print(f"{who:32} {d:8.1f} {lo:8.1f} {hi:8.1f} {hf:9.1f} {hb:9.1f} {d / base:7.3f} {nb / 2**30:8.2f}")


if __name__ == "__main__":
    main()
