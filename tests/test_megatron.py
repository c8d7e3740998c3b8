"""Megatron-Core: its DDP buffers, main parameters and optimizer states under TrainState / PhaseManager, and
its TransformerLayer's activation names. Each test runs Megatron in a fresh process (it keeps global
parallel state). On the CPU, three things Megatron assumes a GPU for are redirected so that its real
``GPTModel`` and ``DistributedDataParallel`` run on the host backend: the device buffers are made on, the
CUDA RNG tracker's fork (dropout is 0), and the default causal mask (passed explicitly). Megatron's
optimizers hard-code CUDA tensors, so on the CPU the optimizer is a stand-in with the same structure (an
inner ``torch.optim.AdamW`` over fp32 main-parameter clones); the real one runs in the CUDA tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _helpers import free_port, gpu_worlds, run_fresh

pytest.importorskip("megatron.core")


_PRELUDE = """
import contextlib, json, os, torch
os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "__PORT__"
DEV = "__DEVICE__"
if DEV == "cpu":
    torch.cuda.current_device = lambda: "cpu"  # where Megatron's DDP makes its buffers
import torch.distributed as dist
dist.init_process_group("gloo" if DEV == "cpu" else "nccl", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(1, 1)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
if DEV == "cpu":
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
else:
    model_parallel_cuda_manual_seed(0)
from megatron.core.transformer import TransformerConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.distributed import DistributedDataParallel as DDP, DistributedDataParallelConfig
import rlmem

def build(seed, experts=None, layers=2, hidden=64):
    torch.manual_seed(seed)
    if DEV == "cuda":
        model_parallel_cuda_manual_seed(seed)
    kw = dict(bf16=True, params_dtype=torch.bfloat16) if DEV == "cuda" else {}
    if experts:
        kw.update(num_moe_experts=experts, moe_router_topk=2, moe_grouped_gemm=False)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=32)
    if DEV == "cuda":  # bf16, as Megatron trainers run it
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(cfg, model.cuda())
    return cfg, model.to(DEV)

g = torch.Generator().manual_seed(1)
TOK = torch.randint(0, 128, (2, 16), generator=g).to(DEV)
POS = torch.arange(16, device=DEV).expand(2, 16)
MASK = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool, device=DEV), 1)

def loss_of(model):
    return model(TOK, POS, MASK, labels=TOK).float().mean()

def bits(t):
    return t.detach().reshape(-1).view(torch.uint8).cpu()

def step(ddp, opt):
    # one training step as a Megatron trainer takes it
    ddp.zero_grad_buffer()
    if hasattr(opt, "zero_grad"):
        opt.zero_grad()
    loss = loss_of(ddp)
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    return float(loss)
"""


def _run(body: str, device: str = "cpu", timeout: float = 600) -> dict:
    code = _PRELUDE.replace("__PORT__", str(free_port())).replace("__DEVICE__", device) + body
    return run_fresh(code, timeout=timeout)


def test_modmap_recognises_megatron_transformer_layer():
    out = _run(
        """
from rlmem.activations.modmap import find_module_map
_, dense = build(0)
lm = find_module_map(dense)
_, moe = build(0, experts=4)
mm = find_module_map(moe)
errors = {}
for names in (["moe_act"], ["attn_proj"], ["mlp"]):
    try:
        rlmem.offload_activations(moe, names)
    except ValueError as e:
        errors[names[0]] = str(e)
