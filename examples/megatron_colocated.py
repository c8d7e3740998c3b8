"""A Megatron-Core trainer with a rollout phase on the same GPU, wired with rlmem as a Megatron user would.

The policy is a ``GPTModel`` wrapped in Megatron's ``DistributedDataParallel`` with the distributed
optimizer (``get_megatron_optimizer``, bf16, fp32 main parameters). Each step samples completions (the
rollout), scores them with a toy reward (how often a target token appears), and takes a group-normalised
policy-gradient step. One flag, ``OffloadConfig(offload_during_rollout=True)``, gives the trainer's idle
state back during rollout: here the rollout runs on the training model itself, so its parameters stay
(``params="keep"``) and the gradient buffer, the fp32 main parameters and the Adam states (16 of the 18
bytes per parameter) go to host memory; ``pm.prefetch()`` brings them back while the rewards are computed.
With a separate rollout engine (anything with ``sleep()`` / ``wake()``, e.g. vLLM), register it with
``pm.add_engine(engine)`` and offload the parameters too.

Run (one GPU; under ``torchrun --nproc-per-node N`` for data parallelism, ``--tp`` for tensor parallelism)::

    pip install -e ".[megatron]"
    python examples/megatron_colocated.py --steps 3
    torchrun --nproc-per-node 2 examples/megatron_colocated.py --tp 2

Pipeline stages take Megatron's schedule (``get_forward_backward_func``) around the same ``pm.train()``;
``tests/megatron_parallel_rank.py`` runs two stages under ``TrainState``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import rlmem
from rlmem.integrations.megatron import state_bytes


def build(args: argparse.Namespace):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.vocab,
        max_sequence_length=args.prompt_len + args.new_tokens,
    ).cuda()
    model = Float16Module(config, model)  # bf16 compute, fp32 logits, as Megatron's trainers wrap it
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=True, use_distributed_optimizer=True), [ddp]
    )
    return ddp, opt


@torch.no_grad()
def sample(
    model, prompts: torch.Tensor, new_tokens: int, temperature: float, g: torch.Generator
) -> torch.Tensor:
    """Sampling by full recompute (no KV cache): enough for a small example. Under tensor parallelism each
    rank holds a slice of the vocabulary's logits: they are gathered, and the ranks of a tensor-parallel
    group draw with the same generator, so they sample the same tokens."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seqs = prompts
    for _ in range(new_tokens):
        pos = torch.arange(seqs.shape[1], device=seqs.device).expand_as(seqs)
        logits = gather_from_tensor_model_parallel_region(model(seqs, pos, None)[:, -1].float())
        nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)
        seqs = torch.cat([seqs, nxt], 1)
    return seqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--target-token", type=int, default=7, help="the toy reward counts this token")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    ddp, opt = build(args)
    held = state_bytes(ddp, opt)
    pm = rlmem.PhaseManager(ddp, opt, rlmem.OffloadConfig(offload_during_rollout=True, params="keep"))

    from megatron.core import parallel_state as ps

    # Prompts and samples by data-parallel rank: the ranks of one tensor-parallel group see the same ones.
    g = torch.Generator(device="cuda").manual_seed(args.seed + ps.get_data_parallel_rank())
    for step in range(args.steps):
        prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), device="cuda", generator=g)
        prompts = prompts.repeat_interleave(args.group, 0)
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        with pm.rollout():
            freed = torch.cuda.mem_get_info()[0] - before
            seqs = sample(ddp, prompts, args.new_tokens, temperature=1.0, g=g)
        pm.prefetch()  # the state comes back while the rewards are computed
        completions = seqs[:, args.prompt_len :]
        reward = (completions == args.target_token).float().mean(1)
        grouped = reward.view(args.prompts, args.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        with pm.train():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            inputs, targets = seqs[:, :-1], seqs[:, 1:]
            pos = torch.arange(inputs.shape[1], device="cuda").expand_as(inputs)
            logp = -ddp(inputs, pos, None, labels=targets).float()  # Megatron returns per-token NLL
            loss = -(adv[:, None] * logp[:, args.prompt_len - 1 :]).mean()
            loss.backward()
            ddp.finish_grad_sync()
            opt.step()
        if rank == 0:
            print(
                f"step {step}: reward {reward.mean().item():.3f} loss {loss.item():+.4f}  rollout freed "
                f"{freed / 2**20:.0f} MiB of the trainer's {held.total / 2**20:.0f} MiB",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
