"""Region behaviour common to both backends: run on the host backend in CI and on CUDA where present."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from _helpers import fill_random, same_bytes

import rlmem
from rlmem import HostOutOfMemoryError, Region, RegionClosedError

SHAPES_DTYPES = [
    ((7,), torch.float32),
    ((3, 5, 11), torch.bfloat16),
    ((1023,), torch.float16),
    ((65537,), torch.int8),
    ((129, 33), torch.int64),
    ((0,), torch.float32),
    ((), torch.float64),
    ((4097,), torch.bool),
    ((31, 3), torch.complex64),
    ((300_001,), torch.uint8),
    ((1, 1, 1), torch.int32),
]


def _small_chunk_region(device: str, nbytes: int = 8 << 20) -> Region:
    # chunk_bytes=1 rounds up to the granularity: many chunks, tensors straddling chunk boundaries.
    return Region(nbytes, device, chunk_bytes=1, name="t")


def test_empty_is_aligned_and_stays_put(device):
    r = Region(4 << 20, device, name="a")
    a = r.empty(3, torch.uint8)
    b = r.empty((2, 3), torch.float32)
    c = r.empty(5, torch.float64, align=4096)
    assert a.data_ptr() == r.data_ptr
    assert b.data_ptr() % 256 == 0 and c.data_ptr() % 4096 == 0
    assert b.data_ptr() >= a.data_ptr() + 3 and c.data_ptr() >= b.data_ptr() + 24
    assert b.is_contiguous() and b.shape == (2, 3) and b.dtype == torch.float32
    assert b.device.type == torch.device(device).type
    assert r.used_bytes == c.data_ptr() - r.data_ptr + 40
    ptrs = [t.data_ptr() for t in (a, b, c)]
    for _ in range(3):
        r.pause()
        r.resume()
    assert [t.data_ptr() for t in (a, b, c)] == ptrs
    r.close()


def test_contents_bit_identical_after_100_cycles(device):
    r = _small_chunk_region(device)
    tensors = [r.empty(shape, dtype) for shape, dtype in SHAPES_DTYPES]
    for k, t in enumerate(tensors):
        fill_random(t, seed=k)
    refs = [t.clone() for t in tensors]
    ptrs = [t.data_ptr() for t in tensors]
    for _ in range(100):
        r.pause()
        assert r.paused and r.resident_bytes == 0
        r.resume()
        assert not r.paused and r.resident_bytes == r.nbytes
    assert [t.data_ptr() for t in tensors] == ptrs
    for t, ref in zip(tensors, refs, strict=True):
        assert same_bytes(t, ref)
    st = r.stats()
    assert st.pauses == 100 and st.resumes == 100 and st.last_pause_kept is True
    r.close()


def test_pause_copies_only_what_is_used(device):
    r = _small_chunk_region(device)
    gran = r.chunk_bytes
    x = r.empty(gran + 10, torch.uint8)
    fill_random(x, 1)
    ref = x.clone()
    r.pause()
    st = r.stats()
    assert st.last_pause_bytes == 2 * gran  # the two chunks x touches, not the whole region
    assert r.backup_bytes == 2 * gran
    r.resume()
    assert r.stats().last_resume_bytes == 2 * gran
    assert same_bytes(x, ref)


def test_discard_drops_contents_and_copies_nothing(device):
    r = _small_chunk_region(device)
    x = r.empty(1 << 20, torch.float32)
    x.fill_(3.0)
    held = rlmem.host_memory_held()
    r.pause(keep=False)
    assert r.paused and r.resident_bytes == 0 and r.backup_bytes == 0
    assert rlmem.host_memory_held() == held
    st = r.stats()
    assert st.last_pause_kept is False and st.last_pause_bytes == 0
    r.resume()
    assert r.stats().last_resume_bytes == 0 and r.resident_bytes == r.nbytes
    if device == "cpu":
        assert int(torch.count_nonzero(x)) == 0  # released pages come back zeroed
    x.fill_(5.0)  # the memory is usable again
    assert float(x.sum()) == 5.0 * x.numel()


def test_pause_and_resume_are_idempotent(device):
    r = Region(4 << 20, device)
    x = r.empty(100, torch.int32)
    x.copy_(torch.arange(100, dtype=torch.int32))
    r.pause()
    h = r.pause()
    assert h.done() and r.paused and r.stats().pauses == 1
    r.resume()
    h = r.resume()
    assert h.done() and not r.paused and r.stats().resumes == 1
    assert torch.equal(x.cpu(), torch.arange(100, dtype=torch.int32))


def test_nonblocking_pause_and_resume(device):
    r = _small_chunk_region(device)
    x = r.empty(1 << 20, torch.float32)
    fill_random(x, 7)
    ref = x.clone()
    h = r.pause(blocking=False)
    assert r.paused
    assert r.pause(blocking=False) is h or h.done()  # a second call joins the first
    h.wait()
    assert h.done() and r.resident_bytes == 0
    h = r.resume(blocking=False)
    h.wait()  # orders the current stream after the copies
    assert same_bytes(x, ref)
    h.synchronize()
    st = r.stats()
    assert st.last_resume_s is not None and st.last_resume_s > 0


def test_operations_queue_behind_a_pause_in_flight(device):
    r = _small_chunk_region(device)
    x = r.empty(1 << 20, torch.int64)
    x.copy_(torch.arange(1 << 20))
    r.pause(blocking=False)
    r.resume()  # waits for the pause worker first
    assert torch.equal(x.cpu(), torch.arange(1 << 20))


def test_out_of_room_names_the_sizes(device):
    r = Region(1 << 20, device, name="small")  # rounded up to the granularity (2 MiB on CUDA)
    r.empty(1000, torch.uint8)
    n = r.nbytes
    with pytest.raises(
        ValueError, match=rf"out of room.*needs {8 * n} bytes at offset 1024.*{n - 1024} of {n}"
    ):
        r.empty((n,), torch.float64)
    r.empty(1000, torch.uint8)  # still usable after the refusal


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nbytes": 0}, "nbytes must be a positive int"),
        ({"nbytes": -5}, "nbytes must be a positive int"),
        ({"nbytes": 1.5}, "nbytes must be a positive int"),
        ({"nbytes": True}, "nbytes must be a positive int"),
        ({"nbytes": 1 << 20, "chunk_bytes": 0}, "chunk_bytes must be a positive int"),
        ({"nbytes": 1 << 20, "name": 3}, "name must be a str"),
        ({"nbytes": 1 << 20, "device": "mps"}, "device must be a CUDA device or 'cpu'"),
        ({"nbytes": 1 << 20, "device": "nonsense"}, "device must be"),
        ({"nbytes": 1 << 20, "device": 1.0}, "device must be"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=match):
        Region(**kwargs)


def test_bad_call_arguments_are_named():
    r = Region(1 << 20, "cpu")
    with pytest.raises(ValueError, match="shape"):
        r.empty((-1, 2), torch.float32)
    with pytest.raises(ValueError, match="shape"):
        r.empty((2.0,), torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        r.empty(4, "float32")
    with pytest.raises(ValueError, match="align"):
        r.empty(4, torch.float32, align=3)
    with pytest.raises(ValueError, match="keep"):
        r.pause(keep="yes")
    with pytest.raises(ValueError, match="blocking"):
        r.resume(blocking=None)
    assert not r.paused


def test_cuda_request_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match=r"CUDA is not available.*device='cpu'"):
        Region(1 << 20)


def test_close_is_idempotent_and_allowed_while_paused(device):
    held = rlmem.host_memory_held()
    r = Region(4 << 20, device, name="c")
    x = r.empty(1000, torch.float32)
    x.fill_(1.0)
    r.pause()
    assert r.backup_bytes > 0
    r.close()
    r.close()
    assert r.closed and r.backup_bytes == 0 and r.resident_bytes == 0
    assert rlmem.host_memory_held() == held
    for call in (r.pause, r.resume, lambda: r.empty(1, torch.uint8)):
        with pytest.raises(RegionClosedError, match="'c' is closed"):
            call()
    assert r.stats().resident_bytes == 0


def test_context_manager_closes():
    with Region(1 << 20, "cpu") as r:
        r.empty(10, torch.uint8)
    assert r.closed


def test_backup_is_reused_across_cycles_and_can_be_freed(device):
    r = _small_chunk_region(device)
    x = r.empty(1 << 20, torch.uint8)
    fill_random(x, 3)
    r.pause()
    backup = r._backup
    ptr = backup.ptr
    r.resume()
    for _ in range(5):
        r.pause()
        r.resume()
    assert r._backup is backup and backup.ptr == ptr  # no allocation after the first kept pause
    y = r.empty(4 << 20, torch.uint8)  # more of the region in use: the backup grows once
    fill_random(y, 4)
    ref = y.clone()
    r.pause()
    assert r.backup_bytes >= r.used_bytes
    with pytest.raises(RuntimeError, match="resume\\(\\) first"):
        r.free_backup()
    r.resume()
    assert same_bytes(y, ref)
    held = rlmem.host_memory_held()
    kind = "pinned" if device == "cuda" else "pageable"
    size = r.backup_bytes
    r.free_backup()
    assert r.backup_bytes == 0
    assert rlmem.host_memory_held()[kind] == held[kind] - size
    r.pause()  # a kept pause after freeing allocates a new backup
    r.resume()
    assert same_bytes(y, ref)


def test_reserved_backup_is_used_by_the_first_pause(device):
    r = _small_chunk_region(device)
    x = r.empty(1 << 20, torch.float32)
    fill_random(x, 21)
    ref = x.clone()
    h = r.reserve_backup(blocking=False)
    r.pause()  # waits for the reservation instead of allocating a second buffer
    h.wait()
    backup = r._backup
    assert backup is not None and r.backup_bytes >= 4 << 20
    r.resume()
    assert r._backup is backup and same_bytes(x, ref)
    assert r.reserve_backup().done()  # already there: nothing to do


def test_pause_without_host_memory_releases_nothing(device, monkeypatch):
    from rlmem.memory import _pinned

    r = _small_chunk_region(device)
    x = r.empty(2 << 20, torch.float32)
    fill_random(x, 5)
    ref = x.clone()
    monkeypatch.setattr(_pinned, "available_host_bytes", lambda: 4096)
    with pytest.raises(HostOutOfMemoryError, match="nothing was released") as info:
        r.pause()
    assert info.value.needed >= 8 << 20 and info.value.available == 4096
    assert not r.paused and r.resident_bytes == r.nbytes and r.backup_bytes == 0
    assert same_bytes(x, ref)
    r.pause(keep=False)  # a discard needs no host memory
    r.resume()
    fill_random(x, 5)
    monkeypatch.undo()
    r.pause()
    r.resume()
    assert same_bytes(x, ref)


def test_failed_nonblocking_pause_leaves_a_resumable_region(device, monkeypatch):
    r = _small_chunk_region(device)
    x = r.empty(r.nbytes, torch.uint8)
    fill_random(x, 11)
    ref = x.clone()
    backend = r._backend
    real_unmap = backend.unmap
    calls = []

    def flaky_unmap(offset):
        calls.append(offset)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        real_unmap(offset)

    monkeypatch.setattr(backend, "unmap", flaky_unmap)
    h = r.pause(blocking=False)
    with pytest.raises(RuntimeError, match="injected failure"):
        h.wait()
    monkeypatch.undo()
    assert r.paused and 0 < r.resident_bytes < r.nbytes  # one chunk released, the rest still mapped
    r.resume()
    assert r.resident_bytes == r.nbytes
    assert same_bytes(x, ref)
    monkeypatch.setattr(backend, "unmap", flaky_unmap)
    calls.clear()
    with pytest.raises(RuntimeError, match="injected failure"):
        r.pause()
    monkeypatch.undo()
    r.pause()  # a second pause releases what the failed one left mapped
    assert r.paused and r.resident_bytes == 0 and r.stats().pauses == 2
    r.resume()
    assert same_bytes(x, ref)


def test_repause_that_grows_the_backup_keeps_saved_chunks(device, monkeypatch):
    r = _small_chunk_region(device)
    gran = r.chunk_bytes
    x = r.empty(2 * gran, torch.uint8)
    fill_random(x, 12)
    ref = x.clone()
    backend = r._backend
    real_unmap = backend.unmap

    def fail_second(offset):
        if offset > 0:
            raise RuntimeError("injected failure")
        real_unmap(offset)

    monkeypatch.setattr(backend, "unmap", fail_second)
    with pytest.raises(RuntimeError, match="injected failure"):
        r.pause()  # chunk 0 now lives only in the backup
    monkeypatch.undo()
    y = r.empty(2 * gran, torch.uint8)  # grows the used range: the next pause needs a larger backup
    fill_random(y, 13)
    ref_y = y.clone()
    r.pause()
    assert r.backup_bytes >= 4 * gran
    r.resume()
    assert same_bytes(x, ref) and same_bytes(y, ref_y)


def test_unobserved_worker_failure_is_reported(device, monkeypatch):
    r = _small_chunk_region(device)
    r.empty(1 << 20, torch.uint8)
    backend = r._backend
    monkeypatch.setattr(backend, "unmap", lambda offset: (_ for _ in ()).throw(RuntimeError("boom")))
    h = r.pause(blocking=False)
    while not h.done():  # let the worker hit the failure before the patch is undone
        time.sleep(0.001)
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match="nobody waited"):
        r.resume()
    assert not r.paused


def test_tensors_keep_their_memory_alive(device):
    t = Region(2 << 20, device).empty(1000, torch.float32)
    gc.collect()
    t.fill_(2.0)
    assert float(t.sum()) == 2000.0


def test_stats_snapshot(device):
    r = Region(4 << 20, device, name="s")
    x = r.empty(1 << 20, torch.uint8)
    x.fill_(1)
    r.pause()
    r.resume()
    d = r.stats().as_dict()
    assert d["name"] == "s" and d["nbytes"] == r.nbytes and d["used_bytes"] == 1 << 20
    assert d["paused"] is False and d["pauses"] == 1 and d["resumes"] == 1
    assert d["last_pause_s"] > 0 and d["last_resume_s"] > 0
    assert d["last_pause_gbps"] > 0 and d["last_resume_gbps"] > 0
    assert "resident" in repr(r) and "'s'" in repr(r)


def test_concurrent_callers_are_serialised(device):
    r = _small_chunk_region(device)
    x = r.empty(1 << 20, torch.int32)
    x.copy_(torch.arange(1 << 20, dtype=torch.int32))
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(20):
                r.pause()
                r.resume()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r.resume()
    assert not errors
    assert torch.equal(x.cpu(), torch.arange(1 << 20, dtype=torch.int32))


def test_host_view_reads_and_writes_the_kept_bytes(device):
    r = _small_chunk_region(device)
    tensors = [r.empty(s, d) for s, d in SHAPES_DTYPES]
    for i, t in enumerate(tensors):
        fill_random(t, i)
    ref = [t.cpu().clone() for t in tensors]
    r.pause()
    for t, want in zip(tensors, ref, strict=True):
        h = r.host_view(t)
        assert h.device.type == "cpu" and h.shape == t.shape and h.stride() == t.stride()
        assert same_bytes(h, want)
        m = r.host_view(t, mapped=True)  # on a GPU: the same bytes as a tensor of the device
        assert m.device == t.device and same_bytes(m.cpu(), want)
    # Views of views: a slice and a transposed view of a matrix.
    mat = tensors[4]
    assert same_bytes(r.host_view(mat[3:9, ::2]), ref[4][3:9, ::2])
    assert same_bytes(r.host_view(mat.t()), ref[4].t())
    # Each has a storage of its own: torch.save writes that tensor's bytes alone, dtypes may differ.
    assert r.host_view(tensors[0]).untyped_storage().nbytes() == tensors[0].nbytes
    r.host_view(tensors[1]).fill_(2.5)  # a write during the pause is what resume brings back
    r.resume()
    assert torch.all(tensors[1] == 2.5)
    assert all(same_bytes(t, w) for t, w in zip(tensors[2:], ref[2:], strict=True))


def test_host_view_refuses_what_it_cannot_give(device):
    r = Region(4 << 20, device, name="hv")
    t = r.empty(100, torch.float32)
    with pytest.raises(RuntimeError, match="resident: read the tensor itself"):
        r.host_view(t)
    r.pause(keep=False)
    with pytest.raises(RuntimeError, match="were not kept"):
        r.host_view(t)
    r.resume()
    r.pause()
    with pytest.raises(ValueError, match="does not lie in region 'hv'"):
        r.host_view(torch.zeros(100, device=device))
    with pytest.raises(ValueError, match=r"tensor must be a torch\.Tensor"):
        r.host_view([1, 2])
    with pytest.raises(ValueError, match="mapped must be True or False"):
        r.host_view(t, mapped=1)
    r.close()
    with pytest.raises(RegionClosedError):
        r.host_view(t)


def test_host_view_waits_for_a_pause_in_flight(device):
    r = _small_chunk_region(device, 64 << 20)
    t = r.empty(16 << 20, torch.float32)
    fill_random(t, 3)
    want = t.cpu().clone()
    r.pause(blocking=False)
    assert same_bytes(r.host_view(t), want)


def test_nonblocking_pause_orders_a_stream_after_its_copies(device):
    r = _small_chunk_region(device, 64 << 20)
    t = r.empty(16 << 20, torch.float32)
    t.copy_(torch.randn(16 << 20))
    want = t.cpu() * 3
    h = r.pause(blocking=False)
    h.wait_copied()  # no host wait: the current stream waits for the copies to the backup
    got = r.backup_view(t, mapped=True) * 3  # queued on that stream
    assert torch.equal(got.cpu(), want)
    h.wait()
    assert r.resident_bytes == 0


@pytest.mark.cuda
def test_mapped_view_outlives_the_region_safely():
    held = rlmem.host_memory_held()["pinned"]
    r = Region(8 << 20, "cuda", name="outlive")
    t = r.empty(1 << 20, torch.float32)
    t.copy_(torch.randn(1 << 20))
    want = t.cpu() * 2
    r.pause()
    m = r.host_view(t, mapped=True)
    r.close()  # frees the backup, but a device tensor still points at it: it stays registered
    assert torch.equal((m * 2).cpu(), want)  # a kernel reads it
    assert rlmem.host_memory_held()["pinned"] > held
    del m
    gc.collect()
    assert rlmem.host_memory_held()["pinned"] == held