print(json.dumps({
    "names": lm.names(), "layers": [p for p, _ in lm.layers],
    "paths": {n: [t.path for t in ts] for n, ts in lm.targets.items()},
    "hidden": lm.hidden_size, "moe_names": mm.names(),
    "expert_fc1": [t.path for t in mm.targets["expert_fc1"]], "errors": errors,
}))
"""
    )
    assert out["names"] == ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
    assert out["layers"] == ["decoder.layers.0", "decoder.layers.1"]
    assert out["paths"]["core_attn"] == [f"decoder.layers.{i}.self_attention.core_attention" for i in (0, 1)]
    assert out["paths"]["attn_proj"][1] == "decoder.layers.1.self_attention.linear_proj"
    assert out["paths"]["qkv_linear"][0] == "decoder.layers.0.self_attention.linear_qkv"
    assert out["paths"]["attn_norm"][0] == "decoder.layers.0.input_layernorm"
    assert out["paths"]["mlp_norm"][0] == "decoder.layers.0.pre_mlp_layernorm"
    assert out["hidden"] == 64
    # The MoE model is built, not run (megatron-core 0.16.1's MoE layer needs Transformer Engine to run).
    assert out["moe_names"] == ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1"]
    assert len(out["expert_fc1"]) == 8
    assert out["expert_fc1"][5] == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1"
    assert "has no moe_act" in out["errors"]["moe_act"]
    assert "'attn_proj' requires 'core_attn'" in out["errors"]["attn_proj"]
    assert "unknown name" in out["errors"]["mlp"]


_ACT = """
from rlmem.activations.modmap import DENSE_NAMES
_, ref = build(0)
_, model = build(0)
loss_of(ref).backward()
with rlmem.offload_activations(model, list(DENSE_NAMES), min_bytes=0) as h:
    loss_of(model).backward()
same = all(torch.equal(bits(a.grad if a.grad is not None else a.main_grad),
                       bits(b.grad if b.grad is not None else b.main_grad))
           for a, b in zip(ref.parameters(), model.parameters()))
by_name = h.stats().by_name
print(json.dumps({"same": same, "by_name": {n: by_name.get(n, 0) for n in DENSE_NAMES}}))
"""


def test_activation_offload_grads_bit_equal_cpu():
    out = _run(_ACT)
    assert out["same"]
    assert all(n > 0 for name, n in out["by_name"].items() if name != "attn_proj"), out["by_name"]


@pytest.mark.cuda
def test_activation_offload_grads_bit_equal_cuda():
    out = _run(_ACT, "cuda")
    assert out["same"]
    assert all(n > 0 for name, n in out["by_name"].items() if name != "attn_proj"), out["by_name"]


# A stand-in for Megatron's mixed-precision optimizer on the CPU: the same structure (a wrapper whose inner
# torch optimizer holds fp32 clones, the main parameters, stepped from the DDP's main_grad).
_MIXED = """
class MixedPrecision:
    def __init__(self, chunks):
        self.model_params = [p for c in chunks for p in c.parameters()]
        self.main = [p.detach().clone().float() for p in self.model_params]
        self.optimizer = torch.optim.AdamW(self.main, lr=1e-2)
    def step(self):
        for p, m in zip(self.model_params, self.main):
            m.grad = p.main_grad.float().clone()
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.model_params, self.main):
                p.copy_(m)

"""

_CPU_STATE = (
    _MIXED
    + """
