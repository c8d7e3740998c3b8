"""The layouts of ``rlmem bench megatron_parallel`` and one rank's Megatron-Core trainer for each.

A layout is a tensor x pipeline x data parallel grid (world size ``tp * pp * dp``), optionally with sequence
parallelism or a virtual pipeline (``vp`` model chunks per stage, stepped by Megatron's interleaved 1F1B
schedule). The other pipelined layouts take one micro-batch through the stages with ``send`` / ``recv``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, NamedTuple

import torch


class Layout(NamedTuple):
    """One parallel layout: sizes of the tensor, pipeline and data parallel groups."""

    tp: int
    pp: int
    dp: int = 1
    sp: bool = False  # sequence parallel
    vp: int | None = None  # model chunks per pipeline stage (interleaved schedule)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


LAYOUTS = {
    "tp2": Layout(2, 1),
    "tp2-sp": Layout(2, 1, sp=True),
    "pp2": Layout(1, 2),
    "dp2": Layout(1, 1, dp=2),
    "tp2pp2": Layout(2, 2),
    "tp4": Layout(4, 1),
    "tp2pp2-vpp": Layout(2, 2, vp=2),
}


def shape_error(layout: str, shape: dict[str, int]) -> str | None:
    """Why ``shape`` cannot be split by ``layout`` (None when it can)."""
    lay = LAYOUTS[layout]
    stages = lay.pp * (lay.vp or 1)
    if shape["heads"] % lay.tp or shape["vocab"] % lay.tp:
        return f"{layout}: heads and vocab must divide by tp={lay.tp}"
    if shape["layers"] % stages:
        return f"{layout}: layers must divide by {stages} (pipeline stages x model chunks)"
    if lay.vp and shape["batch"] % lay.pp:
        return f"{layout}: batch must divide by pp={lay.pp} (one micro-batch per stage)"
    return None


def chunks(model: Any) -> list[Any]:
    """The model chunks of a trainer (one unless a virtual pipeline)."""
    return list(model) if isinstance(model, list) else [model]


def parameters(model: Any) -> list[torch.Tensor]:
    return [q for c in chunks(model) for q in c.parameters()]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


class _MixedPrecision:
    """Megatron's mixed-precision optimizer's structure (fp32 main parameters under AdamW), for the CPU."""

    def __init__(self, model: Any) -> None:
        self.model_params = parameters(model)
        self.main = [q.detach().clone().float() for q in self.model_params]
        self.optimizer = torch.optim.AdamW(self.main, lr=1e-2)

    def zero_grad(self) -> None:
        pass

    def step(self) -> None:
        for q, m in zip(self.model_params, self.main, strict=True):
            m.grad = q.main_grad.float().clone()
        self.optimizer.step()
        with torch.no_grad():
            for q, m in zip(self.model_params, self.main, strict=True):
                q.copy_(m)


def _layer_spec(cfg: Any) -> Any:
    """Megatron's local layer spec; under sequence parallel with torch's norms (Megatron's own refuses it
    without Transformer Engine or Apex), whose weights are marked so that ``finalize_model_grads`` sums their
    gradients over the tensor-parallel ranks (each saw its part of the sequence)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec()
    if not cfg.sequence_parallel:
        return spec
    assert cfg.pipeline_model_parallel_size == 1  # the block's layers below are all of the model's
    norms = dict(input_layernorm=_SequenceParallelNorm, pre_mlp_layernorm=_SequenceParallelNorm)
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **norms))
    return TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers, layer_norm=_SequenceParallelNorm)


