"""Process-level observations, each in a fresh process: RSS released by the host backend, and soak cycles
that must not grow device memory, pinned host memory or RSS."""

from __future__ import annotations

import sys

import pytest
from _helpers import run_fresh

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_RSS = """
import resource
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
"""


def test_host_pause_returns_pages_to_the_os():
    out = run_fresh(
        _RSS
        + """
import json, torch, rlmem
n = 256 << 20
r = rlmem.Region(n, "cpu", chunk_bytes=16 << 20)
x = r.empty(n, torch.uint8)
x.fill_(7)
base = rss()
r.pause(keep=False)
discard_drop = base - rss()
r.resume()
x.fill_(9)
base = rss()
r.pause(keep=True)
keep_drop = base - rss() + r.backup_bytes  # region pages out, backup pages in
r.resume()
print(json.dumps({"n": r.nbytes, "discard_drop": discard_drop, "keep_drop": keep_drop,
                  "intact": bool((x == 9).all())}))
"""
    )
    assert out["discard_drop"] >= 0.99 * out["n"]
    assert out["keep_drop"] >= 0.99 * out["n"]
    assert out["intact"]


_SOAK = (
    _RSS
    + """
import json, torch, rlmem
dev = DEVICE
r = rlmem.Region(MIB << 20, dev, chunk_bytes=1)
x = r.empty((MIB * 3 // 4) << 20, torch.uint8)
x.copy_(torch.randint(0, 256, (x.numel(),), dtype=torch.uint8))
ref = x.clone()
def device_free():
    return torch.cuda.mem_get_info()[0] if dev == "cuda" else 0
def cycle(k):
    if k % 2:
        r.pause(keep=True); r.resume()
    else:
        r.pause(keep=True, blocking=False).wait(); r.resume(blocking=False).wait()
for k in range(50):
    cycle(k)
if dev == "cuda":
    torch.cuda.synchronize()
start = (rss(), device_free(), rlmem.host_memory_held())
for k in range(1000):
    cycle(k)
if dev == "cuda":
    torch.cuda.synchronize()
end = (rss(), device_free(), rlmem.host_memory_held())
print(json.dumps({"rss_growth": end[0] - start[0], "free_change": end[1] - start[1],
                  "held_start": start[2], "held_end": end[2], "intact": bool(torch.equal(x.cpu(), ref.cpu())),
                  "pauses": r.stats().pauses}))
"""
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_1000_cycles_grow_nothing(device):
    # A leak grows with the cycles, not with the Region's size, and the host backend's cycle costs its bytes
    # (~4.5 ms per MiB here): on the CPU 4 MiB (1,024 page-sized chunks), on a GPU 16 MiB (eight of 2 MiB).
    mib = 16 if device == "cuda" else 4
    out = run_fresh(_SOAK.replace("DEVICE", repr(device)).replace("MIB", str(mib)))
    assert out["pauses"] == 1050 and out["intact"]
    assert out["held_end"] == out["held_start"]
    assert out["rss_growth"] < 8 << 20, out
    assert out["free_change"] == 0, out


def test_host_regions_never_initialise_the_cuda_driver():
    out = run_fresh(
        """
import json, rlmem
from rlmem.memory import _cuda
r = rlmem.Region(1 << 20, "cpu")
r.pause(); r.resume(); r.close()
print(json.dumps({"initialised": _cuda._driver is not None, "contexts": len(_cuda._primary_ctx)}))
"""
    )
    assert out == {"initialised": False, "contexts": 0}
