"""Touching offloaded state: the right values on the host, clear errors where there are none, and training
afterwards bit-identical to training without rlmem."""

from __future__ import annotations

import io

import pytest
import torch
from _helpers import run_fresh, same_bytes
from _models import make

import rlmem
from rlmem import TrainState

ALL_OFFLOAD = dict(params="offload", grads="offload", optimizer="offload", buffers="offload")


def _batch(device: str, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 61, (4, 9), generator=torch.Generator().manual_seed(seed)).to(device)


def _step(model, opt, x, *, set_to_none: bool = False) -> float:
    loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    return loss.item()


def _trained(device: str, steps: int = 2):
    """A model with every kind of holder populated: params (tied, frozen, transposed, bf16), kept gradients,
    AdamW states, a buffer."""
    model = make(0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    st = TrainState(model, opt, buffers=True)
    for i in range(steps):
        _step(model, opt, _batch(device, i))
    model(_batch(device, 99)).float().logsumexp(-1).mean().backward()  # gradients that exist now
    return model, opt, st


def _holders(model, opt) -> dict[str, torch.Tensor]:
    """Every tensor rlmem rebinds, by a readable name, as the holder sees it now."""
    out = {}
    for n, p in model.named_parameters():
        out[f"param {n}"] = p.detach()
        if p.grad is not None:
            out[f"grad {n}"] = p.grad
    for n, b in model.named_buffers():
        out[f"buffer {n}"] = b
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            if torch.is_tensor(v) and v.device == p.device:  # AdamW's host-side step of a CUDA parameter
                out[f"state {names[id(p)]}.{k}"] = v  # is not adopted: it never leaves the host
    return out


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in _holders(model, opt).items()}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("blocking", [True, False])
def test_every_holder_reads_the_offloaded_values(device, blocking):
    model, opt, st = _trained(device)
    ref = _snapshot(model, opt)
    devices = {k: v.device for k, v in _holders(model, opt).items()}
    st.offload(**ALL_OFFLOAD, blocking=blocking)  # non-blocking: read at once, while memory is released
    now = _holders(model, opt)
    assert now.keys() == ref.keys()
    for k, v in now.items():
        assert v.device == devices[k], k  # same device and dtype: autograd and DDP see no change
        assert same_bytes(v.cpu(), ref[k]), k
    # What users do during rollout: norms, a checkpoint of the model and of the optimizer.
    norm = torch.nn.utils.get_total_norm([p.detach() for p in model.parameters()])
    ref_norm = torch.nn.utils.get_total_norm([ref[f"param {n}"] for n, _ in model.named_parameters()])
    assert norm.item() == ref_norm.item()
    sd = _roundtrip(model.state_dict())
    assert all(same_bytes(sd[n].cpu(), ref[f"param {n}"]) for n, _ in model.named_parameters())
    assert same_bytes(sd["offset"].cpu(), ref["buffer offset"])
    osd = _roundtrip(opt.state_dict())
    names = [n for n, _ in model.named_parameters()]
    for i, s in osd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert same_bytes(s[k].cpu(), ref[f"state {names[i]}.{k}"])
    st.synchronize()
    assert all(r.resident_bytes == 0 for r in st.regions())
    st.reload(blocking=True)
    assert all(same_bytes(v.cpu(), ref[k]) for k, v in _holders(model, opt).items())


def test_reload_puts_every_holder_back_at_its_address(device):
    model, opt, st = _trained(device)
    before = {k: v.data_ptr() for k, v in _holders(model, opt).items()}
    for blocking in (True, False):
        st.offload(**ALL_OFFLOAD, blocking=blocking)
        away = {k: v.data_ptr() for k, v in _holders(model, opt).items()}
        assert all(away[k] != before[k] for k in before)  # nothing points at released memory
        st.reload(blocking=blocking)
        st.synchronize()
        assert {k: v.data_ptr() for k, v in _holders(model, opt).items()} == before


def test_optimizer_states_read_right_while_a_nonblocking_reload_streams_them(device):
    model, opt, st = _trained(device)
    ref = _snapshot(model, opt)
    ptrs = {k: v.data_ptr() for k, v in _holders(model, opt).items()}
    st.offload(**ALL_OFFLOAD, blocking=True)
    st.reload(blocking=False)
    now = _holders(model, opt)
    for k, v in now.items():
        assert same_bytes(v.cpu(), ref[k]), k
        if k.startswith("state"):
            assert v.data_ptr() != ptrs[k]  # still the backup: its copy may not have landed
        else:
            assert v.data_ptr() == ptrs[k]  # ordered on the current stream: back on the device
    opt.step()  # waits for the states and points the optimizer back at them first
    assert all(v.data_ptr() == ptrs[k] for k, v in _holders(model, opt).items() if k.startswith("state"))


