"""Two processes, one device, one ledger: handoffs through the broker with fenced releases and admitted
acquires, the ledger never over its capacity, the trainer's state bit-identical and the rollout process
reading each sync's weights; an acquire that waits and then fails naming the peer with nothing lost; a
release whose memory another process still maps; a release of memory partly touched, at once, and one held
out of the ledger's sight, named as such; a release with nothing let go, at once whatever other processes
take meanwhile; a peer of another user refused; either side killed
mid-switch while the other keeps its data and goes on. Every wait is bounded; children are killed at the
end whatever happens."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

from rlmem import OutOfMemoryError
from rlmem.colocate import (
    Broker,
    FenceError,
    Member,
    PeerLostError,
    SharedWeights,
    wire,
)
from rlmem.colocate.status import format_ledger
from rlmem.memory.region import Region
from rlmem.rollout import PeerEngine, serve_engine

MiB = 1 << 20
ROLES = [sys.executable, "-m", "rlmem.benchmarks.colocate_roles"]


@pytest.fixture
def broker_path(tmp_path):
    return str(tmp_path / "run" / "broker.sock")


class Children:
    """Processes started by a test: each killed at the end, whatever happened."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture
def children():
    c = Children()
    yield c
    c.close()


def _line(proc: subprocess.Popen, timeout: float = 120) -> dict:
    """The next JSON line the child prints (bounded: the child is killed if none comes)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box or not box[0]:
        proc.kill()
        raise AssertionError(f"no line from pid {proc.pid}: {proc.stderr.read()[-3000:]}")
    return json.loads(box[0])


def _wait_until(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_handoffs_between_two_processes(device, broker_path, children):
    state, kv = 48 * MiB, 48 * MiB
    capacity = 80 * MiB  # the two together do not fit: every handoff must hand the device over
    broker = Broker(broker_path, capacity=capacity).start()
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:  # the ledger, as often as it changes
        while not stop.is_set():
            led = broker.ledger()
            samples.append(sum(sum(m["holdings"].values()) for m in led["members"]))
            time.sleep(0.0005)

    threading.Thread(target=sample, daemon=True).start()
    common = ["--path", broker_path, "--device", device, "--timeout", "60"]
    ro = children.start([*ROLES, "rollout", *common, "--kv-bytes", str(kv)])
    tr = children.start(
        [*ROLES, "train", *common, "--state-bytes", str(state), "--handoffs", "8", "--level2-every", "2"]
    )
    try:
        out = _line(tr, 180)
        assert _line(ro, 60)["served"] >= 4 * 4
    finally:
        stop.set()
        broker.close()
    assert tr.wait(30) == 0 and ro.wait(30) == 0
    assert out["intact"] and out["weights_seen"]  # every byte of the state; every sync seen there
    assert len(out["handoffs"]) == 4 and [h["level"] for h in out["handoffs"]] == [1, 2, 1, 2]
    for h in out["handoffs"]:
        for f in (h["fence"], h["peer_fence"]):  # a release counted once its memory was back
            assert f["released_bytes"] >= min(state, kv) - 2 * MiB
            assert f["free_rise_bytes"] >= f["released_bytes"] - f["released_bytes"] // 64 - 4 * MiB
    assert samples and max(samples) <= capacity and max(samples) >= min(state, kv)


TRAINER = textwrap.dedent(
    """
    import sys, torch
    from rlmem import Region
    from rlmem.colocate import Member
    m = Member("train", path=sys.argv[1], device="cpu", timeout=60)
    r = Region(64 << 20, "cpu", shareable=True, name="train_state")
    t = r.empty(r.nbytes // 4, torch.float32)
    t.fill_(3.0)
    m.track("optimizer", r)
    m.acquire()
    def release(fds):
        return m.release(lambda: r.pause(keep=True)).as_dict()
    def yield_grant(fds):
        return m.release().as_dict()  # the device given up, the memory kept
    print("ready", flush=True)
    m.serve({"release": release, "yield_grant": yield_grant}, idle_timeout=120)
    """
)


def test_an_acquire_waits_then_names_the_peer_and_loses_nothing(broker_path, children):
    broker = Broker(broker_path, capacity=100 * MiB).start()
    tr = children.start([sys.executable, "-c", TRAINER, broker_path])
    try:
        assert tr.stdout.readline().strip() == "ready"
        me = Member("rollout", path=broker_path, device="cpu", timeout=30)
        kv = Region(64 * MiB, "cpu", shareable=True, name="kv_cache")
        cache = kv.empty(kv.nbytes // 4, torch.float32)
        cache.fill_(5.0)
        kv.pause(keep=True)  # what this process had: paused, backed up
        me.track("kv_cache", kv)

        # The trainer holds the device and does not release it: a bounded wait, then rlmem's OOM naming it.
        t0 = time.monotonic()
        with pytest.raises(OutOfMemoryError, match=rf"pid {tr.pid} \(train\) holding optimizer 0\.06 GiB"):
            me.acquire(timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 10
        assert kv.paused and kv.backup_bytes == kv.nbytes
        text = subprocess.run(
            [sys.executable, "-m", "rlmem", "colocate", "status", "--path", broker_path],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "train" in text and "rollout" in text and "optimizer" in text and "kv_cache" in text
        assert format_ledger(me.status()).count("\n") >= 3

        # The trainer gives the grant up but keeps its memory: granted, but the ledger would go over its
        # capacity; after the bounded wait for a release in flight, the same error; again nothing lost.
        me.call("train", "yield_grant")
        with pytest.raises(OutOfMemoryError, match=rf"capacity is 0\.10 GiB; pid {tr.pid} \(train\)"):
            me.acquire(timeout=0.3)
        assert kv.paused and me.status()["holder"] is None

        # The trainer releases while this one waits: the acquire is admitted and the retry keeps the data.
        threading.Timer(0.3, lambda: me.call("train", "release")).start()
        grant = me.acquire(timeout=20)
        assert grant.waited_s >= 0.2
        kv.resume()
        assert float(cache.sum()) == 5.0 * cache.numel()
        me.call("train", "stop")
        me.close()
    finally:
        broker.close()
    assert tr.wait(30) == 0


ATTACHER = textwrap.dedent(
    """
    import sys
    from rlmem.colocate import Member, attach_weights
    m = Member("rollout", path=sys.argv[1], device="cpu", timeout=60)
    held = {}
    def attach(fds, spec):
        held["w"] = w = attach_weights(spec, fds)
        m.track("weights", w.region)
        return len(w.tensors)
    def unmap(fds):
        held["w"].pause()
    m.serve({"attach": attach, "unmap": unmap}, idle_timeout=120)
    """
)


def test_a_release_counts_only_once_the_memory_is_back(broker_path, children):
    broker = Broker(broker_path).start()
    ro = children.start([sys.executable, "-c", ATTACHER, broker_path])
    try:
        me = Member("train", path=broker_path, device="cpu", timeout=30)
        me.wait_for("rollout", timeout=60)
        shared = SharedWeights(nn.Linear(2048, 4096), torch.float32)  # 32 MiB
        me.track("weights", shared.region)
        me.acquire()
        spec, fds = shared.export()
        assert me.call("rollout", "attach", {"spec": spec}, fds=fds)[0] == 2
        for fd in fds:
            os.close(fd)
        # The peer still maps the memory: pausing frees nothing, and the fence says who holds on.
        with pytest.raises(FenceError, match=rf"pid {ro.pid} \(rollout\) .*mapping another's weights") as err:
            me.release(lambda: shared.region.pause(keep=False), timeout=0.3)
        assert "memory another process still maps" in str(err.value)
        assert me.status()["holder"] == "train"  # not counted: the device was not given up
        me.call("rollout", "unmap")
        fence = me.release(timeout=10)
        assert fence.free_rise_bytes >= fence.released_bytes - 4 * MiB > 0
        assert me.status()["holder"] is None
        me.call("rollout", "stop")
        me.close()
    finally:
        broker.close()
    assert ro.wait(30) == 0


def test_a_release_gives_back_what_was_touched_at_once(broker_path):
    # Pages of a shareable host Region never touched take no shared memory: a fence that waited for the
    # Region's whole size to come back would wait out its time-out for what cannot come.
    with Broker(broker_path):
        me = Member("train", path=broker_path, device="cpu", timeout=30)
        region = Region(64 * MiB, "cpu", chunk_bytes=16 * MiB, shareable=True, name="partly")
        t = region.empty(region.nbytes // 4, torch.float32)
        t[4 * MiB : 8 * MiB].fill_(1.5)  # one chunk of four written
        me.track("optimizer", region)
        assert region.committed_bytes == 16 * MiB < region.resident_bytes
        for why, keep, touched in (
            ("partly written, kept", True, 16 * MiB),
            ("resumed after a discard, never written", False, 0),
        ):
            me.acquire(timeout=10)
            t0 = time.monotonic()
            fence = me.release(lambda k=keep: region.pause(keep=k), timeout=20)
            assert time.monotonic() - t0 < 5, why  # not the 20 s time-out
            assert fence.released_bytes == touched, why
            region.resume()
            if keep:
                assert float(t[4 * MiB]) == 1.5 and float(t[0]) == 0.0
                region.pause(keep=False)  # discarded, then resumed and not written: nothing to wait for
                region.resume()
        assert region.committed_bytes == 0 and region.resident_bytes == region.nbytes
        me.close()


def test_a_release_held_outside_the_ledger_says_so(broker_path):
    # No other member: the memory that does not come back is held by something the ledger cannot see, here
    # a descriptor of this process's export() still open; the error must not blame another process's map.
    with Broker(broker_path):
        me = Member("train", path=broker_path, device="cpu", timeout=30)
        region = Region(32 * MiB, "cpu", shareable=True, name="exported")
        region.empty(region.nbytes // 4, torch.float32).fill_(1.0)
        me.track("optimizer", region)
        me.acquire(timeout=10)
        _, fds = region.export()
        cause = r"no other member is at the broker.*export\(\) still open"
        with pytest.raises(FenceError, match=cause) as err:
            me.release(lambda: region.pause(keep=False), timeout=0.3)
        assert "another process still maps" not in str(err.value)
        for fd in fds:
            os.close(fd)
        fence = me.release(timeout=10)  # measured from the same mark: the memory is back now
        assert fence.released_bytes == region.nbytes and fence.free_rise_bytes >= fence.released_bytes // 2
        me.close()


TAKER = textwrap.dedent(
    """
    import json, os, sys, time
    fd = os.memfd_create("another-process")
    os.write(fd, b"x" * int(sys.argv[1]))
    print(json.dumps({"taken": int(sys.argv[1])}), flush=True)
    time.sleep(600)  # kept until killed
    """
)


def test_a_release_waits_for_no_other_process(broker_path, children):
    # The host backend's free memory is the machine's shared memory, which any process may take while a
    # release runs (another run's shared weights). A release whose own memory is all back (nothing let go, as
    # the rollout server's sleep with a private KV cache; or more taken than let go, as the trainer mapping
    # its rollout copy again) must not wait for that memory: it waited out its time-out, and the server's
    # sleep failed with "rose 0.00 GiB of the 0.00 GiB let go within 60 s".
    def another_process_takes(nbytes: int) -> None:
        assert _line(children.start([sys.executable, "-c", TAKER, str(nbytes)])) == {"taken": nbytes}

    with Broker(broker_path):
        me = Member("train", path=broker_path, device="cpu", timeout=30)
        private = Region(8 * MiB, "cpu", name="kv")  # private pages: not the device's shared memory
        private.empty(private.nbytes // 4, torch.float32).fill_(1.0)
        copy = Region(8 * MiB, "cpu", shareable=True, name="rollout_weights", paused=True)
        me.track("kv_cache", private)
        me.track("rollout_weights", copy)
        me.acquire(0, timeout=10)

        def nothing_let_go() -> None:
            private.pause(keep=False)
            another_process_takes(16 * MiB)

        def more_taken_than_let_go() -> None:
            copy.resume()
            copy.empty(copy.nbytes // 4, torch.float32).fill_(2.0)
            another_process_takes(16 * MiB)

        for work in (nothing_let_go, more_taken_than_let_go):
            t0 = time.monotonic()
            fence = me.release(work, timeout=10)
            assert time.monotonic() - t0 < 5, work.__name__  # not the 10 s time-out
            assert fence.released_bytes == 0, work.__name__
            me.acquire(0, timeout=10)
        # What it does let go is still waited for (here it comes back at once).
        fence = me.release(lambda: copy.pause(keep=False), timeout=10)
        assert fence.released_bytes == copy.nbytes and fence.free_rise_bytes > 0
        me.close()
        private.close()
        copy.close()


def test_a_peer_of_another_user_is_refused(broker_path):
    # As root the socket accepts anyone: simulate another user by a broker that wants someone else.
    with (
        Broker(broker_path, uid=os.getuid() + 1),
        pytest.raises(wire.PeerRefusedError, match=rf"uid {os.getuid()}"),
    ):
        Member("train", path=broker_path, device="cpu", timeout=10)
    with Broker(broker_path):
        with pytest.raises(ValueError, match="role must be one of"):
            Member("critic", path=broker_path, device="cpu")
        a = Member("train", path=broker_path, device="cpu", timeout=10)
        with pytest.raises(RuntimeError, match=rf"role 'train' is taken by pid {os.getpid()}"):
            Member("train", path=broker_path, device="cpu", timeout=10)
        a.close()


def test_a_refused_peer_reads_why_even_after_its_hello_was_sent(broker_path):
    # The hello is already in the broker's socket when it refuses: closed with it unread, the socket would
    # reset the connection and the peer would read ECONNRESET instead of the refusal waiting for it.
    with Broker(broker_path, uid=os.getuid() + 1):
        sock = wire.connect(broker_path, timeout=10)
        try:
            wire.send(sock, {"op": "hello", "id": 1, "role": "train", "name": ""})
            time.sleep(0.5)  # the broker has refused by now
            msg, _ = wire.recv(sock, timeout=10)
        finally:
            sock.close()
    assert msg["error"] == "refused" and f"uid {os.getuid()}" in msg["message"]


def test_the_rollout_killed_mid_switch(device, broker_path, children):
    broker = Broker(broker_path).start()
    ro = children.start(
        [*ROLES, "rollout", "--path", broker_path, "--device", device, "--hang", "wake", "--timeout", "60"]
    )
    try:
        me = Member("train", path=broker_path, device=device, timeout=60)
        state = Region(32 * MiB, device, shareable=device == "cpu", name="train_state")
        x = state.empty(state.nbytes // 4, torch.float32)
        x.copy_(torch.randn(x.numel(), generator=torch.Generator().manual_seed(0)))
        want = x.cpu().clone()
        me.track("optimizer", state)
        shared = SharedWeights(nn.Linear(64, 64, device=device), torch.bfloat16)
        peer = PeerEngine(me, weights=shared, timeout=60)
        peer.wake(tags=["weights"])
        shared.sync()
        state.pause(keep=True)
        killer = threading.Thread(target=lambda: (_line(ro), ro.kill()), daemon=True)
        killer.start()  # the peer stops inside its KV cache's wake; it is killed there
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match=rf"pid {ro.pid} \(rollout\).* is gone"):
            peer.wake(tags=["kv_cache"])
        assert time.monotonic() - t0 < 60
        _wait_until(lambda: [m["role"] for m in me.status()["members"]] == ["train"])
        # The survivor goes on: it takes the device back and its state is intact, bit for bit.
        me.acquire(timeout=10)
        state.resume()
        assert torch.equal(x.cpu(), want)
        assert [p["role"] for p in me.lost_peers] == ["rollout"]
        me.close()
    finally:
        broker.close()


def test_the_trainer_killed_mid_switch(device, broker_path, children):
    broker = Broker(broker_path).start()
    tr = children.start(
        [*ROLES, "train", "--path", broker_path, "--device", device, "--hang", "offload", "--timeout", "60"]
    )
    try:
        me = Member("rollout", path=broker_path, device=device, timeout=60)
        from rlmem.benchmarks.colocate_roles import KVEngine

        engine = KVEngine(16 * MiB, torch.device(device), "")
        lost = threading.Event()
        served: list[int] = []
        me.on_peer_lost(lambda entry: lost.set())
        t = threading.Thread(
            target=lambda: served.append(
                serve_engine(
                    me, engine, methods=("generate",), track={"kv_cache": engine.kv}, until=lost.is_set
                )
            ),
            daemon=True,
        )
        t.start()
        assert _line(tr) == {"hanging": "offload"}  # mid-switch: its state offloaded, not yet released
        tr.kill()
        assert lost.wait(30)
        t.join(30)
        assert served and served[0] >= 2  # attach, wake(weights)
        # The owner is gone: touching its weights through rlmem is a clear error, not a stale read.
        with pytest.raises(PeerLostError, match=rf"pid {tr.pid} \(train\), which died"):
            _ = engine.weights.tensors
        # The memory stays mapped here while this process holds it, with what the last sync wrote.
        w = engine.weights.region.view(0, (64, 64), torch.bfloat16)
        assert float(w[0, 0]) == 1.0
        me.acquire(timeout=10)  # the grant died with the trainer
        engine.wake(tags=["kv_cache"])
        engine.cache.fill_(3.0)
        assert float(engine.cache[-1]) == 3.0
        me.close()
    finally:
        broker.close()


def _train(steps: int, manage=None) -> tuple[nn.Module, list[float]]:
    """A few Adam steps; with ``manage(model, opt) -> (pm, shared)``, each step's rollout runs in the
    rollout process on the synced weights. Returns the model and (read there, synced here) per step."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    pm, shared = manage(model, opt) if manage is not None else (None, None)
    seen = []
    for step in range(steps):
        if pm is not None:
            with pm.rollout(sync_weights=shared.sync):
                got = pm.engines[0].call("generate", step=step)["w00"]
                seen.append((got, float(model.weight[0, 0].detach().to(torch.bfloat16))))
        with pm.train() if pm is not None else contextlib.nullcontext():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return model, seen


def test_phase_manager_drives_the_rollout_process(broker_path, children):
    from rlmem import OffloadConfig, PhaseManager

    broker = Broker(broker_path).start()
    ro = children.start([*ROLES, "rollout", "--path", broker_path, "--device", "cpu", "--timeout", "60"])
    try:
        me = Member("train", path=broker_path, device="cpu", timeout=60)

        def manage(model, opt):
            pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True))
            me.track_train_state(pm.state)
            shared = SharedWeights(model, torch.bfloat16)
            pm.add_engine(PeerEngine(me, weights=shared))
            return pm, shared

        model, seen = _train(4, manage)
        # The rollout process read each step's weights (bf16, as synced) from the trainer's shared copy.
        assert len(seen) == 4 and all(a == b for a, b in seen) and len({a for a, _ in seen}) == 4
        me.call("rollout", "stop")
        me.close()
    finally:
        broker.close()
    assert ro.wait(30) == 0
    # Offloaded and handed over at every step, training is bit-identical to the plain loop.
    ref, _ = _train(4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
