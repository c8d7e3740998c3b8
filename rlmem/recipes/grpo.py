"""Co-located GRPO on one or several GPUs (or the CPU): the loop rlmem exists for, as one readable script.

Each step: **rollout** (the policy samples G completions per prompt into a KV cache that lives in a Region)
then **train** (group-normalised advantages, clipped policy-gradient loss over response tokens, optional KL
to a reference model, micro-batches, gradient clipping, AdamW). A :class:`~rlmem.PhaseManager` switches
the GPU between the two: during rollout the optimizer states go to pinned host memory and the gradients are
dropped, during training the KV cache is released. The reference model, when used, stays offloaded except
while it scores the batch.

Run ``rlmem train`` (defaults: an embedded tiny Qwen2-shaped model learning to sort digits) or
``rlmem train examples/grpo_tiny.yaml key=value ...``; with ``torchrun --nproc-per-node N -m rlmem train``
the policy is sharded with FSDP2 and each rank samples its share of the prompts.

Why one module of ~700 lines: the recipe is meant to be read top to bottom, as one loop; its config
validation and the helpers the loop calls sit beside it. What it records and prints is in ``_report.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._units import parse_bytes
from ..data.batching import token_budget_batches
from ..integrations.hf import HFSampler, kv_bytes_per_token
from ..monitor.timeline import MemoryTimeline
from ..plan import presets
from ..train.phases import OffloadConfig, PhaseManager
from ..train.state import TrainState
from . import _config, checkpoint
from ._report import _comm_figures, _max_used, _step_line, _summarize, _title, _track, report
from .config import TINY, GRPOConfig, _is_float, train_parser
from .data import PromptData, TextTokenizer, load_tokenizer
from .loggers import Loggers, Progress, parse_loggers
from .rewards import load_reward, score
from .task import CharTokenizer, SortDigitsTask

__all__ = ["GRPOConfig", "main", "report", "run"]

# -- set-up -------------------------------------------------------------------------------------------


def _setup_device(cfg: GRPOConfig) -> tuple[torch.device, int, int]:
    """(device, rank, world size); starts torch.distributed when launched by torchrun."""
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return torch.device(want, 0) if want == "cuda" else torch.device("cpu"), 0, 1
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if want == "cuda" else torch.device("cpu")
    if want == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kw = {"device_id": device} if want == "cuda" else {}
        dist.init_process_group("nccl" if want == "cuda" else "gloo", **kw)
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step ({cfg.prompts_per_step}) must be divisible by the {world} ranks")
    return device, dist.get_rank(), world


def build_policy(
    cfg: GRPOConfig, device: torch.device, dtype: torch.dtype, vocab: int, max_len: int = 0
) -> nn.Module:
    """The policy: the embedded tiny config, a named preset, or a local checkpoint; random init seeded."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.model == "tiny":
        conf = {**TINY, "max_position_embeddings": max(TINY["max_position_embeddings"], max_len)}
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**conf, vocab_size=vocab))
        return model.to(dtype)
    if cfg.model in presets.QWEN2:
        return presets.build(cfg.model, device, dtype, seed=cfg.seed)
    path = Path(cfg.model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model must be 'tiny', one of the presets {', '.join(presets.QWEN2)}, or a directory with a "
            f"config.json saved by save_pretrained; got {cfg.model!r}"
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ValueError(
            f"model: {str(path)!r} has a config.json but no weights (*.safetensors or *.bin); finish its "
            "download, or use a preset for random weights"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    if model.config.vocab_size < vocab:
        raise ValueError(
            f"model {cfg.model!r} has {model.config.vocab_size} tokens; the tokenizer or task needs {vocab}"
        )
    return model


def _shard(model: nn.Module, device: torch.device, world: int) -> None:
    """FSDP2: each decoder layer, then the root (so the embedding and head are sharded too). The mesh is on
    the run's device type (FSDP2 would default to CUDA on a machine that has it, even for CPU ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _materialize_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's states now (a zero-lr step on zero gradients, then the step counters reset), so that
    the memory the train phase holds is in place before the rollout sizes its KV cache. The next real step
    is then exactly a first step."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None
        step = opt.state[p].get("step")
        if torch.is_tensor(step):
            step.zero_()
        elif step is not None:
            opt.state[p]["step"] = 0


_ROLLOUT_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _kv_batch(cfg: GRPOConfig, model: nn.Module, n_seqs: int, max_len: int, dtype: torch.dtype) -> int:
    """Sequences the KV cache holds: what ``kv_budget`` affords, never more than the rollout needs."""
    per_seq = kv_bytes_per_token(model.config, dtype) * max_len
    if cfg.kv_budget is None:
        return n_seqs
    v = cfg.kv_budget
    if isinstance(v, float) or (isinstance(v, str) and _is_float(v)):
        dev = next(model.parameters()).device
        total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else _host_total()
        budget = int(float(v) * total)
    else:
        budget = parse_bytes(v, "kv_budget")
    if budget < per_seq:
        raise ValueError(
            f"kv_budget ({budget} bytes) holds less than one sequence of {max_len} tokens ({per_seq})"
        )
    return min(n_seqs, budget // per_seq)


def _host_total() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# -- the GRPO pieces ----------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + 1e-4): samples of a prompt are compared to each other."""
    g = rewards.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + 1e-4)).view(-1)