def test_writes_during_rollout_are_what_reload_brings_back(device):
    model, opt, st = _trained(device)
    st.offload(**ALL_OFFLOAD, blocking=True)
    with torch.no_grad():
        model.up.weight.mul_(2)  # in place, on the offloaded view
        model.load_state_dict({**model.state_dict(), "down.bias": torch.full_like(model.down.bias, 0.5)})
        opt.state[model.up.weight]["exp_avg"].fill_(0.25)
    want = _snapshot(model, opt)
    st.reload(blocking=True)
    got = _snapshot(model, opt)
    assert all(same_bytes(got[k], want[k]) for k in want)
    assert torch.all(model.down.bias == 0.5)


def test_holders_rebound_during_rollout_are_left_alone(device):
    model, opt, st = _trained(device)
    saved = _roundtrip(opt.state_dict())
    st.offload(**ALL_OFFLOAD, blocking=True)
    opt.zero_grad()  # set_to_none: the user dropped the gradients meanwhile
    for s in saved["state"].values():
        s["exp_avg"].fill_(3.0)
    opt.load_state_dict(saved)  # replaces the offloaded states with new tensors
    st.reload(blocking=True)
    st.synchronize()
    assert all(p.grad is None for p in model.parameters())  # not resurrected
    assert all(torch.all(s["exp_avg"] == 3.0) for s in opt.state.values())  # not overwritten
    _step(model, opt, _batch(device, 7))  # the new states are adopted and train


