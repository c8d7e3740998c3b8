"""Regions shared between two real processes: the memory one process exported is mapped by the other at
addresses of its own; writes are seen both ways; the memory is freed only once both have let it go; after
the owner's resume the peer maps the new memory at its same addresses and reads what the owner kept;
descriptors of another Region are refused, naming the chunk, before anything is mapped."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import run_fresh

from rlmem import Region
from rlmem.memory.sharing import SharedLayout

MiB = 1 << 20

# The peer: commands come as JSON messages (with file descriptors) over a SOCK_SEQPACKET socket; every
# reply is JSON. It exits when the socket closes.
PEER = textwrap.dedent(
    """
    import json, os, socket, sys
    import torch
    from rlmem import Region
    from rlmem.memory.sharing import SharedLayout

    sock = socket.socket(fileno=int(sys.argv[1]))
    region = view = None
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 64)
        except OSError:
            break
        if not msg:
            break
        cmd = json.loads(msg)
        op = cmd["op"]
        if op == "attach":
            region = Region.attach(SharedLayout.from_dict(cmd["layout"]), fds)
            view = region.view(cmd["offset"], cmd["numel"], torch.float32)
            out = {"sum": float(view.double().sum()), "ptr": view.data_ptr(), "gen": region.generation}
        elif op == "write":
            view[cmd["index"]] = cmd["value"]
            if view.is_cuda:
                torch.cuda.synchronize()
            out = {}
        elif op == "read":
            out = {"value": float(view[cmd["index"]])}
        elif op == "pause":
            region.pause(keep=False)
            out = {"resident": region.resident_bytes}
        elif op == "reattach":
            region.reattach(SharedLayout.from_dict(cmd["layout"]), fds)
            out = {"sum": float(view.double().sum()), "ptr": view.data_ptr(), "gen": region.generation}
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(out).encode())
    """
)


class Peer:
    """The other process, driven over a socket; every wait is bounded, and it is killed at the end."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(120)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(theirs.fileno())], pass_fds=[theirs.fileno()]
        )
        theirs.close()

    def ask(self, fds: list[int] | None = None, **cmd) -> dict:
        socket.send_fds(self.sock, [json.dumps(cmd).encode()], fds or [])
        reply = self.sock.recv(1 << 16)
        assert reply, f"the peer died (exit {self.proc.poll()})"
        return json.loads(reply)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def _free(device: str) -> int:
    """What the device has free: host shared memory counts up as it is used, so its negative."""
    return torch.cuda.mem_get_info()[0] if device == "cuda" else -_shmem()


def _export(region: Region) -> tuple[dict, list[int]]:
    layout, fds = region.export()
    assert isinstance(layout, SharedLayout) and len(fds) == len(layout.chunks)
    return layout.as_dict(), fds