def make_batch(seqs: list[list[int]], prompt_lens: list[int], pad: int) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, and a mask over the targets that are completion tokens."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
    for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        resp[i, n - 1 : len(s) - 1] = 1.0  # target t+1 is a completion token
    return {"ids": ids, "attn": attn, "resp": resp}


def token_logprobs(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor, autocast: Any) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position, in fp32."""
    with autocast():
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    logits = logits.float()
    return logits.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)


def grpo_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    kl_coef: float,
    denom: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped policy-gradient loss plus ``kl_coef`` x KL (k3 estimator), summed over response tokens and
    divided by ``denom`` (the mini-batch's response tokens, so micro-batching does not change it).
    Returns (loss, summed KL)."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    pg = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.zeros_like(logp)
    if ref is not None:
        d = ref - logp
        kl = torch.exp(d) - d - 1
    per_tok = pg + kl_coef * kl
    return (per_tok * mask).sum() / denom, (kl.detach() * mask).sum()


# -- the loop -----------------------------------------------------------------------------------------


def run(cfg: GRPOConfig, *, echo: Any = print) -> dict[str, Any]:
    """Train with GRPO per ``cfg``; returns the summary that is also written to ``out_dir``.

    Raises:
        ValueError: bad configuration (model, device, budget).
        rlmem.OutOfMemoryError / torch.OutOfMemoryError: the KV cache or training does not fit.
    """
    t_run = time.perf_counter()
    device, rank, world = _setup_device(cfg)
    lead = rank == 0
    say = echo if lead else (lambda *a, **k: None)
    on_cuda = device.type == "cuda"
    precision = cfg.precision if cfg.precision != "auto" else ("bf16-mixed" if on_cuda else "fp32")
    param_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    amp_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    # fp16's narrow range needs dynamic loss scaling; a step whose gradients overflow is skipped.
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16-mixed" else None

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()

    offload = cfg.offload if cfg.offload is not None else on_cuda
    if cfg.comms == "suspend":
        if not (offload and on_cuda and world > 1):
            raise ValueError(
                "comms='suspend' releases NCCL communicators during rollout: it needs several ranks "
                f"(torchrun) on CUDA with offload on; this run has {world} rank(s) on {device.type}, offload "
                f"{'on' if offload else 'off'}"
            )
        from ..comm._suspend import registry

        drv = registry.get_driver()
        if not drv.can_suspend:
            # The rebuild fallback gives the group objects new communicators, but FSDP2's DTensor reductions
            # (gradient clipping) reach communicators by group name from C++, where they are gone.
            raise ValueError(
                f"comms='suspend' needs an NCCL that can suspend communicators (>= 2.29.7); this process "
                f"loaded {drv.describe}. Load a newer libnccl with LD_PRELOAD before torch starts, or use "
                "comms='keep'"
            )
    # The rollout's own reductions (evaluation) while the NCCL groups are suspended.
    ctl = dist.new_group(backend="gloo") if cfg.comms == "suspend" else None
    out = Path(cfg.out_dir)

    # The prompts: the embedded toy task, or the user's data through the model's tokenizer.
    tok = CharTokenizer()
    task = SortDigitsTask(min_digits=cfg.min_digits, max_digits=cfg.max_digits)
    data: PromptData | None = None
    eval_set: PromptData | None = None
    text_tok: TextTokenizer | None = None
    reward_spec = "sort_digits"
    if cfg.data is None:
        max_new = cfg.max_new_tokens or task.max_answer_tokens + 2
        max_len = 2 + task.max_digits + max_new  # BOS, digits, '=', completion
        vocab, pad_id, eos_id = tok.vocab_size, tok.PAD, tok.EOS
    else:
        text_tok = load_tokenizer(cfg.tokenizer or cfg.model, chat_template=cfg.chat_template)

        def read(path: str) -> PromptData:  # training and evaluation data are read the same way
            return PromptData(
                path,
                text_tok,
                prompt_key=cfg.prompt_key,
                answer_key=cfg.answer_key,
                max_prompt_len=cfg.max_prompt_len,
                seed=cfg.seed,
            )

        data = read(cfg.data)
        reward_spec = "math" if cfg.reward == "auto" else cfg.reward
        reward_fn = load_reward(reward_spec)
        first = data.examples[0]  # a reward that raises is caught here, before anything is written
        score(reward_fn, reward_spec, [first.prompt], [""], [first.answer], [first.row])
        max_new = cfg.max_new_tokens or 256
        max_len = data.longest + max_new
        if cfg.eval_data is not None:
            eval_set = read(cfg.eval_data)
            max_len = max(data.longest, eval_set.longest) + max_new
        vocab, pad_id, eos_id = text_tok.vocab_size, text_tok.pad_id, text_tok.eos_id
        say(
            f"data: {len(data)} prompts from {cfg.data} "
            f"({data.dropped} longer than max_prompt_len={cfg.max_prompt_len} dropped)"
        )

    # Policy, reference, optimizer.
    model = build_policy(cfg, device, param_dtype, vocab, max_len)
    if cfg.gradient_checkpointing:  # Hugging Face's switch (renamed in transformers 5.x)
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable()
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    if world > 1:
        _shard(model, device, world)
        if ref is not None:
            _shard(ref, device, world)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    _materialize_optimizer_state(opt)

    # Resume: weights, optimizer state, RNG, data position (the reference stays the initial policy).
    rng = random.Random(cfg.seed)
    start = 0
    if cfg.resume is not None:
        where = checkpoint.latest(out) if cfg.resume == "auto" else Path(cfg.resume)
        if where is None:
            say(f"resume=auto: no checkpoint in {out}; starting at step 0")
        else:
            st = checkpoint.load(where, model=model, optimizer=opt, world=world)
            start = int(st["step"])
            checkpoint.set_rng_state(rng, st["rng"])
            if data is not None and st.get("data") is not None:
                data.load_state_dict(st["data"])
            if scaler is not None and st.get("scaler"):
                scaler.load_state_dict(st["scaler"])
            say(f"resumed from {where} at step {start}")

    def save(done: int) -> Path:
        return checkpoint.save(
            out,
            step=done,
            model=model,
            optimizer=opt,
            tokenizer=text_tok,
            rng=rng,
            data=None if data is None else data.state_dict(),
            config=dataclasses.asdict(cfg),
            world=world,
            rank=rank,
            extra={"scaler": scaler.state_dict()} if scaler is not None else None,
        )

    # rlmem: one switch. During rollout the optimizer states go to pinned host memory and gradients are
    # dropped; the rollout runs on the policy's own weights (or on its rollout_dtype copy, which is synced
    # at every rollout, so the engine discards it while asleep instead of keeping it in host memory).
    pm = PhaseManager(
        model,
        opt,
        OffloadConfig(
            offload_during_rollout=offload,
            params="keep",
            grads="discard",
            optimizer="offload",
            engine_sleep_level=2 if cfg.rollout_dtype else 1,
            comms=cfg.comms,
            overlap_offload=cfg.overlap_offload,
        ),
    )
    ref_state = None
    if ref is not None and offload:
        ref_state = TrainState(ref, None, name="reference")
        ref_state.offload(params="offload", blocking=True)

    sampler: HFSampler | None = None
    tl = MemoryTimeline(device)
    _track(tl, model, opt, pm, ref, ref_state, lambda: sampler)

    prompts_rank = cfg.prompts_per_step // world
    n_seqs = prompts_rank * cfg.group_size
    say(
        f"rlmem GRPO | model {cfg.model} ({sum(p.numel() for p in model.parameters()) * world / 1e6:.2f}M "
        f"params{', FSDP2 x' + str(world) if world > 1 else ''}) | {device.type} | precision {precision} | "
        f"offload {'on' if offload else 'off'} | {cfg.steps} steps x {cfg.prompts_per_step} prompts x "
        f"{cfg.group_size} samples"
    )
    if lead:  # only now: a run refused above has written nothing over an earlier one
        out.mkdir(parents=True, exist_ok=True)
        _config.dump(cfg, out / "config.yaml")
    history: list[dict[str, Any]] = []
    # Only the lead reads the earlier log: it rewrites that file below, and another rank reading it meanwhile
    # could see it empty. Decisions every rank must agree on (the final save) count steps, not log rows.
    if lead and start and (out / "log.jsonl").is_file():
        rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
        history = [r for r in rows if r["step"] < start]
    log = None
    if lead:
        log = (out / "log.jsonl").open("w")
        for r in history:  # what the resumed run had logged, without the steps it is about to repeat
            log.write(json.dumps(r) + "\n")
    bar = Progress(cfg.steps, start, enabled=cfg.progress and lead)
    loggers = (
        Loggers(parse_loggers(cfg.logger), out, dataclasses.asdict(cfg), resume=bool(start)) if lead else None
    )
    saved_at = start if cfg.resume is not None and start else None
    completed = start
    updating = False
    interrupted = False
    stop = _Stop(say)  # Ctrl-C finishes the step in flight, then saves; a second one stops at once
    try:
        for step in range(start, cfg.steps):
            t_step = time.perf_counter()
            mine = slice(rank * prompts_rank, (rank + 1) * prompts_rank)
            if data is None:
                prompts = task.prompts(cfg.prompts_per_step, rng)[mine]
                prompt_ids = [tok.encode(p, bos=True) for p in prompts]
            else:
                exs = data.take(cfg.prompts_per_step)[mine]
                prompt_ids = [e.ids for e in exs]

            # ---- rollout ------------------------------------------------------------------------
            sync = sampler.sync_weights if sampler is not None else None
            # Under FSDP2 a rollout copy (rollout_dtype) holds the full weights and the model itself is not
            # run: it is gathered only to fill the copy, and sharded again at once.
            own_copy = cfg.rollout_dtype is not None
            if cfg.comms == "suspend":  # the weights are gathered while the communicators still work
                sync = functools.partial(
                    _gather_then, model, world, sync, reshard=own_copy and sampler is not None
                )
            with tl.phase("rollout", step) as ph_roll, pm.rollout(sync_weights=sync):
                switch_s = (pm.stats().switches.rollout_s or 0.0) if offload else 0.0
                model.eval()
                if sampler is None:  # sized once the train state has made room
                    kv_dtype = amp_dtype or _ROLLOUT_DTYPES[cfg.rollout_dtype] or param_dtype
                    batch = _kv_batch(cfg, model, n_seqs, max_len, kv_dtype)
                    sampler = HFSampler(
                        model,
                        max_len=max_len,
                        batch_size=batch,
                        pad_token_id=pad_id,
                        eos_token_id=eos_id,
                        compute_dtype=amp_dtype,
                        cuda_graphs=cfg.cuda_graphs,
                        rollout_dtype=_ROLLOUT_DTYPES[cfg.rollout_dtype],
                    )
                    pm.add_engine(sampler)
                    if own_copy:  # filled from the weights gathered above: FSDP's gathered copy can go
                        _set_reshard(model, True, world)
                tl.sample("rollout", step)  # the memory the rollout runs with, once the switch is done
                if not own_copy:
                    _set_reshard(model, False, world)
                t0 = time.perf_counter()
                group_prompts = [p for p in prompt_ids for _ in range(cfg.group_size)]
                comps = sampler.generate(
                    group_prompts,
                    max_new_tokens=max_new,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    seed=cfg.seed * 1_000_003 + step * world + rank,
                )
                if on_cuda:
                    torch.cuda.synchronize(device)
                rollout_s = time.perf_counter() - t0
                eval_reward = None
                if eval_set is not None and cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                    eval_reward = _evaluate(
                        eval_set, sampler, text_tok, reward_fn, reward_spec, max_new, rank, world, ctl
                    )
                if not own_copy:
                    _set_reshard(model, True, world)
                if data is None:
                    texts = [p for p in prompts for _ in range(cfg.group_size)]
                    rewards = torch.tensor(
                        [task.reward(p, c, tok) for p, c in zip(texts, comps, strict=True)]
                    )
                else:
                    grp = [e for e in exs for _ in range(cfg.group_size)]
                    outs = [text_tok.decode(c) for c in comps]  # type: ignore[union-attr]
                    got = score(
                        reward_fn,
                        reward_spec,
                        [e.prompt for e in grp],
                        outs,
                        [e.answer for e in grp],
                        [e.row for e in grp],
                    )
                    rewards = torch.tensor(got)
                tl.sample("rollout", step)
            ph_roll["tokens"] = sum(len(c) for c in comps)

            # ---- train --------------------------------------------------------------------------
            with tl.phase("train", step):
                t_train = time.perf_counter()
                with pm.train():
                    switch_s += (pm.stats().switches.train_s or 0.0) if offload else 0.0
                    tl.sample("train", step)
                    model.train()
                    adv = group_advantages(rewards, cfg.group_size)
                    seqs = [p + c for p, c in zip(group_prompts, comps, strict=True)]
                    b = make_batch(seqs, [len(p) for p in group_prompts], pad_id)
                    old, refs = _score(model, ref, ref_state, b, cfg.micro_batch_size, device, autocast)
                    tl.sample("train", step)
                    updating = True
                    trainer = _Trainer(model, opt, device, autocast, tl, world, scaler)
                    loss_sum, kl_sum, gnorm, skipped = _update(cfg, trainer, b, adv, old, refs, step)
                    updating = False
                if on_cuda:
                    torch.cuda.synchronize(device)
                train_s = time.perf_counter() - t_train

            # ---- log ----------------------------------------------------------------------------
            ntok = b["resp"].sum().item()
            stats = torch.tensor(
                [rewards.sum().item(), len(comps), loss_sum, kl_sum, ntok, ph_roll["tokens"]],
                dtype=torch.float64,
            )
            if world > 1:
                stats = stats.to(device)
                dist.all_reduce(stats)
                stats = stats.cpu()
            sw = pm.stats().switches if offload else None
            rec = {
                "step": step,
                "reward": stats[0].item() / stats[1].item(),
                "loss": stats[2].item() / world,
                "kl": stats[3].item() / max(stats[4].item(), 1),
                "grad_norm": gnorm,
                "tokens": int(stats[5].item()),
                "tokens_per_s": stats[5].item() / world / max(rollout_s, 1e-9),
                "rollout_s": rollout_s,
                "train_s": train_s,
                "switch_s": switch_s,
                "step_s": time.perf_counter() - t_step,
                "peak_rollout": tl.phases[-2].peak,
                "peak_train": tl.phases[-1].peak,
                "used_rollout": _max_used(tl, "rollout", step),
                "used_train": _max_used(tl, "train", step),
                "skipped_updates": skipped,
                **({"eval/reward": eval_reward} if eval_reward is not None else {}),
                "kv_batch": sampler.batch_size,
                "graph_captures": sampler.captures,  # so far: the same after step 0 unless the weights moved
                "kv_bytes": sampler.kv_bytes,
                **(_comm_figures(sw) if sw is not None and cfg.comms == "suspend" else {}),
                **({"overlapped": sw.overlapped} if sw is not None and cfg.overlap_offload else {}),
            }
            history.append(rec)
            completed = step + 1
            if log is not None:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            bar.clear()
            say(_step_line(rec, cfg.steps))
            bar.update(rec["reward"])
            if loggers is not None:
                loggers.log(rec)
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                save(step + 1)
                saved_at = step + 1
            if stop.agreed(device, world):
                interrupted = True
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop.restore()
        bar.close()
        if log is not None:
            log.close()
        if loggers is not None:
            loggers.close()

    done = completed
    if cfg.save_every != 0 and done and saved_at != done:
        if interrupted and updating:
            say(f"interrupted during an update: step {done + 1} is lost; no checkpoint written for it")
        else:
            say(f"checkpoint: {save(done)}")

    summary = _summarize(cfg, history, tl, offload, precision, world, device, time.perf_counter() - t_run)
    if lead:
        tl.save(out / "timeline.jsonl")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        say("")
        say(tl.report())
        if cfg.plot:
            try:
                say(f"timeline plot: {tl.plot(out / 'memory.png', title=_title(cfg, offload, device))}")
            except RuntimeError as e:
                say(f"(no plot: {e})")
        if history:
            say(
                f"reward: first 5 steps {summary['reward_first5']:.3f} -> last 5 steps "
                f"{summary['reward_last5']:.3f} | {summary['wall_s']:.1f} s | logs in {out}"
            )
        if interrupted:
            say(f"interrupted after {done} steps: log, timeline and summary in {out}")
    tl.check_leaks()
    if interrupted:
        raise KeyboardInterrupt
    return summary


def _score(
    model: nn.Module,
    ref: nn.Module | None,
    ref_state: TrainState | None,
    b: dict[str, torch.Tensor],
    mbs: int,
    device: torch.device,
    autocast: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the sampled tokens under the policy before the update (the ratio's denominator) and
    under the reference model, which is brought in for this and sent back right after."""

    @torch.no_grad()
    def score(m: nn.Module) -> torch.Tensor:
        parts = []
        for i in range(0, b["ids"].shape[0], mbs):
            ids, attn = b["ids"][i : i + mbs].to(device), b["attn"][i : i + mbs].to(device)
            parts.append(token_logprobs(m, ids, attn, autocast).cpu())
        return torch.cat(parts)

    old = score(model)
    if ref is None:
        return old, None
    if ref_state is not None:
        ref_state.reload(blocking=False)
    refs = score(ref)
    if ref_state is not None:
        ref_state.offload(params="offload", blocking=False)
    return old, refs


