"""TrainState: training with offload/reload between steps is bit-identical to training without it."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import OPTIMIZERS, make

import rlmem
from rlmem import TrainState


def _batches(n: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, 61, (4, 9), generator=g).to(device) for _ in range(n)]


def _train(
    device, opt_name, *, state_kwargs=None, cycle=None, steps=6, accumulate=1, set_to_none=True, mixed=True
):
    model = make(0, device, mixed=mixed)
    opt = OPTIMIZERS[opt_name](model.parameters())
    st = TrainState(model, opt, **(state_kwargs or {})) if cycle is not None else None
    losses = []
    data = _batches(steps * accumulate, device)
    for step in range(steps):
        for k in range(accumulate):
            loss = model(data[step * accumulate + k]).float().logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if st is not None:
            cycle(st, step)
    if st is not None:
        st.synchronize()  # a non-blocking reload guarantees optimizer states to step() only
    params = [p.detach().clone() for p in model.parameters()]
    states = [
        v.detach().clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    return losses, params, states, st, model, opt


def _cpu_fused_adamw() -> bool:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except RuntimeError:
        return False
    return True


def _assert_same(a, b):
    la, pa, sa = a[:3]
    lb, pb, sb = b[:3]
    assert la == lb
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb, strict=True))


def _offload_reload(st, step):
    st.offload(params="offload", grads="discard", optimizer="offload", blocking=step % 2 == 0)
    st.reload(blocking=step % 2 == 1)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_offload_between_steps_is_bit_identical(device, opt_name):
    if opt_name == "adamw-fused" and device == "cpu" and not _cpu_fused_adamw():
        pytest.skip("this PyTorch build has no fused AdamW for CPU")
    ref = _train(device, opt_name)
    got = _train(device, opt_name, cycle=_offload_reload)
    _assert_same(ref, got)
    st = got[3]
    assert st.stats().categories["optimizer"].regions >= 1


def test_gradient_accumulation_with_kept_gradients_offloaded(device):
    def cycle(st, step):
        st.offload(params="offload", grads="offload", optimizer="offload", buffers="offload", blocking=True)
        st.reload(blocking=False)

    ref = _train(device, "adamw-foreach", accumulate=3, set_to_none=False)
    got = _train(
        device, "adamw-foreach", cycle=cycle, accumulate=3, set_to_none=False, state_kwargs={"buffers": True}
    )
    _assert_same(ref, got)


def test_optimizer_discard_forgets_state_like_a_new_optimizer(device):
    def cycle(st, step):
        st.offload(params="offload", grads="discard", optimizer="discard", blocking=True)
        st.reload(blocking=True)

    def fresh_each_step(device):  # reference: a new AdamW after every step
        model = make(0, device)
        losses = []
        for x in _batches(4, device):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            loss = model(x).float().logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return losses

    got = _train(device, "adamw-foreach", cycle=cycle, steps=4)
    assert got[0] == fresh_each_step(device)


def test_params_grads_and_states_live_in_regions(device):
    _, _, _, st, model, opt = _train(device, "adamw-foreach", cycle=lambda s, i: None, steps=1)
    spans = {
        c: [(r.data_ptr, r.data_ptr + r.nbytes) for r in st.regions(c)]
        for c in ("params", "grads", "optimizer")
    }

    def inside(t, cat):
        return any(a <= t.data_ptr() < b for a, b in spans[cat])

    assert all(inside(p, "params") for p in model.parameters())
    assert model.head.weight is model.embed.weight  # tie kept
    assert model.mix.stride() == (1, 24)  # dense transposed layout kept, as autograd lays out its grad
    for p in model.parameters():
        if p.requires_grad:
            assert p.grad is None  # zero_grad() default: None, as without rlmem
    x = _batches(1, device)[0]
    model(x).float().sum().backward()
    assert all(inside(p.grad, "grads") for p in model.parameters() if p.requires_grad)
    assert model.frozen.weight.grad is None
    for s in opt.state.values():
        assert inside(s["exp_avg"], "optimizer") and inside(s["exp_avg_sq"], "optimizer")
        if device == "cuda":
            assert s["step"].device.type == "cpu"  # host scalar left alone


def test_offload_releases_and_reload_restores_resident_bytes(device):
    _, _, _, st, _, _ = _train(device, "adamw-foreach", cycle=lambda s, i: None, steps=1)
    before = st.stats().categories
    st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
    cats = st.stats().categories
    for c in ("params", "grads", "optimizer"):
        assert cats[c].resident_bytes == 0 and cats[c].policy != "keep"
    assert cats["params"].backup_bytes >= before["params"].bytes
    st.reload(blocking=True)
    cats = st.stats().categories
    assert all(cats[c].resident_bytes == before[c].resident_bytes for c in cats)
    assert st.stats().last.reload_bytes > 0


def test_lazily_created_and_replaced_states_are_adopted(device):
    model = make(0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    st = TrainState(model, opt)
    assert st.regions("optimizer") == []  # nothing exists before the first step
    x = _batches(1, device)[0]
    model(x).float().sum().backward()
    opt.step()
    assert len(st.regions("optimizer")) == 1
    first = st.regions("optimizer")[0]
    sd = copy.deepcopy(opt.state_dict())  # as a checkpoint restore would
    opt.load_state_dict(sd)  # replaces every state tensor
    assert st.adopt_optimizer_states() > 0
    assert first.closed and len(st.regions("optimizer")) == 1
    st.offload(blocking=True)
    st.reload(blocking=False)
    assert opt.state_dict()["state"]  # waits for the states still streaming in
    model(x).float().sum().backward()
    opt.step()


def test_close_gives_everything_back(device):
    _, _, _, st, model, opt = _train(device, "sgd-momentum", cycle=lambda s, i: None, steps=2)
    ref = [p.detach().clone() for p in model.parameters()]
    st.offload(blocking=True)
    st.close()
    st.close()
    assert all(r.closed for r in st.regions())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref, strict=True))
    model(_batches(1, device)[0]).float().sum().backward()
    opt.step()  # hooks are gone, state is plain tensors


def test_forward_while_params_offloaded_is_refused(device):
    _, _, _, st, model, _ = _train(device, "adamw-foreach", cycle=lambda s, i: None, steps=1)
    x = _batches(1, device)[0]
    st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
    with pytest.raises(RuntimeError, match="params='keep'"), torch.no_grad():
        model(x)
    st.reload(blocking=True)
    st.offload(params="keep", grads="offload", optimizer="offload", blocking=True)
    with torch.no_grad():
        model(x)  # a rollout on the training model: fine
    with pytest.raises(RuntimeError, match="gradients are offloaded"):
        model(x)
    st.reload(blocking=True)


def test_the_forward_guards_are_there_only_while_something_they_check_is_released(device):
    # A module with a forward hook takes PyTorch's slow call path: the train phase runs without them.
    _, _, _, st, model, _ = _train(device, "adamw-foreach", cycle=lambda s, i: None, steps=1)

    def guarded() -> int:
        return sum(len(m._forward_pre_hooks) for m in model.modules())

    assert guarded() == 0
    st.offload(params="keep", grads="keep", optimizer="offload", blocking=True)
    assert guarded() == 0  # the optimizer's own step hook refuses a step
    st.reload(blocking=True)
    st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
    assert guarded() == sum(1 for m in model.modules() if m._parameters)
    st.reload(blocking=False)
    assert guarded() == 0
    st.offload(params="keep", grads="offload", optimizer="keep", blocking=True)
    assert guarded() > 0
    st.close()
    assert guarded() == 0


def test_step_while_optimizer_offloaded_is_refused(device):
    _, _, _, st, _, opt = _train(device, "adamw-foreach", cycle=lambda s, i: None, steps=1)
    st.offload(params="keep", grads="keep", optimizer="offload", blocking=True)
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\) was called while optimizer"):
        opt.step()
    st.reload()
    opt.step()


def test_a_category_comes_back_on_its_own_and_the_rest_stays_away(device):
    # The weights back alone (an evaluation, a weight sync), the optimizer states kept in host memory until
    # the step needs them: the same device addresses, forward allowed, step refused, and after the rest
    # comes back the run is bit for bit the one without offload.
    ref = _train(device, "adamw-foreach", steps=3)

    def cycle(st, step):
        model = st.model
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        opt_bytes = [r.used_bytes for r in st.regions("optimizer")]
        st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
        st.reload(optimizer=False, blocking=step % 2 == 0)
        assert not st.paused("params") and st.paused("optimizer")
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
        assert all(r.paused for r in st.regions("optimizer")) and opt_bytes
        with torch.no_grad():
            model(_batches(1, device)[0])  # the weights are back: a forward runs
        assert st.optimizer.state_dict()["state"]  # readable while away
        with pytest.raises(RuntimeError, match=r"optimizer\.step\(\) was called while optimizer"):
            st.optimizer.step()
        st.reload(params=False, buffers=False, grads=False)  # the optimizer states alone
        assert not st.paused("optimizer")
        st.reload()
        assert not any(st.paused(c) for c in ("params", "buffers", "grads", "optimizer"))

    got = _train(device, "adamw-foreach", steps=3, cycle=cycle)
    _assert_same(ref, got)
    st = got[3]
    with pytest.raises(ValueError, match="optimizer"):
        st.reload(optimizer="no")


def test_optimizer_on_step_holds_the_states_away_but_for_the_step(device):
    # The states come back for each step() and go away after it: away through forward and backward, the run
    # bit for bit the one without offload, and a state made without the option still refuses the step.
    ref = _train(device, "adamw-foreach", steps=4)
    seen = []

    def cycle(st, step):
        seen.append(st.paused("optimizer") or step == 0)  # the first step made the states on the device
        st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
        st.reload(optimizer=False)
        assert st.paused("optimizer") and all(r.paused for r in st.regions("optimizer"))

    got = _train(device, "adamw-foreach", steps=4, cycle=cycle, state_kwargs={"optimizer_on_step": True})
    _assert_same(ref, got)
    assert seen == [True] * 4
    st = got[3]
    assert st.paused("optimizer")  # after the last step, away again
    st.reload()
    assert not st.paused("optimizer")
    with pytest.raises(ValueError, match="optimizer_on_step must be True or False"):
        TrainState(make(0), optimizer_on_step="yes")


def test_bad_arguments_are_named():
    model = make(0)
    with pytest.raises(ValueError, match=r"model must be a torch\.nn\.Module"):
        TrainState(object())
    with pytest.raises(ValueError, match="optimizer must be"):
        TrainState(model, optimizer="adam")
    with pytest.raises(ValueError, match="buffers must be"):
        TrainState(model, buffers=1)
    other = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter of shape \(2, 2\)"):
        TrainState(model, opt)
    st = TrainState(model)
    with pytest.raises(ValueError, match="grads must be one of 'keep', 'offload', 'discard'; got 'drop'"):
        st.offload(grads="drop")
    with pytest.raises(ValueError, match="blocking"):
        st.reload(blocking="no")
    assert not st.paused("params") and not st.paused("grads")


def test_gapped_parameter_becomes_contiguous():
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.randn(6, 8)[:, ::2])
    ref = m.w.detach().clone()
    TrainState(m)
    assert m.w.is_contiguous() and torch.equal(m.w, ref)


def test_overlapping_parameters_are_refused():
    m = torch.nn.Module()
    base = torch.randn(10)
    m.a = torch.nn.Parameter(base[:6])
    m.b = torch.nn.Parameter(base[4:])
    with pytest.raises(ValueError, match="overlap in memory"):
        TrainState(m)


def test_aliases_of_one_view_keep_sharing_it():
    m = torch.nn.Module()
    w = torch.randn(3, 3)
    m.a = torch.nn.Parameter(w)
    m.b = torch.nn.Parameter(w)  # a distinct Parameter over the same memory
    TrainState(m)
    assert m.a.data_ptr() == m.b.data_ptr()
    with torch.no_grad():
        m.a.add_(1)
    assert torch.equal(m.a, m.b)


def test_offload_is_idempotent_and_nonblocking_offload_is_joined(device):
    _, _, _, st, model, opt = _train(device, "adamw-foreach", cycle=lambda s, i: None, steps=1)
    st.offload(blocking=False)
    st.offload(blocking=False)  # already offloaded: nothing more
    st.reload(blocking=False)  # waits for the offload first
    st.synchronize()
    model(_batches(1, device)[0]).float().sum().backward()
    opt.step()


def test_host_memory_is_returned_by_close():
    held = rlmem.host_memory_held()
    _, _, _, st, _, _ = _train("cpu", "adamw-foreach", cycle=_offload_reload, steps=2)
    assert rlmem.host_memory_held()["pageable"] > held["pageable"]
    st.close()
    assert rlmem.host_memory_held() == held


@pytest.mark.gpus(2)
def test_model_on_two_devices_gets_a_region_per_device():
    def run(offload):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32).to("cuda:0"), torch.nn.Linear(32, 8).to("cuda:1"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        st = TrainState(model, opt) if offload else None
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(4):
            x = torch.randn(4, 16, generator=g).to("cuda:0")
            loss = model[1](model[0](x).to("cuda:1")).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if st is not None:
                st.offload(blocking=True)
                st.reload(blocking=False)
        if st is not None:
            st.synchronize()
            assert {r.device.index for r in st.regions("params")} == {0, 1}
        return losses, [p.detach().cpu() for p in model.parameters()]

    ref, got = run(False), run(True)
    assert ref[0] == got[0] and all(torch.equal(a, b) for a, b in zip(ref[1], got[1], strict=True))


def test_gradients_left_to_pytorch_with_grads_false(device):
    def cycle(st, step):
        st.offload(params="offload", optimizer="offload", blocking=True)
        st.reload(blocking=True)

    kept = _train(device, "adamw-foreach", state_kwargs={"grads": False}, cycle=cycle)
    _assert_same(_train(device, "adamw-foreach"), kept)
    _, _, _, st, model, _ = kept
    assert st.regions("grads") == [] and st.stats().categories["grads"].bytes == 0
    assert all(
        p.grad is None for p in model.parameters()
    )  # zero_grad() freed them: nothing held between steps
    model(_batches(1, device)[0]).float().sum().backward()
    params = [(r.data_ptr, r.data_ptr + r.nbytes) for r in st.regions("params")]
    assert not any(
        a <= p.grad.data_ptr() < b for p in model.parameters() if p.grad is not None for a, b in params
    )
    with pytest.raises(ValueError, match=r"grads='discard'.*grads=False"):
        st.offload(grads="discard")
    with pytest.raises(ValueError, match="grads must be"):
        TrainState(make(0, device), grads=None)
