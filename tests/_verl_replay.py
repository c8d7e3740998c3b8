"""verl's own FSDP engine replayed on Gloo ranks, with rlmem.integrations.verl loaded the way verl loads it
(``VERL_USE_EXTERNAL_MODULES``, which the test sets), in verl's venv (tests/_verl_env.py).

Each rank builds a tiny Qwen2 twice, wrapped as verl wraps it (FSDP2: ``fully_shard`` per decoder layer and
the root; FSDP1: a unit per decoder layer and the root, FULL_SHARD, ``MixedPrecision(param_dtype=bf16)`` as
verl always sets), under ``FSDPEngineWithLMHead`` made with ``object.__new__`` (as verl's own CPU tests make
engines), and replays what verl's actor worker does for three steps: ``initialize``'s offload, the switch to
rollout (``get_per_tensor_param`` consumed, then ``to("cpu", model=True, optimizer=False, grad=False)``),
``compute_log_prob`` (the eval mode: the model alone back), ``update_actor`` (the train mode: forward,
backward, verl's ``optimizer_step``), with verl's ``param_offload``/``optimizer_offload`` off (the reference)
and on (rlmem). Rank 0 writes what every rank observed to OUT.

``RLMEM_VERL_OPTIMIZER`` and ``RLMEM_VERL_COMMS`` come from the environment as the test sets them; with
``suspend``, the switch to rollout runs verl's own ``ActorRolloutRefWorker.update_weights`` over a stand-in
rollout, and the process groups are Gloo under the host stand-in for NCCL (tests/_comm.py).

``megatron``: verl's ``MegatronEngine`` over stock Megatron-Core (two data-parallel ranks: a GPTModel in its
DistributedDataParallel, whose gradient buffer verl's offload drops and zeroes on load).

Run: python tests/_verl_replay.py OUT fsdp2|fsdp1|megatron [WORLD]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _helpers import rank_group, same_tensors, spawn_ranks

STEPS = 3


class _HostDevice:
    """What verl's code asks of ``torch.cuda`` through its platform, on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(*_: Any) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def mem_get_info(*_: Any) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def memory_allocated(*_: Any) -> int:
        return 0

    memory_reserved = memory_allocated