class _SequenceParallelNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` as a Megatron norm module, its weights marked ``sequence_parallel``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        assert config.normalization == "LayerNorm"
        super().__init__(hidden_size, eps=eps)
        for w in self.parameters():
            w.sequence_parallel = config.sequence_parallel


def _schedules_on_host() -> None:
    """Megatron's schedules make their token counter on ``"cuda"`` whatever the device: on the CPU they get a
    ``torch`` of their own whose ``zeros`` puts it on the host."""
    from megatron.core.pipeline_parallel import schedules

    host = types.ModuleType("torch")
    host.__dict__.update(torch.__dict__)

    def zeros(*size: Any, device: Any = None, **kw: Any) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kw)

    host.zeros = zeros  # type: ignore[attr-defined]
    schedules.torch = host  # type: ignore[attr-defined]


class Trainer:
    """One rank's model and data for ``layout``: :meth:`build` makes a trainer, :meth:`step` steps it."""

    def __init__(self, layout: str, shape: dict[str, int], device: torch.device) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.lay = LAYOUTS[layout]
        self.tp, self.pp, self.sp = self.lay.tp, self.lay.pp, self.lay.sp
        self.layout, self.shape, self.device = layout, shape, device
        self.cuda = device.type == "cuda"
        ps.initialize_model_parallel(self.tp, self.pp, virtual_pipeline_model_parallel_size=self.lay.vp)
        if not self.cuda:
            get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
            if self.lay.vp:
                _schedules_on_host()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.prev, self.next = (
            ps.get_pipeline_model_parallel_prev_rank(),
            ps.get_pipeline_model_parallel_next_rank(),
        )
        b, s = shape["batch"], shape["seq"]
        g = torch.Generator().manual_seed(1 + ps.get_data_parallel_rank())  # dp: each replica its own data
        self.tok = torch.randint(0, shape["vocab"], (b, s), generator=g).to(device)
        self.pos = torch.arange(s, device=device).expand(b, s)
        self.mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), 1)
        self.dtype = torch.bfloat16 if self.cuda else torch.float32

    @property
    def stage(self) -> str:
        return "whole" if self.pp == 1 else "first" if self.first else "last" if self.last else "middle"

    def build(self, seed: int) -> tuple[Any, Any]:
        """The DDP-wrapped model (the list of its chunks under a virtual pipeline) and its optimizer."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        sh = self.shape
        torch.manual_seed(seed)
        if self.cuda:
            model_parallel_cuda_manual_seed(seed)
        precision = dict(bf16=True, params_dtype=torch.bfloat16) if self.cuda else {}
        cfg = TransformerConfig(
            num_layers=sh["layers"],
            hidden_size=sh["hidden"],
            num_attention_heads=sh["heads"],
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.lay.vp,
            pipeline_dtype=self.dtype,
            sequence_parallel=self.sp,
            # Gloo has no batched send / recv; on NCCL Megatron's default
            batch_p2p_comm=self.cuda,
            **precision,
        )
        ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=self.cuda, grad_reduce_in_fp32=True)
        out = []
        for vp_stage in range(self.lay.vp) if self.lay.vp else [None]:
            model: Any = GPTModel(
                config=cfg,
                transformer_layer_spec=_layer_spec(cfg),
                vocab_size=sh["vocab"],
                max_sequence_length=sh["seq"],
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
            ).to(self.device)
            if self.cuda:
                from megatron.core.transformer.module import Float16Module

                model = Float16Module(cfg, model)
            out.append(DistributedDataParallel(cfg, ddp_cfg, model))
        ddp = out if self.lay.vp else out[0]
        if not self.cuda:
            return ddp, _MixedPrecision(ddp)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ocfg = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True)
        return ddp, get_megatron_optimizer(ocfg, out)

    def step(self, ddp: Any, opt: Any) -> float:
        """One step as a Megatron trainer takes it (pipelined: the first stage sends its output to the next,
        the last sends back its gradient; with a virtual pipeline Megatron's interleaved schedule over one
        micro-batch per stage); the loss, the same on every rank."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        for c in chunks(ddp):
            c.zero_grad_buffer()
        opt.zero_grad()
        if self.lay.vp:
            loss = self._interleaved(ddp)
        elif self.pp == 1:
            loss = ddp(self.tok, self.pos, self.mask, labels=self.tok).float().mean()
            loss.backward()
        elif self.first:
            out = ddp(self.tok, self.pos, self.mask)
            dist.send(out.detach().contiguous(), self.next)
            grad = torch.empty_like(out)
            dist.recv(grad, self.next)
            out.backward(grad)
            loss = torch.zeros((), device=self.device)
        else:
            assert self.last  # two stages: no middle one
            sh = self.shape
            inp = torch.empty(sh["seq"], sh["batch"], sh["hidden"], device=self.device, dtype=self.dtype)
            dist.recv(inp, self.prev)
            inp.requires_grad_(True)
            ddp.module.set_input_tensor(inp)
            loss = ddp(None, self.pos, self.mask, labels=self.tok).float().mean()
            loss.backward()
            dist.send(inp.grad.contiguous(), self.prev)
        # the data-parallel reduction, and with sequence parallel the sum of the norms' gradients over TP
        finalize_model_grads(chunks(ddp))
        opt.step()
        loss = loss.detach().reshape(1).to(self.device)
        if self.pp > 1:  # the last stage's
            src = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(loss, src, group=ps.get_pipeline_model_parallel_group())
        if self.lay.dp > 1:  # each replica its own data: the mean
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            loss /= self.lay.dp
        return float(loss)

    def _interleaved(self, ddp: list[Any]) -> torch.Tensor:
        """Forward and backward through Megatron's interleaved schedule, the batch split in one micro-batch
        per stage (the fewest it takes); the mean of the micro-batches' losses on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = self.pp
        mb = self.shape["batch"] // n
        micro = [(self.tok[i * mb : (i + 1) * mb], self.pos[i * mb : (i + 1) * mb]) for i in range(n)]

        def forward_step(it: Any, model: Any) -> tuple[torch.Tensor, Any]:
            tok, pos = next(it)
            out = model(tok, pos, self.mask, labels=tok)  # the labels count on the last chunk only

            def loss_func(o: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                loss = o.float().mean()
                return loss, {"loss": loss.detach().clone()}  # the schedule scales loss in place

            return out, loss_func

        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro) for _ in ddp],
            model=ddp,
            num_microbatches=n,
            seq_length=self.shape["seq"],
            micro_batch_size=mb,
        )
        if not losses:  # not the last stage
            return torch.zeros((), device=self.device)
        return torch.stack([x["loss"] for x in losses]).mean()

    def activations(self) -> tuple[bool, int]:
        """One step's gradients with every Megatron activation name offloaded equal those without; the
        bytes offloaded (whole models only)."""
        from .. import offload_activations
        from ..activations.modmap import DENSE_NAMES

        assert self.pp == 1
        grads, moved = [], 0
        for offload in (False, True):
            ddp, _ = self.build(0)
            ddp.zero_grad_buffer()
            inner = ddp.module.module if self.cuda else ddp.module
            h = offload_activations(inner, list(DENSE_NAMES), min_bytes=0) if offload else None
            with h or contextlib.nullcontext():
                ddp(self.tok, self.pos, self.mask, labels=self.tok).float().mean().backward()
            grads.append([bits(q.main_grad) for q in ddp.parameters()])
            if h is not None:
                moved = h.stats().as_dict()["offloaded_bytes"]
                h.remove()
            del ddp
        return all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), moved