def test_a_region_shared_with_another_process(device):
    size = 64 * MiB
    owner = Region(size, device, chunk_bytes=16 * MiB, shareable=True, name="shared")
    t = owner.empty(size // 4, torch.float32)
    t.copy_(torch.arange(size // 4, dtype=torch.float32) % 1000)
    want = float(t.double().sum())
    peer = Peer()
    try:
        layout, fds = _export(owner)
        got = peer.ask(fds, op="attach", layout=layout, offset=owner.span(t)[0], numel=t.numel())
        for fd in fds:
            os.close(fd)
        assert got["sum"] == want and got["gen"] == 0
        peer.ask(op="write", index=5, value=-7.0)  # the peer's write, seen here
        assert float(t[5]) == -7.0
        t[6] = 123.5  # and this process's, seen there
        if device == "cuda":
            torch.cuda.synchronize()
        assert peer.ask(op="read", index=6)["value"] == 123.5
        before = t.cpu().clone()

        # The owner lets go first: the peer still maps the memory, so nothing is freed yet.
        free0 = _free(device)
        owner.pause(keep=True)
        assert _free(device) - free0 < size // 8
        assert peer.ask(op="read", index=6)["value"] == 123.5  # still there for the peer
        # The peer lets go: now it is gone.
        assert peer.ask(op="pause")["resident"] == 0
        assert _free(device) - free0 > size * 7 // 8

        # The owner's memory is new after resume; the peer maps it at the same addresses.
        owner.resume()
        assert owner.generation == 1 and torch.equal(t.cpu(), before)
        layout, fds = _export(owner)
        again = peer.ask(fds, op="reattach", layout=layout)
        for fd in fds:
            os.close(fd)
        assert again["ptr"] == got["ptr"] and again["gen"] == 1
        assert again["sum"] == float(before.double().sum())
        peer.ask(op="write", index=7, value=9.0)
        assert float(t[7]) == 9.0
    finally:
        peer.close()
    assert peer.proc.returncode == 0
    assert float(t[7]) == 9.0  # the peer's exit changes nothing here
    owner.close()


def test_sharing_refuses_what_it_cannot_do(tmp_path):
    plain = Region(4 * MiB, "cpu")
    with pytest.raises(ValueError, match="make it with shareable=True"):
        plain.export()
    owner = Region(4 * MiB, "cpu", shareable=True)
    owner.pause()
    with pytest.raises(RuntimeError, match="is paused: resume"):
        owner.export()
    owner.resume()
    layout, fds = owner.export()
    peer = Region.attach(layout, fds)  # in this process too: the same memory at other addresses
    for fd in fds:
        os.close(fd)
    a, b = owner.view(0, 4, torch.int32), peer.view(0, 4, torch.int32)
    a.fill_(3)
    assert b.tolist() == [3, 3, 3, 3] and a.data_ptr() != b.data_ptr()
    with pytest.raises(ValueError, match="a peer pauses with keep=False"):
        peer.pause()
    with pytest.raises(ValueError, match="cannot be exported: it is attached"):
        peer.export()
    with pytest.raises(RuntimeError, match="is mapped: pause"):
        peer.reattach(layout, [])
    peer.pause(keep=False)
    with pytest.raises(RuntimeError, match="reattach"):
        peer.resume()
    with pytest.raises(RuntimeError, match="is paused"):
        peer.view(0, 4, torch.int32)
    with pytest.raises(ValueError, match="does not fit"):
        owner.view(4 * MiB - 4, 2, torch.int32)
    other = Region(8 * MiB, "cpu", shareable=True)
    lo, fo = other.export()
    with pytest.raises(ValueError, match="does not match"):
        peer.reattach(lo, fo)
    for fd in fo:
        os.close(fd)
    with pytest.raises(ValueError, match="not a SharedLayout"):
        SharedLayout.from_dict({"name": "x"})
    with pytest.raises(ValueError, match="shareable must be True or False"):
        Region(4 * MiB, "cpu", shareable=1)


# Descriptors of another Region, checked on attach and reattach. Run in a fresh process: a host file
# shorter than its chunk, if it were mapped, would kill the process with SIGBUS at the first read there.
MISMATCH = """
import json, os, torch
from rlmem import Region
MiB = 1 << 20
device = {device!r}
if device == "cuda":
    torch.cuda.init()


def memfd_maps():
    with open("/proc/self/maps") as f:
        return sum("memfd:rlmem-region" in line for line in f)


owner = Region(16 * MiB, device, chunk_bytes=4 * MiB, shareable=True, name="owner")
small = Region(8 * MiB, device, chunk_bytes=2 * MiB, shareable=True, name="small")  # 4 chunks as well
owner.empty(owner.nbytes // 4, torch.float32).fill_(2.0)
layout, fds = owner.export()
_, wrong = small.export()
mixed = fds[:3] + wrong[3:]  # only the last chunk's descriptor is another Region's
out = {{}}
{body}
print(json.dumps(out))
"""

ATTACH = """
maps = memfd_maps()
try:
    peer = Region.attach(layout, mixed)
except ValueError as e:
    out["error"] = str(e)
else:
    out["sum"] = float(peer.view(0, peer.nbytes // 4, torch.float32).double().sum())
out["maps_left"] = memfd_maps() - maps
for bad, key in ((fds[:3], "count"), (fds[:3] + [10**6], "closed")):
    try:
        Region.attach(layout, bad)
    except ValueError as e:
        out[key] = str(e)
"""

REATTACH = """
peer = Region.attach(layout, fds)
view = peer.view(0, peer.nbytes // 4, torch.float32)
peer.pause(keep=False)
maps = memfd_maps()
try:
    peer.reattach(layout, mixed)
except ValueError as e:
    out["error"] = str(e)
else:
    out["sum"] = float(view.double().sum())
out["maps_left"] = memfd_maps() - maps
out["paused"], out["resident"] = peer.paused, peer.resident_bytes
peer.reattach(layout, fds)  # the right ones: the Region was left ready for them
out["sum_after"] = float(view.double().sum())
"""


@pytest.mark.parametrize("body", [ATTACH, REATTACH], ids=["attach", "reattach"])
def test_descriptors_of_another_region_are_refused_before_mapping(device, body):
    got = run_fresh(MISMATCH.format(device=device, body=body), timeout=300)
    chunk, off = 4 * MiB, 12 * MiB
    assert "sum" not in got, "mapped descriptors of another Region"
    assert f"chunk 3 at offset {off} expects {chunk} bytes, but " in got["error"]
    if device == "cpu":
        assert f"its descriptor fds[3] holds {2 * MiB} bytes" in got["error"]
    assert got["maps_left"] == 0  # nothing of the owner's left mapped (host backend: its memfds)
    if body is ATTACH:
        assert "fds: 3 descriptors for the 4 chunks" in got["count"]
        assert "chunk 3 at offset" in got["closed"] and "fds[3] cannot be mapped" in got["closed"]
    else:
        assert got["paused"] and got["resident"] == 0
        assert got["sum_after"] == 2.0 * (16 * MiB // 4)
