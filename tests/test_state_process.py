"""TrainState observed from fresh processes: memory during rollout, 200-cycle soak, and DDP / FSDP2 on
several ranks."""

from __future__ import annotations

import json
import os
import sys

import pytest
from _helpers import ROOT, gpu_worlds, run_fresh, run_ranks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_SOAK = """
import json, resource, sys, torch, rlmem
sys.path.insert(0, "TESTS")
from _models import make
dev = DEVICE
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
def free():
    return torch.cuda.mem_get_info()[0] if dev == "cuda" else 0
model = make(0, dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
st = rlmem.TrainState(model, opt)
x = torch.randint(0, 61, (4, 9)).to(dev)
def cycle(k):
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    st.offload(blocking=k % 2 == 0)
    st.reload(blocking=k % 2 == 1)
for k in range(20):
    cycle(k)
st.synchronize()
start = (rss(), free(), rlmem.host_memory_held())
for k in range(200):
    cycle(k)
st.synchronize()
end = (rss(), free(), rlmem.host_memory_held())
print(json.dumps({"rss_growth": end[0] - start[0], "free_change": end[1] - start[1],
                  "held": [start[2], end[2]], "regions": len(st.regions())}))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_200_offload_cycles_grow_nothing(device):
    out = run_fresh(_SOAK.replace("DEVICE", repr(device)).replace("TESTS", str(ROOT / "tests")))
    assert out["held"][0] == out["held"][1]
    assert out["rss_growth"] < 16 << 20, out
    assert out["free_change"] == 0, out
    assert out["regions"] == 3  # params, grads, optimizer: no region piles up


@pytest.mark.cuda
def test_rollout_device_memory_is_baseline_plus_one_percent():
    out = run_fresh(
        """
        import json, sys, torch, rlmem
        def used():
            torch.cuda.synchronize(); torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            return total - free
        def build_and_step():
            model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, device="cuda") for _ in range(8)])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            model(x).sum().backward(); opt.step(); opt.zero_grad(set_to_none=False)
            return model, opt
        x = torch.randn(16, 2048, device="cuda")
        # The baseline is everything but the state: the same step once on a throwaway model loads the
        # kernels (lazily loaded code lives in device memory) and makes the cuBLAS workspace.
        build_and_step()
        base = used()
        model, opt = build_and_step()
        st = rlmem.TrainState(model, opt)
        state = sum(r.used_bytes for r in st.regions())
        before = used()
        st.offload(params="offload", grads="offload", optimizer="offload", blocking=True)
        during = used()
        torch_held = torch.cuda.memory_allocated()
        st.reload(blocking=True)
        after = used()
        print(json.dumps({"base": base, "state": state, "before": before, "during": during, "after": after,
                          "torch_allocated_during": torch_held}))
        """
    )
    assert out["before"] - out["base"] >= out["state"]  # the state was resident
    assert out["during"] <= out["base"] + 0.01 * out["state"], out
    assert out["after"] - out["base"] >= out["state"]


def _dist(kind: str, backend: str, device: str, tmp_path, world: int = 2) -> dict:
    out = tmp_path / f"{kind}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = run_ranks(ROOT / "tests" / "_dist.py", kind, backend, device, str(out), str(world), env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_ranks_on_gloo_match_without_offload(kind, tmp_path):
    res = _dist(kind, "gloo", "cpu", tmp_path)
    for grads in ("discard", "offload"):
        assert res[grads]["got"] == res[grads]["ref"], grads  # after reading the offloaded state, too
        assert res[grads]["touched"] == [True] * 5, grads  # read while offloaded: what it was before
    # adopted after a step (FSDP2 lazily initialised: its parameters' own local tensors re-pointed too)
    assert res["adopted later"]["got"] == res["adopted later"]["ref"]
    assert res["adopted later"]["touched"] == [True] * 4
    if kind == "fsdp":  # FSDP's sharded storage cannot be a placeholder
        assert "DTensors" in res["discard_refused"]
    else:
        assert res["discard_refused"] == ""


@pytest.mark.parametrize("world", gpu_worlds(2, 4))
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_gpus_on_nccl_match_without_offload(kind, tmp_path, world):
    res = _dist(kind, "nccl", "cuda", tmp_path, world=world)
    for grads in ("discard", "offload"):
        assert res[grads]["got"] == res[grads]["ref"], grads
        assert res[grads]["touched"] == [True] * 5, grads


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_one_gpu_on_nccl_matches_without_offload(kind, tmp_path):
    """FSDP2's sharded storage and DDP's hooks on a GPU: the re-pointing machinery of the two-GPU test, on the
    one GPU every lent machine has."""
    res = _dist(kind, "nccl", "cuda", tmp_path, world=1)
    for grads in ("discard", "offload", "adopted later"):
        assert res[grads]["got"] == res[grads]["ref"], grads
        assert res[grads]["touched"] == [True] * (4 if grads == "adopted later" else 5), grads


def _fsdp1(tmp_path, device: str, world: int) -> list[dict]:
    out = tmp_path / "fsdp1.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = run_ranks(ROOT / "tests" / "_dist_fsdp1.py", str(out), device, str(world), timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    ("device", "world"),
    [
        ("cpu", 2),
        *(pytest.param("cuda", *p.values, marks=[pytest.mark.cuda, *p.marks]) for p in gpu_worlds(2)),
    ],
)
def test_fsdp1_flat_parameters_match_without_offload(tmp_path, device, world):
    """FSDP1's FlatParameters (use_orig_params off and on, adopted before FSDP's lazy init and after a step),
    gradients and AdamW states, offloaded and reloaded after every step: bit-equal to training without, in
    Regions through FSDP's own rebinding, released by a blocking offload; unadoptable layouts refused."""
    for rank in _fsdp1(tmp_path, device, world):
        cases = {k: v for k, v in rank.items() if k.startswith("orig=")}
        assert len(cases) == 11
        for name, case in cases.items():
            assert case["equal"], name
            # one per step from adoption on, plus the two blocking offloads and, for offloaded
            # gradients, the reads while away and the gradients in Regions after each reload
            steps = 4 - int(name.split("adopt_at=")[1][0])
            blocking = 2 if steps == 4 else 1
            want = steps + blocking + (2 * steps if "grads=offload" in name else 0)
            assert case["checks"] == [True] * want, name
        assert "FlatParameters" in rank["discard_refused"]
        for key, named in (
            ("cpu_offload", "CPU offload"),
            ("no_shard", "sharding_strategy=NO_SHARD"),
        ):
            assert named in rank[key] and rank[key].endswith("untouched=True"), key