def host_platform() -> None:
    """verl's CUDA platform (device name ``cuda``, so its engines offload to ``cpu`` and load back to
    ``cuda``) with the device's calls made to the CPU, installed through verl's own ``set_platform``."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform

    class HostCUDA(PlatformCUDA):
        def current_device(self) -> Any:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return _HostDevice()

        def synchronize(self, device_index: Any = None) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def set_allocator_settings(self, settings: str) -> None:
            pass

    set_platform(HostCUDA())


def tiny_qwen2() -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).float()


def wrap(model: torch.nn.Module, kind: str, world: int, **fsdp1: Any) -> torch.nn.Module:
    layers = list(model.model.layers)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={type(layers[0])})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FSDP(
        model,
        auto_wrap_policy=policy,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=False,
        **fsdp1,
    )


def engine(kind: str, world: int, offload: bool, **fsdp1: Any) -> Any:
    """verl's FSDPEngineWithLMHead (made as ``rlmem bench verl`` makes it) over a freshly wrapped tiny Qwen2
    with AdamW."""
    from rlmem.benchmarks.verl import fsdp_engine

    model = tiny_qwen2()
    module = wrap(model, kind, world, **fsdp1)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return fsdp_engine(module, opt, model.config, offload=offload, world=world)


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(e: Any) -> list[torch.Tensor]:
    """This rank's shards of the weights and its optimizer states, read through ``state_dict()``."""
    out = [local(v) for v in e.module.state_dict().values()]
    for st in e.optimizer.state_dict()["state"].values():
        out += [local(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return out


class Rollout:
    """A stand-in for verl's rollout in ``update_weights``: records the calls, keeps what it is sent."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.sleep_level = 2

    async def resume(self, tags: list[str]) -> None:
        from rlmem import comm

        self.calls.append(f"resume {','.join(tags)} suspended={len(comm.suspended())}")

    async def update_weights(self, params: Any, **kwargs: Any) -> None:
        self.weights = {n: local(t) for n, t in params}
        self.calls.append("update_weights")


def switch_to_rollout(e: Any, comms: bool) -> dict[str, torch.Tensor]:
    """What verl's actor worker does at the switch to rollout: its own ``update_weights`` (over a stand-in
    rollout) where NCCL is suspended at the switch; otherwise the same engine calls it makes."""
    if comms:
        from verl.workers.engine_workers import ActorRolloutRefWorker

        w = object.__new__(ActorRolloutRefWorker)
        w.config = types.SimpleNamespace(
            rollout=_Cfg(name="vllm", free_cache_engine=True, checkpoint_engine=_Cfg(backend="naive"))
        )
        w.actor = types.SimpleNamespace(engine=e)
        w.rollout = Rollout()
        w.layered_summon = False
        w.peft_merge = False
        w.base_sync_done = False
        asyncio.run(w.update_weights())
        switch_to_rollout.calls = w.rollout.calls  # type: ignore[attr-defined]
        return w.rollout.weights
    params, _ = e.get_per_tensor_param()
    sent = {n: local(t) for n, t in params}
    if e.is_param_offload_enabled:
        e.to("cpu", model=True, optimizer=False, grad=False)
    return sent


class _Cfg(types.SimpleNamespace):
    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def replay(kind: str, world: int, offload: bool, comms: bool, checks: dict[str, list[bool]]) -> dict:
    import rlmem.integrations.verl as rv

    e = engine(kind, world, offload)
    if kind == "fsdp1" and not offload:
        # verl's FSDP1 weight sync stages the model on the device with its own helper even with offload off;
        # on the CPU there is no device to stage it on, and the model is where that would leave it anyway
        e._uses_fsdp2_cpu_offload_policy = True
    # FSDPEngine.initialize ends so: offload what verl's flags say
    e.to("cpu", model=offload, optimizer=offload, grad=offload)
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    sent, logits, losses = [], [], []
    step_mode = rv.settings().optimizer == "step"

    def check(name: str, ok: bool) -> None:
        checks.setdefault(name, []).append(bool(ok))

    from rlmem import comm

    st = rv.state_of(e)
    check("adopted at initialize", (st is not None) == offload)
    for _ in range(STEPS):
        sent.append(switch_to_rollout(e, comms))
        if offload:
            check("away in rollout", st.paused("params") and all(r.paused for r in st.regions("params")))
            if comms:
                check("comms suspended in rollout", len(comm.suspended()) > 0)
        x = torch.randint(0, 64, (2, 12), generator=g)
        with e.eval_mode(), torch.no_grad():
            if offload:
                check("eval: weights back", not st.paused("params"))
                # the model alone: the optimizer states stay in host memory (none before the first step)
                check("eval: optimizer away", st.paused("optimizer") or not st.regions("optimizer"))
                if comms:
                    check("comms resumed in eval", comm.suspended() == [])
            logits.append(e.module(input_ids=x).logits.detach().clone())
        with e.train_mode():
            had_states = offload and bool(st.regions("optimizer"))
            if offload:
                check("train: optimizer as asked", st.paused("optimizer") == (step_mode and had_states))
            loss = e.module(input_ids=x).logits.float().logsumexp(-1).mean()
            loss.backward()
            e.optimizer_step()
            losses.append(loss.detach().clone())
            if offload:
                # (the first step makes them on the device: the train mode's exit offloads them)
                check(
                    "train: step mode sends them back", st.paused("optimizer") == (step_mode and had_states)
                )
        if offload:
            check("all away after train", all(st.paused(c) for c in ("params", "optimizer")))
            check("away: resident bytes 0", all(r.resident_bytes == 0 for r in st.regions()))
    # read while away (offload) or as trained (reference)
    return {"sent": sent, "logits": logits, "losses": losses, "final": snapshot(e)}


def megatron_engine(offload: bool) -> tuple[Any, Any]:
    """verl's MegatronEngine (``object.__new__``) over stock Megatron-Core: a GPTModel in Megatron's
    DistributedDataParallel (its contiguous gradient buffer) under Megatron's mixed-precision optimizer's
    structure (fp32 main parameters under AdamW; ``get_megatron_optimizer`` builds only on CUDA), its step
    answering as Megatron's does; and the trainer that holds its data."""
    from megatron.core import parallel_state as ps
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from rlmem.benchmarks import _megatron_layouts as layouts

    class Optimizer(layouts._MixedPrecision):
        def step(self) -> tuple[bool, None, None]:
            super().step()
            return True, None, None

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()  # the reference's; the trainer sets them up again
    shape = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq": 16, "batch": 2}
    tr = layouts.Trainer("dp2", shape, torch.device("cpu"))
    ddp, _ = tr.build(seed=0)
    e = object.__new__(MegatronEngine)
    e.module = [ddp]
    e.optimizer = Optimizer(ddp)
    e.mode = None
    e._is_offload_param = offload
    e._is_offload_optimizer = offload
    return e, tr


def replay_megatron(offload: bool, checks: dict[str, list[bool]]) -> dict:
    """verl's Megatron actor for three steps: the weight sync's model-only load (``load_grad=False``, as
    ``get_per_tensor_param`` calls it) and the switch to rollout, the eval mode, the train mode."""
    from megatron.core.distributed import finalize_model_grads
    from verl.workers.engine.megatron import transformer_impl as impl

    import rlmem.integrations.verl as rv

    e, tr = megatron_engine(offload)
    ddp = e.module[0]
    e.to("cpu", model=offload, optimizer=offload, grad=offload)  # MegatronEngine.initialize's end
    st = rv.state_of(e)

    def check(name: str, ok: bool) -> None:
        checks.setdefault(name, []).append(bool(ok))

    check("adopted at initialize", (st is not None) == offload)
    sent, logits, losses = [], [], []
    for _ in range(STEPS):
        if offload:  # (verl's own helper needs the distributed optimizer's parameter buffer: CUDA only)
            impl.load_megatron_model_to_gpu(e.module, load_grad=False, load_frozen_params=True)
            check("sync: weights back, gradients away", not st.paused("params") and st.paused("grads"))
        sent.append(
            {k: v.detach().clone() for k, v in ddp.state_dict().items() if isinstance(v, torch.Tensor)}
        )
        if offload:
            e.to("cpu", model=True, optimizer=False, grad=False)
            check("away in rollout", st.paused("params") and all(r.paused for r in st.regions("params")))
        with e.eval_mode(), torch.no_grad():
            if offload:
                check("eval: weights back", not st.paused("params"))
                check("eval: gradients and optimizer away", st.paused("grads") and st.paused("optimizer"))
            logits.append(ddp(tr.tok, tr.pos, tr.mask).detach().clone())
        with e.train_mode():
            if offload:
                check("train: all back", not any(st.paused(c) for c in ("params", "grads", "optimizer")))
            for c in e.module:
                c.zero_grad_buffer()
            loss = ddp(tr.tok, tr.pos, tr.mask, labels=tr.tok).float().mean()
            loss.backward()
            finalize_model_grads(e.module)
            e.optimizer_step()
            losses.append(loss.detach().clone())
        if offload:
            check("all away after train", all(st.paused(c) for c in ("params", "grads", "optimizer")))
            check("away: resident bytes 0", all(r.resident_bytes == 0 for r in st.regions()))
    final = [p.detach().clone() for p in ddp.parameters()]
    final += [m.detach().clone() for m in e.optimizer.main]
    for s_ in e.optimizer.optimizer.state_dict()["state"].values():
        final += [v.detach().clone() for v in s_.values() if isinstance(v, torch.Tensor)]
    return {"sent": sent, "logits": logits, "losses": losses, "final": final}


def worker(rank: int, world: int, port: int, out: str, kind: str) -> None:
    comms = os.environ.get("RLMEM_VERL_COMMS") == "suspend"
    with rank_group("gloo", rank, world, port):
        # verl's import (here, of its platform) loads rlmem.integrations.verl from VERL_USE_EXTERNAL_MODULES,
        # which patches the engine module as it is imported
        host_platform()
        import verl.workers.engine.fsdp.transformer_impl

        if comms:
            from _comm import HostDriver

            from rlmem.comm._suspend import registry

            registry.driver = HostDriver()
            import verl.workers.engine_workers
        import rlmem.integrations.verl as rv

        expected: dict[str, list[str]] = {}
        for mod, dotted in rv.SIGNATURES:
            expected.setdefault(mod, []).append(dotted)
        res: dict[str, Any] = {"patched": rv.patched(), "signatures": expected}
        res["settings"] = vars(rv.settings())
        checks: dict[str, list[bool]] = {}
        if kind == "megatron":
            import verl.workers.engine.megatron.transformer_impl  # noqa: F401

            # Megatron's DDP makes its buffers on torch.cuda.current_device(): here, the host
            torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
            ref = replay_megatron(False, {})
            got = replay_megatron(True, checks)
        else:
            ref = replay(kind, world, False, False, {})
            got = replay(kind, world, True, comms, checks)
        res["checks"] = checks
        res["sent equal"] = all(
            a.keys() == b.keys() and same_tensors(list(a.values()), list(b.values()))
            for a, b in zip(ref["sent"], got["sent"], strict=True)
        )
        for key in ("logits", "losses"):
            res[f"{key} equal"] = same_tensors(ref[key], got[key])
        res["sent names"] = sorted(got["sent"][0])
        res["final equal"] = same_tensors(ref["final"], got["final"])
        res["final tensors"] = len(got["final"])
        if kind == "fsdp1":
            # a layout TrainState cannot adopt: refused at verl's first offload, naming it, nothing moved
            from torch.distributed.fsdp import CPUOffload

            e = engine(kind, world, True, cpu_offload=CPUOffload(offload_params=True))
            where = [p.data_ptr() for p in e.module.parameters()]
            try:
                e.to("cpu", model=True, optimizer=True, grad=True)
                res["refusal"] = ""
            except ValueError as err:
                res["refusal"] = str(err)
            res["refused untouched"] = [p.data_ptr() for p in e.module.parameters()] == where
            res["refused adopted"] = rv.state_of(e) is not None
        if comms:
            res["rollout calls"] = getattr(switch_to_rollout, "calls", [])
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f, default=str)


if __name__ == "__main__":
    out, kind = sys.argv[1], sys.argv[2]
    spawn_ranks(worker, int(sys.argv[3]) if len(sys.argv) > 3 else 2, out, kind)
