"""MemoryTimeline: samples, phases, leak detection, report, plot, persistence."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlmem import MemoryLeakWarning, MemoryTimeline

MiB = 1 << 20


def _run(tl: MemoryTimeline, grow_per_step: int, steps: int = 8) -> None:
    held = {"n": 0}
    tl.track("cache", lambda: held["n"])
    for step in range(steps):
        with tl.phase("rollout", step):
            pass
        with tl.phase("train", step):
            held["n"] += grow_per_step


def test_phases_samples_and_summary():
    tl = MemoryTimeline("cpu")
    _run(tl, 0, steps=3)
    assert [p.name for p in tl.phases] == ["rollout", "train"] * 3
    assert len(tl.samples) == 12 and all(s["categories"] == {"cache": 0} for s in tl.samples)
    assert all(p.end >= p.start for p in tl.phases)
    summ = tl.summary()
    assert summ["train"].count == 3 and "rss" in summ["train"].maxima
    text = tl.report()
    assert "rollout" in text and "train" in text and "cache" in text


def test_rss_follows_a_real_allocation():
    tl = MemoryTimeline("cpu")
    before = tl.sample("idle", 0)["rss"]
    x = torch.ones(64 * MiB // 4)  # touched: resident
    after = tl.sample("idle", 0)["rss"]
    assert after - before >= 0.9 * 64 * MiB
    del x


def test_a_growing_category_is_reported_with_its_phase_and_rate():
    tl = MemoryTimeline("cpu", leak_tolerance_bytes=MiB)
    _run(tl, 4 * MiB)
    with pytest.warns(MemoryLeakWarning) as rec:
        found = tl.check_leaks()
    assert any("phase 'train': cache by 4.0 MiB per step" in str(w.message) for w in rec)
    # The cache stays grown through the next rollout, so both phases report it.
    phases = {f.phase for f in found if f.category == "cache"}
    assert phases == {"train", "rollout"}
    assert len(rec) == len(found)


def test_flat_memory_and_warmup_growth_are_not_leaks():
    tl = MemoryTimeline("cpu", leak_warmup_steps=2)
    held = {"n": 0}
    tl.track("state", lambda: held["n"])
    for step in range(8):
        with tl.phase("train", step):
            if step < 2:
                held["n"] += 100 * MiB  # lazily created state in the first steps
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tl.check_leaks() == []


def test_growth_that_levels_off_is_not_a_leak():
    tl = MemoryTimeline("cpu", leak_warmup_steps=0)
    held = {"n": 0}
    tl.track("kernels", lambda: held["n"])
    for step in range(20):
        with tl.phase("train", step):
            if step < 8:
                held["n"] += 8 * MiB  # loads for a while, then stays flat
    assert tl.leaks() == []
    for step in range(20, 30):
        with tl.phase("train", step):
            held["n"] += 8 * MiB  # grows again, steadily: now it is one
    assert [f.category for f in tl.leaks()] == ["kernels"]


def test_save_load_plot_round_trip(tmp_path):
    pytest.importorskip("matplotlib")
    tl = MemoryTimeline("cpu")
    _run(tl, MiB, steps=4)
    tl.save(tmp_path / "t.jsonl")
    back = MemoryTimeline.load(tmp_path / "t.jsonl")
    assert back.samples == tl.samples and back.phases == tl.phases
    assert back.report() == tl.report()
    png = back.plot(tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="device"):
        MemoryTimeline("tpu")
    with pytest.raises(ValueError, match="leak_tolerance_bytes"):
        MemoryTimeline("cpu", leak_tolerance_bytes=-1)
    tl = MemoryTimeline("cpu")
    tl.track("a", lambda: 0)
    with pytest.raises(ValueError, match="category"):
        tl.track("a", lambda: 0)
    with pytest.raises(ValueError, match="callable"):
        tl.track("b", 3)
    (tmp_path / "x.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="not a saved MemoryTimeline"):
        MemoryTimeline.load(tmp_path / "x.jsonl")


@pytest.mark.cuda
def test_device_counters_and_phase_peak():
    tl = MemoryTimeline("cuda")
    with tl.phase("work", 0):
        x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        del x
    s0, s1 = tl.samples
    assert s0["allocated"] == s1["allocated"] and s0["free"] > 0 and s0["total"] >= s0["free"]
    assert tl.phases[0].peak >= s0["allocated"] + 256 * MiB
