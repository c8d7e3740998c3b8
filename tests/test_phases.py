"""OffloadConfig and PhaseManager: one switch, engines sleep in train and wake in rollout."""

from __future__ import annotations

import pytest
import torch
from _models import make

import rlmem
from rlmem import OffloadConfig, PhaseManager


class KVEngine:
    """A rollout engine whose KV cache is a Region: released while training, taken again for rollout."""

    def __init__(self, device: str, nbytes: int = 4 << 20) -> None:
        self.kv = rlmem.Region(nbytes, device, name="kv")
        self.cache = self.kv.empty(nbytes // 4, torch.float32)
        self.calls: list[str] = []

    def sleep(self) -> None:
        self.kv.pause(keep=False)
        self.calls.append("sleep")

    def wake(self) -> None:
        self.kv.resume()
        self.calls.append("wake")

    def generate(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(x)
        self.cache[: logits.numel()].copy_(logits.reshape(-1).float())  # the cache is usable memory
        return logits.argmax(-1)


def _loop(device: str, config: OffloadConfig, steps: int = 4, prefetch: bool = False):
    model = make(0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pm = PhaseManager(model, opt, config)
    engine = KVEngine(device)
    pm.add_engine(engine)
    g = torch.Generator().manual_seed(5)
    losses, seen = [], []
    for _ in range(steps):
        x = torch.randint(0, 61, (4, 9), generator=g).to(device)
        with pm.rollout():
            y = engine.generate(model, x)  # params="keep" in these configs: rollout on the training model
            if pm.enabled:
                seen.append(pm.state.stats().categories["optimizer"])
        if prefetch:
            pm.prefetch()
        with pm.train():
            loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, pm, engine, seen, model


def test_disabled_allocates_nothing_and_changes_nothing(device):
    model = make(0, device)
    opt = torch.optim.AdamW(model.parameters())
    ptrs = [p.data_ptr() for p in model.parameters()]
    held = rlmem.host_memory_held()
    pm = PhaseManager(model, opt)
    engine = KVEngine(device)
    pm.add_engine(engine)
    with pm.rollout():
        pass
    pm.prefetch()
    with pm.train():
        pass
    assert pm.state is None and not pm.enabled
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert rlmem.host_memory_held() == held and engine.calls == []
    assert pm.stats().enabled is False


@pytest.mark.parametrize("prefetch", [False, True])
def test_enabled_loop_matches_disabled_loop(device, prefetch):
    on = OffloadConfig(offload_during_rollout=True, params="keep", grads="discard", optimizer="offload")
    ref, *_ = _loop(device, OffloadConfig())
    got, pm, engine, seen, _ = _loop(device, on, prefetch=prefetch)
    assert got == ref
    assert engine.calls[:3] == ["wake", "sleep", "wake"]
    assert all(s.resident_bytes == 0 and s.policy == "offload" for s in seen[1:])
    assert engine.kv.paused and pm.phase == "train"
    st = pm.stats()
    assert st.switches.count == 8 and st.switches.rollout_s > 0
    assert st.state.categories["optimizer"].resident_bytes > 0


def test_params_offloaded_rollout_on_the_training_model_is_refused(device):
    config = OffloadConfig(offload_during_rollout=True)  # params="offload"
    with pytest.raises(RuntimeError, match="params='keep'"):
        _loop(device, config, steps=2)


def test_config_is_validated_and_keyword_only():
    with pytest.raises(ValueError, match=r"OffloadConfig\.params must be one of"):
        OffloadConfig(params="cpu")
    with pytest.raises(ValueError, match=r"OffloadConfig\.offload_during_rollout must be True or False"):
        OffloadConfig(offload_during_rollout="yes")
    with pytest.raises(ValueError, match=r"OffloadConfig\.grads"):
        OffloadConfig(grads=None)
    with pytest.raises(TypeError):
        OffloadConfig(True)  # type: ignore[misc]
    with pytest.raises(ValueError, match="config must be an OffloadConfig"):
        PhaseManager(make(0), None, {"offload_during_rollout": True})


def test_engines_need_sleep_and_wake():
    pm = PhaseManager(make(0))
    with pytest.raises(ValueError, match="sleep\\(\\) and wake\\(\\)"):
        pm.add_engine(object())
    assert isinstance(KVEngine("cpu"), rlmem.Engine)


class TaggedEngine:
    """An engine with the full protocol: weights and KV cache in Regions of their own, every call recorded
    with what was resident then (the train state's bytes and the engine's)."""

    def __init__(self, pm: PhaseManager, nbytes: int = 1 << 20) -> None:
        self.pm = pm
        self.weights = rlmem.Region(nbytes, "cpu", name="weights")
        self.kv = rlmem.Region(2 * nbytes, "cpu", name="kv")
        self.weights.empty(nbytes // 4, torch.float32).fill_(1)
        self.events: list[tuple[str, int, int]] = []

    def _record(self, what: str) -> None:
        cats = self.pm.state.stats().categories.values()
        engine = self.weights.resident_bytes + self.kv.resident_bytes
        self.events.append((what, sum(c.resident_bytes for c in cats), engine))

    def sleep(self, level: int = 1) -> None:
        self.weights.pause(keep=level == 1)
        self.kv.pause(keep=False)
        self._record(f"sleep:{level}")

    def wake(self, tags=None) -> None:
        for tag in tags or ("weights", "kv_cache"):
            (self.weights if tag == "weights" else self.kv).resume()
            self._record(f"wake:{tag}")


def _trained(config: OffloadConfig):
    model = make(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 61, (2, 5))).float().sum().backward()
    opt.step()
    return model, opt, PhaseManager(model, opt, config)


def test_switch_order_keeps_the_peak_below_state_plus_engine():
    _, _, pm = _trained(OffloadConfig(offload_during_rollout=True, engine_sleep_level=2))
    engine = TaggedEngine(pm)
    pm.add_engine(engine)
    engine.sleep(level=2)  # as after construction: asleep until the first rollout
    engine.events.clear()
    state = sum(c.bytes for c in pm.state.stats().categories.values())
    whole = engine.weights.nbytes + engine.kv.nbytes
    synced = []
    for _ in range(2):
        with pm.rollout(sync_weights=lambda: engine._record("sync") or synced.append(1)):
            pass
        with pm.train():
            pm.state.synchronize()
    kinds = [e[0] for e in engine.events]
    assert kinds == ["wake:weights", "sync", "wake:kv_cache", "sleep:2"] * 2
    by_kind = {k: (s, e) for k, s, e in engine.events}
    assert by_kind["sync"][0] >= state  # the policy is still on the device while it is synced
    assert by_kind["wake:kv_cache"][0] == 0  # the cache wakes once the train state is gone
    assert max(s + e for _, s, e in engine.events) < state + whole
    assert len(synced) == 2


def test_bare_engine_wakes_after_the_offload_and_syncs_from_the_backup():
    model, _, pm = _trained(OffloadConfig(offload_during_rollout=True))
    engine = KVEngine("cpu")
    pm.add_engine(engine)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []

    def sync() -> None:
        same = all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        seen.append((engine.calls[-1], pm.state.paused("params"), same))

    with pm.rollout(sync_weights=sync):
        pass
    assert seen == [("wake", True, True)]  # woken whole, after the offload; the weights read from the backup
    with pm.train():
        pass
    assert engine.calls == ["wake", "sleep"]
    _, _, pm2 = _trained(OffloadConfig(offload_during_rollout=True, params="discard"))
    pm2.add_engine(KVEngine("cpu"))
    with (
        pytest.raises(ValueError, match="params='discard' leaves nothing to sync from"),
        pm2.rollout(sync_weights=lambda: None),
    ):
        pass


def test_engine_protocol_is_validated():
    for bad in (0, 3, True, "1"):
        with pytest.raises(ValueError, match=r"OffloadConfig\.engine_sleep_level must be one of 1, 2"):
            OffloadConfig(engine_sleep_level=bad)
    pm = PhaseManager(make(0))
    with pytest.raises(ValueError, match="sync_weights must be callable"), pm.rollout(sync_weights=42):
        pass
    called = []
    with pm.rollout(sync_weights=lambda: called.append(1)):  # offloading disabled: the sync still runs
        pass
    assert called == [1]


@pytest.mark.parametrize("prefetch", [False, True])
def test_overlapped_offload_trains_exactly_as_the_plain_switch(device, prefetch):
    base = {"offload_during_rollout": True, "params": "keep", "grads": "discard", "optimizer": "offload"}
    ref, *_ = _loop(device, OffloadConfig(**base), steps=5, prefetch=prefetch)
    got, pm, engine, seen, _ = _loop(device, OffloadConfig(**base, overlap_offload=True), 5, prefetch)
    assert got == ref
    assert engine.kv.paused and pm.phase == "train" and engine.calls[:3] == ["wake", "sleep", "wake"]
    sw = pm.stats().switches
    if device == "cpu":  # nothing to measure the room with: the switch waits for the whole release
        assert not sw.overlapped and sw.rollout_need_bytes is None
        assert all(s.resident_bytes == 0 for s in seen[1:])
    else:
        assert sw.rollout_need_bytes is not None


def test_optimizer_states_read_during_an_overlapped_rollout_are_the_kept_values(device):
    model = make(0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 61, (2, 5), device=device)).float().sum().backward()
    opt.step()
    config = OffloadConfig(offload_during_rollout=True, params="keep", overlap_offload=True)
    pm = PhaseManager(model, opt, config)
    want = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    for _ in range(3):
        with pm.rollout():
            assert pm.state.paused("optimizer")
            for p, w in zip(model.parameters(), want, strict=True):
                assert all(torch.equal(opt.state[p][k], v) for k, v in w.items())
        with pm.train():
            pass
    pm.state.synchronize()
    for p, w in zip(model.parameters(), want, strict=True):
        assert all(torch.equal(opt.state[p][k], v) for k, v in w.items())


class FullDeviceEngine(TaggedEngine):
    """Its KV cache does not fit until the train state's memory is released: the first wake fails."""

    def __init__(self, pm: PhaseManager) -> None:
        super().__init__(pm)
        self.failures = 1

    def wake(self, tags=None) -> None:
        if tags == ["kv_cache"] and self.failures:
            self.failures -= 1
            self._record("oom")
            raise rlmem.OutOfMemoryError("no room yet", needed=self.kv.nbytes)
        super().wake(tags)


def test_overlap_wakes_the_cache_again_once_the_release_is_done():
    _, _, pm = _trained(OffloadConfig(offload_during_rollout=True, overlap_offload=True))
    engine = FullDeviceEngine(pm)
    pm.add_engine(engine)
    with pm.rollout():
        pass
    assert [e[0] for e in engine.events] == ["wake:weights", "oom", "wake:kv_cache"]
    assert engine.events[-1][1] == 0  # woken again once the train state was gone
    assert not engine.kv.paused and pm.phase == "rollout"
    # Without the overlap the state is released before the cache wakes: a failure there is the caller's.
    _, _, plain = _trained(OffloadConfig(offload_during_rollout=True))
    plain.add_engine(FullDeviceEngine(plain))
    with pytest.raises(rlmem.OutOfMemoryError, match="no room yet"), plain.rollout():
        pass
    assert plain.phase is None and plain.state.paused("optimizer")


def test_overlap_offload_is_validated():
    assert OffloadConfig().overlap_offload is False
    with pytest.raises(ValueError, match=r"OffloadConfig\.overlap_offload must be True or False"):
        OffloadConfig(overlap_offload=1)


def test_the_overlapped_switch_waits_for_the_room_it_needs_not_for_the_whole_release(monkeypatch):
    from rlmem.train import phases
    from rlmem.train.state import TrainState

    _, _, pm = _trained(OffloadConfig(offload_during_rollout=True, overlap_offload=True))

    class Release:  # an offload in flight that completes after a few polls
        def __init__(self, polls: int) -> None:
            self.polls = polls

        def done(self) -> bool:
            self.polls -= 1
            return self.polls < 0

    free = iter([1 << 20, 2 << 20, 3 << 20, 4 << 20, 5 << 20, 6 << 20])
    synced = []
    monkeypatch.setattr(TrainState, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(phases, "_free_bytes", lambda device: next(free))
    monkeypatch.setattr(pm.state, "synchronize", lambda: synced.append(1))
    monkeypatch.setattr(pm.state, "in_flight", lambda: [Release(100)])
    assert pm._wait_release(3 << 20) is True and synced == []  # the third poll found 3 MiB free
    monkeypatch.setattr(pm.state, "in_flight", lambda: [Release(2)])
    assert pm._wait_release(None) is False and synced == [1]  # no measure: the whole release
    monkeypatch.setattr(pm.state, "in_flight", lambda: [Release(2)])
    assert pm._wait_release(1 << 40) is False and synced == [1, 1]  # never room enough: the whole release