def test_training_after_touching_offloaded_state_is_bit_identical(device):
    def run(offload: bool):
        model = make(0, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        st = TrainState(model, opt, buffers=True) if offload else None
        losses = []
        for i in range(5):
            losses.append(_step(model, opt, _batch(device, i), set_to_none=i % 2 == 0))
            if st is not None:
                st.offload(**{**ALL_OFFLOAD, "grads": "discard"}, blocking=i % 2 == 0)
                _roundtrip(model.state_dict())
                _roundtrip(opt.state_dict())
                torch.nn.utils.get_total_norm([p.detach() for p in model.parameters()]).item()
                st.reload(blocking=i % 2 == 1)
        if st is not None:
            st.synchronize()
        return losses, _snapshot(model, opt)

    ref, got = run(False), run(True)
    assert ref[0] == got[0]
    assert ref[1].keys() == got[1].keys() and all(same_bytes(got[1][k], ref[1][k]) for k in ref[1])


def test_gradient_accumulators_survive_offload(device):
    """Autograd keeps one gradient accumulator per parameter, and DDP hooks its reduction onto it: a holder
    moved to another device would get a new one and DDP would silently stop reducing."""
    model, _, st = _trained(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    accs = [p.expand_as(p).grad_fn.next_functions[0][0] for p in trainable]
    st.offload(**ALL_OFFLOAD, blocking=True)
    st.reload(blocking=True)
    assert all(p.expand_as(p).grad_fn.next_functions[0][0] is a for p, a in zip(trainable, accs, strict=True))


def test_discarded_params_and_buffers_are_placeholders_with_clear_errors(device):
    model, opt, st = _trained(device)
    meta = {n: (p.shape, p.dtype, p.device) for n, p in model.named_buffers()}
    meta.update({n: (p.shape, p.dtype, p.device) for n, p in model.named_parameters()})
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    st.offload(params="discard", grads="discard", optimizer="offload", buffers="discard", blocking=True)
    assert all(r.resident_bytes == 0 for c in ("params", "buffers") for r in st.regions(c))
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert (t.shape, t.dtype, t.device) == meta[n]  # what it is stays answerable
        assert isinstance(t, torch.Tensor) and t.data_ptr() not in ptrs.values()  # not released memory
    discarded = r"rlmem: TrainState 'train' discarded these (params|buffers).*='offload' to keep them"
    for use in (
        lambda: model.up.weight.sum(),  # no values: an error, never zeros
        lambda: model.up.weight.detach().cpu(),
        lambda: model.up.weight * 2,
        lambda: model.offset + 1,
        lambda: torch.save(model.up.weight, io.BytesIO()),
        lambda: torch.nn.utils.get_total_norm([model.down.weight]),
    ):
        with pytest.raises(RuntimeError, match=discarded):
            use()
    with pytest.raises(RuntimeError, match=r"rlmem TrainState .*params are discarded.*params='offload'"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="rlmem TrainState"), torch.no_grad():
        model(_batch(device))
    assert isinstance(model.up.weight, torch.nn.Parameter) and "placeholder" in repr(model.up.weight)
    _roundtrip(opt.state_dict())  # the optimizer was offloaded, not discarded: readable
    st.reload(blocking=True)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    model.state_dict()
    _step(model, opt, _batch(device))  # uninitialised weights, but a working model


def test_gradients_stay_readable_while_their_parameters_are_discarded(device):
    model, _, st = _trained(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ref = [p.grad.detach().cpu().clone() for p in trainable]
    accs = [p.expand_as(p).grad_fn.next_functions[0][0] for p in trainable]
    st.offload(params="discard", grads="offload", optimizer="offload", blocking=True)
    assert all(same_bytes(p.grad.cpu(), g) for p, g in zip(trainable, ref, strict=True))
    st.reload(blocking=True)
    assert all(same_bytes(p.grad.cpu(), g) for p, g in zip(trainable, ref, strict=True))
    # The placeholder kept the parameters' device and dtype: autograd kept their gradient accumulators.
    assert all(p.expand_as(p).grad_fn.next_functions[0][0] is a for p, a in zip(trainable, accs, strict=True))


def test_ddp_gradient_reduction_survives_phase_switches(device):
    out = run_fresh(
        """
        import json, os, torch, torch.distributed as dist, rlmem
        dev = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8, device=dev))
        calls = []
        def hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        x = torch.randn(4, 8, device=dev)
        counts = []
        for params in ("offload", "discard"):
            cfg = rlmem.OffloadConfig(offload_during_rollout=True, params=params)
            pm = rlmem.PhaseManager(ddp, opt, cfg)
            calls.clear()
            for _ in range(4):
                with pm.rollout():
                    if params == "offload":
                        ddp.module.weight.norm().item()
                with pm.train():
                    ddp(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
            pm.state.close()
            counts.append(len(calls))
        dist.destroy_process_group()
        print(json.dumps({"calls": counts}))
        """.replace("DEVICE", repr(device))
    )
    assert out["calls"] == [4, 4]  # one bucket reduced per backward, every step, either policy


def test_checkpoint_saved_in_rollout_equals_one_saved_in_train(device, tmp_path):
    """save_pretrained of the policy plus the optimizer state, as the GRPO loop sets the phases up (weights
    kept for the rollout) and with weights offloaded too."""
    pytest.importorskip("transformers")
    from rlmem.recipes.config import GRPOConfig
    from rlmem.recipes.policy import build_policy, materialize_optimizer_state

    cfg = GRPOConfig(device=device, steps=1)
    for params in ("keep", "offload"):
        model = build_policy(cfg, torch.device(device), torch.float32, 16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        materialize_optimizer_state(opt)
        cfg_pm = rlmem.OffloadConfig(offload_during_rollout=True, params=params, optimizer="offload")
        pm = rlmem.PhaseManager(model, opt, cfg_pm)
        ids = torch.randint(0, 16, (2, 6)).to(device)
        with pm.train():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        dirs = {}
        for phase in ("rollout", "train"):
            with getattr(pm, phase)():
                d = tmp_path / f"{params}-{phase}"
                model.save_pretrained(d)
                torch.save(opt.state_dict(), d / "optimizer.pt")
                dirs[phase] = d
        from transformers import AutoModelForCausalLM

        a = AutoModelForCausalLM.from_pretrained(dirs["rollout"]).state_dict()
        b = AutoModelForCausalLM.from_pretrained(dirs["train"]).state_dict()
        assert a.keys() == b.keys() and all(same_bytes(a[k], b[k]) for k in a)
        oa = torch.load(dirs["rollout"] / "optimizer.pt", weights_only=True)["state"]
        ob = torch.load(dirs["train"] / "optimizer.pt", weights_only=True)["state"]
        assert oa.keys() == ob.keys()
        assert all(same_bytes(oa[i][k].cpu(), ob[i][k].cpu()) for i in oa for k in oa[i])


@pytest.mark.cuda
def test_a_kernel_on_an_offloaded_parameter_keeps_the_context_alive():
    out = run_fresh(
        """
        import json, sys, torch
        sys.path.insert(0, "TESTS")
        from _models import make
        import rlmem
        model = make(0, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        st = rlmem.TrainState(model, opt)
        model(torch.randint(0, 61, (4, 9), device="cuda")).float().sum().backward()
        opt.step()
        want = (model.up.weight.detach().cpu() * 2).sum().item()
        st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
        free_during = torch.cuda.mem_get_info()[0]
        got = (model.up.weight * 2).sum().item()  # a kernel over the pinned backup, read over the link
        exp_avg = opt.state[model.up.weight]["exp_avg"].abs().max().item()
        refused = ""
        try:
            with torch.no_grad():
                model(torch.randint(0, 61, (4, 9), device="cuda"))
        except RuntimeError as e:
            refused = str(e)
        after = (torch.ones(1024, device="cuda") * 3).sum().item()  # the context is alive
        st.reload(blocking=True)
        print(json.dumps({"want": want, "got": got, "after": after, "refused": refused,
                          "exp_avg": exp_avg, "device": str(model.up.weight.device)}))
        """.replace("TESTS", str(__import__("_helpers").ROOT / "tests"))
    )
    assert out["got"] == out["want"]
    assert out["after"] == 3072.0 and out["exp_avg"] > 0
    assert "rlmem TrainState" in out["refused"]
    assert out["device"] == "cuda:0"