class _Stop:
    """The first SIGINT asks the loop to stop after the step in flight (so a checkpoint of whole steps can be
    written); a second one interrupts at once. Every rank stops at the same step: the request is
    all-reduced at the end of each step."""

    def __init__(self, say: Any) -> None:
        self.requested = False
        self._say = say
        self._old: Any = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._say("\nstopping after this step (Ctrl-C again to stop now)")

    def agreed(self, device: torch.device, world: int) -> bool:
        if world == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def _evaluate(
    eval_set: PromptData,
    sampler: HFSampler,
    tok: Any,
    reward_fn: Any,
    spec: str,
    max_new: int,
    rank: int,
    world: int,
    ctl: Any = None,
) -> float:
    """Mean reward of greedy completions of every evaluation prompt (each rank scores its share; summed
    over ``ctl``, a Gloo group, where the NCCL ones are suspended during rollout)."""
    mine = eval_set.examples[rank::world]
    comps = sampler.generate([e.ids for e in mine], max_new_tokens=max_new, temperature=0.0)
    got = score(
        reward_fn,
        spec,
        [e.prompt for e in mine],
        [tok.decode(c) for c in comps],
        [e.answer for e in mine],
        [e.row for e in mine],
    )
    total = torch.tensor([sum(got), len(got)], dtype=torch.float64)
    if world > 1 and ctl is not None:
        dist.all_reduce(total, group=ctl)
    elif world > 1:
        dev = next(sampler.model.parameters()).device
        total = total.to(dev)
        dist.all_reduce(total)
        total = total.cpu()
    return total[0].item() / max(total[1].item(), 1.0)