def trainer(seed):
    cfg, model = build(seed)
    ddp = DDP(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    return ddp, MixedPrecision([ddp])

ref, ref_opt = trainer(0)
ref_losses = [step(ref, ref_opt) for _ in range(4)]

ddp, opt = trainer(0)
buf = ddp.buffers[0]
ptrs = (buf.param_data.data_ptr(), buf.grad_data.data_ptr())
st = rlmem.TrainState(ddp, opt)
cats = {c: s.bytes for c, s in st.stats().categories.items()}
adopted = (buf.param_data.data_ptr(), buf.grad_data.data_ptr())
r0 = st.regions("params")[0]
inside = all(r0.data_ptr <= p.data_ptr() < r0.data_ptr + r0.nbytes for p in ddp.parameters())
mg_ptrs = [p.main_grad.data_ptr() for p in ddp.parameters()]
bucket_ptrs = [(b.param_data.data_ptr(), b.grad_data.data_ptr()) for b in buf.buckets]
errors = {}
for kw in ({"optimizer": "discard"}, {"params": "discard"}):
    try:
        st.offload(**kw)
    except ValueError as e:
        errors[next(iter(kw))] = str(e)
losses, checks = [], []
for k in range(4):
    losses.append(step(ddp, opt))
    late_view = buf.grad_data[:8]  # made after adoption, as Megatron's shard views are
    grads_before = buf.grad_data.clone()
    params_before = [p.detach().clone() for p in ddp.parameters()]
    main_before = [m.clone() for m in opt.main]
    policy = "discard" if k % 2 == 0 else "offload"
    st.offload(params="offload", grads=policy, optimizer="offload", blocking=k < 2)
    s = st.stats().categories
    checks.append({
        "resident": sum(c.resident_bytes for c in s.values()),
        "params_read": all(torch.equal(a, b) for a, b in zip(ddp.parameters(), params_before)),
        "main_read": all(torch.equal(a, b) for a, b in zip(opt.main, main_before)),
        "grads_read": bool(torch.equal(buf.grad_data, grads_before)) if policy == "offload"
                      else bool((buf.grad_data == 0).all() and (late_view == 0).all()),
        "late_view_away": late_view.data_ptr() != adopted[1],
    })
    st.reload(blocking=k % 2 == 0)
    st.synchronize()
    checks[-1].update({
        "ptrs": (buf.param_data.data_ptr(), buf.grad_data.data_ptr()) == adopted
                and [p.main_grad.data_ptr() for p in ddp.parameters()] == mg_ptrs
                and [(b.param_data.data_ptr(), b.grad_data.data_ptr()) for b in buf.buckets] == bucket_ptrs
                and late_view.data_ptr() == adopted[1],
        "grads_back": bool(torch.equal(buf.grad_data, grads_before)) if policy == "offload"
                      else bool((buf.grad_data == 0).all()),
    })
same_params = all(torch.equal(bits(a), bits(b)) for a, b in zip(ref.parameters(), ddp.parameters()))
same_main = all(torch.equal(bits(a), bits(b)) for a, b in zip(ref_opt.main, opt.main))
st.close()
after_close = step(ddp, opt) == step(ref, ref_opt)
print(json.dumps({
    "ref": ref_losses, "losses": losses, "checks": checks, "cats": cats, "errors": errors,
    "moved": adopted != ptrs, "inside": inside, "same_params": same_params, "same_main": same_main,
    "buffer_bytes": [buf.param_data.numel() * buf.param_data.element_size(),
                     buf.grad_data.numel() * buf.grad_data.element_size()],
    "main_bytes": sum(m.numel() * 4 for m in opt.main), "after_close": after_close,
}))
"""
)


def test_ddp_buffers_and_main_params_adopted_whole_cpu():
    out = _run(_CPU_STATE)
    assert out["losses"] == out["ref"]
    assert out["same_params"] and out["same_main"] and out["after_close"]
    assert out["moved"] and out["inside"]
    # one storage per buffer: the categories hold exactly the buffers (and main params + AdamW states)
    assert out["cats"]["params"] == out["buffer_bytes"][0]
    assert out["cats"]["grads"] == out["buffer_bytes"][1]
    assert out["cats"]["optimizer"] >= out["main_bytes"]
    for c in out["checks"]:
        assert c == {**c, "resident": 0, "params_read": True, "main_read": True, "grads_read": True}
        assert c["late_view_away"] and c["ptrs"] and c["grads_back"]
    assert "Megatron-Core's fp32 main parameters" in out["errors"]["optimizer"]
    assert "Megatron-Core's contiguous parameter buffers" in out["errors"]["params"]


_CUDA_TRAIN = """
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
KIND = "__KIND__"
DIST = KIND == "distributed"

def trainer(seed):
    if KIND == "fp32":  # an fp32 model: FP32Optimizer
        torch.manual_seed(seed); model_parallel_cuda_manual_seed(seed)
        cfg = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=4,
                                use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                         max_sequence_length=32).cuda()
    else:
        cfg, model = build(seed, layers=4, hidden=256)
    ddp = DDP(cfg, DistributedDataParallelConfig(use_distributed_optimizer=DIST, grad_reduce_in_fp32=True,
                                                 overlap_grad_reduce=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=KIND != "fp32",
                                                 use_distributed_optimizer=DIST), [ddp])
    return ddp, opt

