"""Region on CUDA: device memory really freed, OOM on resume, CUDA graphs, stream ordering, device index."""

from __future__ import annotations

import pytest
import torch
from _helpers import fill_random, run_fresh, same_bytes

import rlmem
from rlmem import Region

pytestmark = pytest.mark.cuda


def _free() -> int:
    return torch.cuda.mem_get_info()[0]


def test_device_free_memory_rises_on_pause_and_falls_on_resume():
    torch.cuda.synchronize()
    r = Region(1 << 30, "cuda", name="big")
    x = r.empty(1 << 30, torch.uint8)
    fill_random(x[: 1 << 20], 0)
    torch.cuda.synchronize()
    resident = _free()
    for keep in (True, False):
        r.pause(keep=keep)
        paused = _free()
        assert paused - resident >= 0.99 * r.nbytes, (keep, paused - resident)
        r.resume()
        assert paused - _free() >= 0.99 * r.nbytes
    r.close()


def test_region_tensors_are_device_tensors_at_the_reserved_address():
    r = Region(8 << 20, "cuda")
    t = r.empty((4, 4), torch.float32)
    assert t.is_cuda and t.device.index == torch.cuda.current_device()
    assert t.data_ptr() == r.data_ptr
    torch.nn.init.ones_(t)
    assert float((t @ t).sum()) == 64.0


def test_pause_orders_after_work_queued_on_the_current_stream():
    r = Region(64 << 20, "cuda")
    x = r.empty(16 << 20, torch.float32)
    x.fill_(1.0)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the next kernel
    x.add_(1.0)
    r.pause()  # must copy the result of add_, not what was there when pause was called
    r.resume()
    assert float(x.min()) == 2.0 and float(x.max()) == 2.0


def test_nonblocking_resume_overlaps_and_wait_orders_the_stream():
    r = Region(256 << 20, "cuda")
    x = r.empty(64 << 20, torch.float32)
    x.copy_(torch.arange(64 << 20, device="cuda", dtype=torch.float32))
    expected = float(x.sum())
    r.pause()
    h = r.resume(blocking=False)
    other = torch.ones(1 << 20, device="cuda") * 3  # independent work, queued while the copy runs
    h.wait()
    assert float(x.sum()) == expected
    assert float(other.sum()) == 3 * (1 << 20)


def test_cuda_graph_captured_before_pause_replays_after_resume():
    r = Region(8 << 20, "cuda")
    x = r.empty(1 << 16, torch.float32)
    y = r.empty(1 << 16, torch.float32)
    x.copy_(torch.randn(1 << 16, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y.copy_(x * 2 + 1)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.copy_(x * 2 + 1)
    ref_x = x.clone()
    r.pause()
    r.resume()
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, ref_x)
    assert torch.equal(y, ref_x * 2 + 1)
    x.fill_(5.0)  # the graph reads the same addresses
    g.replay()
    assert float(y.min()) == 11.0 and float(y.max()) == 11.0
    del g


def test_resume_oom_leaves_region_paused_and_backup_intact():
    out = run_fresh(
        """
        import json, torch, rlmem
        r = rlmem.Region(1 << 30, "cuda", chunk_bytes=256 << 20, name="kv")
        x = r.empty(1 << 30, torch.uint8)
        g = torch.Generator(device="cuda").manual_seed(0)
        x.copy_(torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda", generator=g))
        ref = x.cpu()
        r.pause()
        backup = r.backup_bytes
        torch.cuda.empty_cache()  # else resume() would rightly reclaim torch's cached blocks and succeed
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty(free - (600 << 20), dtype=torch.uint8, device="cuda")  # leaves room for 2 chunks
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        err = None
        try:
            r.resume()
        except rlmem.OutOfMemoryError as e:
            err = e
        after = torch.cuda.mem_get_info()[0]
        res = {"raised": err is not None, "is_torch_oom": isinstance(err, torch.OutOfMemoryError),
               "msg": str(err), "needed": getattr(err, "needed", None), "paused": r.paused,
               "resident": r.resident_bytes, "backup_same": r.backup_bytes == backup,
               "free_delta": after - before}
        del filler
        torch.cuda.empty_cache()
        r.resume()
        res["intact"] = bool(torch.equal(x.cpu(), ref))
        res["paused_after"] = r.paused
        print(json.dumps(res))
        """
    )
    assert out["raised"] and out["is_torch_oom"]
    assert "needs 1.000 GiB" in out["msg"] and "stays paused" in out["msg"]
    assert out["needed"] == 1 << 30
    assert out["paused"] and out["resident"] == 0 and out["backup_same"]
    assert abs(out["free_delta"]) <= 2 << 20  # the two chunks mapped before the failure were undone
    assert out["intact"] and not out["paused_after"]


def test_resume_reclaims_pytorch_cached_blocks():
    out = run_fresh(
        """
        import json, torch, rlmem
        r = rlmem.Region(1 << 30, "cuda", name="w")
        x = r.empty(1 << 30, torch.uint8)
        x.fill_(7)
        r.pause()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty(free - (1200 << 20), dtype=torch.uint8, device="cuda")
        cached = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del cached  # 1 GiB now sits in PyTorch's cache: free memory alone (~176 MiB) is too little
        reserved = torch.cuda.memory_reserved()
        r.resume()
        drop = reserved - torch.cuda.memory_reserved()
        del filler
        print(json.dumps({"ok": int(x.min()) == 7 == int(x.max()), "reserved_drop": drop}))
        """
    )
    assert out["ok"] and out["reserved_drop"] >= 1 << 30


def test_new_region_larger_than_the_device_raises_oom():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()  # the failed map empties PyTorch's cache, which would raise free memory
    free = _free()
    with pytest.raises(rlmem.OutOfMemoryError, match="Region\\(\\) of region"):
        Region(total + (1 << 30), "cuda")
    assert _free() >= free - (2 << 20)  # every chunk mapped before the failure was released


@pytest.mark.gpus(2)
def test_region_on_another_device_index():
    torch.cuda.set_device(0)
    r = Region(64 << 20, "cuda:1")
    x = r.empty(1 << 20, torch.float32)
    assert x.device == torch.device("cuda", 1)
    fill_random(x, 2)
    ref = x.clone()
    free1 = torch.cuda.mem_get_info(1)[0]
    r.pause()
    assert torch.cuda.mem_get_info(1)[0] - free1 >= 0.99 * r.nbytes
    r.resume(blocking=False).wait(torch.cuda.current_stream(1))
    assert same_bytes(x, ref)
    assert torch.cuda.current_device() == 0


def test_first_region_in_a_process_costs_little_beyond_itself():
    out = run_fresh(
        """
        import json, torch, rlmem
        def used():
            torch.cuda.synchronize(); torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            return total - free
        torch.zeros(1, device="cuda")
        base = used()
        r = rlmem.Region(64 << 20, "cuda")
        r.empty(1 << 20, torch.uint8).fill_(1)
        r.pause(); r.resume()
        print(json.dumps({"extra": used() - base - r.nbytes}))
        """
    )
    assert out["extra"] <= 8 << 20, out  # copy streams and page tables, not PyTorch's 70 MiB stream pool