@dataclass
class _Trainer:
    """What an update needs besides the batch: the model and optimizer, where and how it computes, where
    memory is recorded, the ranks, and the loss scaler of fp16 (None otherwise)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    device: torch.device
    autocast: Any
    tl: MemoryTimeline
    world: int
    scaler: torch.amp.GradScaler | None


def _update(
    cfg: GRPOConfig,
    t: _Trainer,
    b: dict[str, torch.Tensor],
    adv: torch.Tensor,
    old: torch.Tensor,
    refs: torch.Tensor | None,
    step: int,
) -> tuple[float, float, float, int]:
    """``updates_per_step`` optimizer steps over a shuffled split of the batch, each from micro-batches.
    Returns (loss, summed KL, last gradient norm, optimizer steps skipped by the fp16 loss scaler)."""
    n = b["ids"].shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + step))
    minis = [m for m in order.tensor_split(cfg.updates_per_step) if m.numel()]
    loss_sum = kl_sum = 0.0
    gnorm = 0.0
    skipped = 0
    for mini in minis:
        denom = max(b["resp"][mini].sum().item(), 1.0)
        for mb in _micro_batches(cfg, b, mini, t.device, t.world):
            # Right-padded: a micro-batch needs only the columns of its longest sequence.
            w = int(b["attn"][mb].sum(1).max())
            ids, attn = b["ids"][mb, :w].to(t.device), b["attn"][mb, :w].to(t.device)
            mask = b["resp"][mb, : w - 1].to(t.device)
            logp = token_logprobs(t.model, ids, attn, t.autocast)
            loss, kl = grpo_loss(
                logp,
                old[mb, : w - 1].to(t.device),
                refs[mb, : w - 1].to(t.device) if refs is not None else None,
                adv[mb].to(t.device),
                mask,
                clip_eps=cfg.clip_eps,
                kl_coef=cfg.kl_coef,
                denom=denom,
            )
            (t.scaler.scale(loss) if t.scaler is not None else loss).backward()
            loss_sum += loss.item() / len(minis)
            kl_sum += kl.item()
        t.tl.sample("train", step)
        if t.scaler is not None:
            t.scaler.unscale_(t.opt)  # clip the true gradients
        norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), cfg.max_grad_norm)
        gnorm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if t.scaler is not None:
            before = t.scaler.get_scale()
            t.scaler.step(t.opt)
            t.scaler.update()
            skipped += int(t.scaler.get_scale() < before)  # the scale drops exactly when a step is skipped
        else:
            t.opt.step()
        t.opt.zero_grad()
        t.tl.sample("train", step)
    return loss_sum, kl_sum, gnorm, skipped


def _micro_batches(
    cfg: GRPOConfig, b: dict[str, torch.Tensor], mini: torch.Tensor, device: torch.device, world: int
) -> list[torch.Tensor]:
    """The mini-batch's micro-batches: ``micro_batch_size`` rows each, or by token budget (the same count on
    every rank, since FSDP's collectives need every rank to run as many forward/backward passes)."""
    if not cfg.dynamic_batching:
        return list(mini.split(cfg.micro_batch_size))
    lengths = b["attn"][mini].sum(1).tolist()
    budget = cfg.max_tokens_per_micro_batch
    parts = token_budget_batches(lengths, budget, padded=True)[0]
    if world > 1:
        t = torch.tensor([len(parts)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t.item()) > len(parts):  # another rank needs more: cut this one's as finely
            parts = token_budget_batches(lengths, budget, padded=True, min_micro_batches=int(t.item()))[0]
    return [mini[torch.tensor(p, dtype=torch.long)] for p in parts if p]


def _gather_then(
    model: nn.Module, world: int, then: Callable[[], Any] | None, *, reshard: bool = False
) -> None:
    """With the communicators about to be suspended for the rollout: FSDP gathers the weights now (the
    rollout keeps them gathered), then ``then`` (the engine's weight sync) runs on the full weights.
    ``reshard``: the engine samples from its own copy, so the gathered weights go once it is synced."""
    if world > 1:
        from torch.distributed.fsdp import FSDPModule

        _set_reshard(model, False, world)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard()
    if then is not None:
        then()
    if reshard:
        _set_reshard(model, True, world)


def _set_reshard(model: nn.Module, reshard: bool, world: int) -> None:
    """Under FSDP2, keep the gathered weights through the rollout (one all-gather instead of one per token)
    and shard them again after."""
    if world == 1:
        return
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_reshard_after_forward(reshard, recurse=False)
    if reshard:
        for m in mods:
            m.reshard()


def main(argv: list[str] | None = None) -> int:
    """``rlmem train [CONFIG.yaml] [key=value ...]``."""
    p = train_parser()
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        overrides.insert(0, args.config)
        args.config = None
    for flag, key in (("device", "device"), ("model", "model"), ("seed", "seed"), ("out_dir", "out_dir")):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if args.no_offload:
        overrides.append("offload=false")
    try:
        cfg = _config.load(GRPOConfig, args.config, overrides)
    except ValueError as e:  # one line naming the key, as argparse would exit (2), without the usage block
        print(f"rlmem train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    done = False
    try:
        run(cfg)
        done = True
    except ValueError as e:
        print(f"rlmem train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except torch.OutOfMemoryError as e:
        print(
            f"rlmem train: out of device memory: {e}\n  try offload=true, a smaller kv_budget or "
            "micro_batch_size, or gradient_checkpointing=true",
            file=sys.stderr,
        )
        return 3
    finally:
        distributed = dist.is_initialized()
        if distributed:
            if done:
                # Every rank finished: meet before tearing the group down, or one rank's teardown can
                # race another's last traffic (seen as an abort at exit on Gloo).
                dist.barrier()
            dist.destroy_process_group()
    if distributed:
        # Every file is closed and every rank has met: leave without the interpreter's teardown, in which
        # a Gloo rank was seen to abort after a complete run (std::terminate, exit -6; once in ~15 runs of
        # the two-rank resume test on 2 cores), failing a run that had finished.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