ref, ref_opt = trainer(0)
ref_losses = [step(ref, ref_opt) for _ in range(5)]
ddp, opt = trainer(0)
buf = ddp.buffers[0]
pm = rlmem.PhaseManager(ddp, opt, rlmem.OffloadConfig(offload_during_rollout=True))
mg_ptrs = [p.main_grad.data_ptr() for p in ddp.parameters()]
kinds = sorted({type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])})
losses, freed, resident = [], [], []
for k in range(5):
    with pm.train():
        losses.append(step(ddp, opt))
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    with pm.rollout():
        freed.append(torch.cuda.mem_get_info()[0] - before)
        resident.append(sum(c.resident_bytes for c in pm.stats().state.categories.values()))
        zeros = bool((buf.grad_data == 0).all())
with pm.train():
    pass
torch.cuda.synchronize()
adopted = sum(c.bytes for c in pm.stats().state.categories.values())
same = all(torch.equal(bits(a), bits(b)) for a, b in zip(ref.parameters(), ddp.parameters()))
print(json.dumps({
    "ref": ref_losses, "losses": losses, "same_params": same, "freed": freed, "resident": resident,
    "adopted": adopted, "kinds": kinds, "zeros": zeros,
    "mg_ptrs": [p.main_grad.data_ptr() for p in ddp.parameters()] == mg_ptrs,
}))
"""


@pytest.mark.cuda
@pytest.mark.parametrize(
    "kind,optimizer",
    [
        ("distributed", "DistributedOptimizer"),
        ("float16", "Float16OptimizerWithFloat16Params"),
        ("fp32", "FP32Optimizer"),
    ],
)
def test_megatron_trainer_bit_identical_cuda(kind, optimizer):
    out = _run(_CUDA_TRAIN.replace("__KIND__", kind), "cuda")
    assert optimizer in out["kinds"]
    assert out["losses"] == out["ref"]
    assert out["same_params"] and out["mg_ptrs"] and out["zeros"]
    assert all(r == 0 for r in out["resident"])
    assert min(out["freed"]) >= 0.99 * out["adopted"] - (64 << 20)  # give or take the allocator's cache


def _example(*launcher: str) -> subprocess.CompletedProcess:
    from _helpers import ROOT, run_launcher

    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "MASTER_PORT": str(free_port())}
    argv = [*launcher, str(ROOT / "examples" / "megatron_colocated.py"), "--steps", "2"]
    return run_launcher(argv + (["--tp", "2"] if len(launcher) > 1 else []), timeout=600, env=env)


@pytest.mark.parametrize("world", gpu_worlds(2, 4))
def test_example_runs_tensor_parallel_on_gpus(world):
    # --tp 2 throughout: at four ranks, two tensor-parallel groups side by side (data parallel over them)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    proc = _example(*run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
    assert len(lines) == 2 and "rollout freed" in lines[0]


@pytest.mark.cuda
def test_example_runs_cuda():
    proc = _example(sys.executable)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("step ")]
    assert len(lines) == 2 and "rollout freed" in lines[0]


_CHUNKS = (
    _MIXED
    + """
def chunks(seed):
    out = []
    for k in range(2):
        cfg, model = build(seed + k)
        out.append(DDP(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model))
    return out, MixedPrecision(out)

def steps(cs, opt, n, st=None):
    losses = []
    for _ in range(n):
        for c in cs:
            c.zero_grad_buffer()
        loss = sum(loss_of(c) for c in cs)
        loss.backward()
        for c in cs:
            c.finish_grad_sync()
        opt.step()
        losses.append(float(loss))
        if st is not None:
            st.offload(blocking=True)
            st.reload(blocking=True)
    return losses

ref, ref_opt = chunks(0)
cs, opt = chunks(0)
st = rlmem.TrainState(cs, opt)
buffers = [c.buffers[0] for c in cs]
regions = {c: len(st.regions(c)) for c in ("params", "grads")}
out = {"ref": steps(ref, ref_opt, 3), "got": steps(cs, opt, 3, st), "regions": regions,
       "same": all(torch.equal(bits(a), bits(b)) for a, b in zip(ref_opt.main, opt.main))}
print(json.dumps(out))
"""
)


def test_list_of_model_chunks_cpu():
    out = _run(_CHUNKS)
    assert out["got"] == out["ref"] and out["same"]
    # one Region per category and device, holding both chunks' buffers
    assert out["regions"] == {"params": 1, "grads": 1}
