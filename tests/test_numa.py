"""NUMA placement of pinned buffers: the GPU's node from sysfs, and nothing at all on a one-node host."""

from __future__ import annotations

import mmap

from rlmem.memory import _numa


def _sysfs(tmp_path, nodes: int, gpu_node: str | None):
    d = tmp_path / "devices" / "system" / "node"
    d.mkdir(parents=True)
    for i in range(nodes):
        (d / f"node{i}").mkdir()
    (d / "online").write_text("0")  # not a node directory
    if gpu_node is not None:
        dev = tmp_path / "bus" / "pci" / "devices" / "0000:1b:00.0"
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(gpu_node + "\n")
    return tmp_path


def test_node_count_and_gpu_node_from_sysfs(tmp_path, monkeypatch):
    assert _numa.node_count(tmp_path / "nothing") == 1
    two = _sysfs(tmp_path / "two", 2, "1")
    assert _numa.node_count(two) == 2
    assert _numa._read_node(two / "bus" / "pci" / "devices" / "0000:1b:00.0" / "numa_node") == 1
    unknown = _sysfs(tmp_path / "unknown", 2, "-1")
    assert _numa._read_node(unknown / "bus" / "pci" / "devices" / "0000:1b:00.0" / "numa_node") is None
    one = _sysfs(tmp_path / "one", 1, "0")
    assert _numa.gpu_node(0, one) is None  # one node: nothing to choose, whatever the GPU


def test_place_is_a_no_op_without_a_node():
    import ctypes

    buf = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert _numa.place(addr, 1 << 20, None) is False
    if _numa.node_count() == 1:  # this host: nothing to choose, no GPU's node to look up
        assert _numa.gpu_node(0) is None


def test_cpus_per_node_from_sysfs(tmp_path):
    two = _sysfs(tmp_path / "two", 2, "1")
    (two / "devices" / "system" / "node" / "node0" / "cpulist").write_text("0-3,8-9\n")
    (two / "devices" / "system" / "node" / "node1" / "cpulist").write_text("4-7,10\n")
    assert _numa.node_cpus(two) == {0: [0, 1, 2, 3, 8, 9], 1: [4, 5, 6, 7, 10]}
    assert _numa.node_cpus(tmp_path / "nothing") == {}


def test_pages_by_node_reads_the_mapping_that_starts_there(tmp_path):
    maps = tmp_path / "numa_maps"
    maps.write_text(
        "7f0000000000 default anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4\n"
        "7f0000200000 prefer:1 anon=512 dirty=512 N1=512 kernelpagesize_kB=4\n"
    )
    assert _numa.pages_by_node(0x7F0000200000, maps) == {1: 512}
    assert _numa.pages_by_node(0x7F0000000000, maps) == {0: 2, 1: 1}
    assert _numa.pages_by_node(0x1000, maps) == {}
    assert _numa.pages_by_node(0x1000, tmp_path / "none") == {}
    # this process's own mapping, touched here: on the node(s) this host has
    buf = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"x" * (1 << 20))
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    got = _numa.pages_by_node(addr)
    from pathlib import Path

    if Path("/proc/self/numa_maps").exists() and got:
        assert sum(got.values()) >= 256 and set(got) <= set(range(max(_numa.node_count(), 1)))
