"""Co-located GRPO on one or several GPUs (or the CPU): the loop rlmem exists for, as one readable script.

Each step: **rollout** (the policy samples G completions per prompt into a KV cache that lives in a Region),
then **score** (the rewards, while the train state comes back) and **train** (group-normalised advantages,
clipped policy-gradient loss over response tokens, optional KL to a reference model, micro-batches,
gradient clipping, AdamW). A :class:`~rlmem.PhaseManager` switches the GPU between the two: during rollout
the optimizer states go to pinned host memory and the gradients are dropped, during training the KV cache
is released. The reference model, when used, stays offloaded except while it scores the batch.

Run ``rlmem train`` (defaults: an embedded tiny Qwen2-shaped model learning to sort digits) or
``rlmem train examples/grpo_tiny.yaml key=value ...``; with ``torchrun --nproc-per-node N -m rlmem train``
the policy is sharded with FSDP2 and each rank samples its share of the prompts.

This module holds the loop and the GRPO pieces it calls; set-up lives beside it: where it runs
(``runtime.py``), the prompts and rewards (``prompts.py``), the model, reference, optimizer, PhaseManager and
engine (``policy.py``), and what the run writes and prints (``runlog.py``, ``report.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._extras import require
from ..data.batching import token_budget_batches
from ..monitor.timeline import MemoryTimeline
from ..rollout.remote.server_rollout import EngineLostError
from . import checkpoint, identity, shared_prompts
from .config import GRPOConfig, train_parser
from .policy import Policy
from .prompts import PromptSource, make_prompts
from .report import banner, report
from .runlog import RunLog, StepResult, track
from .runtime import Runtime, setup
from .stop import RunStopped, StopRequest
from .yaml_config import load

__all__ = ["GRPOConfig", "main", "report", "run"]

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
        ValueError: bad configuration (model, device, budget), or ``out_dir`` holds another run's results.
        RunStopped: Ctrl-C or SIGTERM ended the run after a step (its checkpoint and summary written).
        rlmem.OutOfMemoryError / torch.OutOfMemoryError: the KV cache or training does not fit.
    """
    t_run = time.perf_counter()
    identity.check_folder(cfg)  # before anything is built, on every rank: nothing written over another run
    rt = setup(cfg)
    say = echo if rt.lead else (lambda *a, **k: None)
    prompts = make_prompts(cfg, say)
    policy = Policy(cfg, rt, prompts)
    stop = StopRequest(say)
    try:
        return _train(cfg, rt, prompts, policy, say, t_run, stop)
    finally:
        stop.restore()
        policy.close()  # a server this run started stops, whatever ended the run


def _train(
    cfg: GRPOConfig,
    rt: Runtime,
    prompts: PromptSource,
    policy: Policy,
    say: Any,
    t_run: float,
    stop: StopRequest,
) -> Any:
    """The loop of :func:`run`, once its policy is built."""
    model, opt = policy.model, policy.opt
    rng = random.Random(cfg.seed)
    start = _resume(cfg, policy, prompts, rng, rt, say)
    if start >= cfg.steps:  # a finished run started again (a scheduler's requeue): nothing written over
        say(f"nothing to train: the checkpoint resumed from has {start} steps, steps={cfg.steps}")
        summary = Path(cfg.out_dir) / "summary.json"
        return json.loads(summary.read_text()) if summary.is_file() else {}
    what = dict(
        model=model, optimizer=opt, tokenizer=prompts.tokenizer, rng=rng, world=rt.world, rank=rt.rank
    )
    if cfg.save_every != 0:  # a run that could not save its end is refused before it starts
        checkpoint.preflight(cfg.out_dir, data=prompts.state_dict(), config=dataclasses.asdict(cfg), **what)
    pm = policy.manage_memory()

    def save(done: int) -> Path:
        extra = {"scaler": rt.scaler.state_dict()} if rt.scaler is not None else None
        data, config = prompts.state_dict(), dataclasses.asdict(cfg)
        return checkpoint.save(cfg.out_dir, step=done, data=data, config=config, extra=extra, **what)

    tl = MemoryTimeline(rt.device)
    track(tl, policy)
    copy = f", rollout {str(rt.rollout_dtype).removeprefix('torch.')}" if rt.rollout_dtype else ""
    say(banner(cfg, policy.n_params, rt.world, rt.device, rt.precision + copy, pm.enabled))
    share = _share_prompts(cfg, policy, prompts.max_len, say)
    saved_at = start if cfg.resume is not None and start else None
    done, updating, interrupted, together = start, False, False, True
    lost: EngineLostError | None = None
    # Ctrl-C or SIGTERM from here to the summary: the step in flight is finished and saved (stop.py)
    stop.install()
    # Only now: a run refused above has written nothing over an earlier one.
    with RunLog(cfg, rt, start, say, t0=t_run) as log:
        try:
            for step in range(start, cfg.steps):
                t_step = time.perf_counter()
                policy.last_sync_s = None
                batch = prompts.take(cfg.prompts_per_step, rng, rt.rank, rt.world)
                group = [ids for ids in batch.ids for _ in range(cfg.group_size)]

                # ---- rollout: G completions per prompt ---------------------------------------------
                with tl.phase("rollout", step) as ph, pm.rollout(sync_weights=policy.weight_sync()):
                    switch_s = pm.stats().switches.rollout_s or 0.0
                    model.eval()
                    engine = policy.make_engine()
                    tl.sample("rollout", step)  # the memory the rollout runs with, once the switch is done
                    with policy.gathered():
                        t0 = time.perf_counter()
                        comps = engine.generate(
                            group,
                            max_new_tokens=prompts.max_new_tokens,
                            temperature=cfg.temperature,
                            top_p=cfg.top_p,
                            seed=cfg.seed * 1_000_003 + step * rt.world + rt.rank,
                        )
                        rt.synchronize()
                        rollout_s = time.perf_counter() - t0
                        # Evaluations measure the policy after `step` updates: before the first (the model's
                        # own baseline), after every `eval_every`, and after the last (below the loop).
                        due = (
                            (cfg.eval_every and step % cfg.eval_every == 0) if step else cfg.eval_before_train
                        )
                        eval_reward = prompts.evaluate(engine, rt.rank, rt.world, rt.ctl) if due else None
                    tl.sample("rollout", step)
                ph["tokens"] = sum(len(c) for c in comps)
                log.eval(step, eval_reward)

                # ---- score, while the train state comes back; then train --------------------------
                with tl.phase("train", step):
                    pm.prefetch()
                    t0 = time.perf_counter()
                    rewards = prompts.score(batch, comps, cfg.group_size)
                    score_s = time.perf_counter() - t0
                    with pm.train():
                        sw = pm.stats().switches
                        switch_s += (sw.prefetch_s or 0.0) + (sw.train_s or 0.0)
                        tl.sample("train", step)
                        model.train()
                        adv = group_advantages(rewards, cfg.group_size)
                        seqs = [p + c for p, c in zip(group, comps, strict=True)]
                        b = make_batch(seqs, [len(p) for p in group], prompts.pad_id)
                        groups = (
                            shared_prompts.Groups.from_rows(group, comps, cfg.group_size, prompts.pad_id)
                            if share
                            else None
                        )
                        t1 = time.perf_counter()
                        # on the host: waited for
                        old, refs = _score(policy, b, cfg.micro_batch_size, rt, groups)
                        logprobs_s = time.perf_counter() - t1
                        tl.sample("train", step)
                        updating = True
                        loss, kl, gnorm, skipped = _update(
                            cfg, policy, rt, tl, b, adv, old, refs, step, groups
                        )
                        updating = False
                    rt.synchronize()
                    train_s = time.perf_counter() - t0 - score_s

                # ---- log and save ------------------------------------------------------------------
                res = StepResult(
                    step=step,
                    rewards=rewards,
                    tokens=ph["tokens"],
                    resp_tokens=b["resp"].sum().item(),
                    loss=loss,
                    kl=kl,
                    grad_norm=gnorm,
                    skipped=skipped,
                    rollout_s=rollout_s,
                    score_s=score_s,
                    train_s=train_s,
                    switch_s=switch_s,
                    step_s=time.perf_counter() - t_step,
                    eval_reward=eval_reward,
                    sync_s=policy.last_sync_s,
                    logprobs_s=logprobs_s,
                )
                log.step(log.record(res, tl, engine, pm.stats().switches if pm.enabled else None))
                done = step + 1
                if cfg.save_every and done % cfg.save_every == 0:
                    save(done)
                    saved_at = done
                if stop.agreed(rt):
                    interrupted = True
                    break
        except KeyboardInterrupt:  # a second Ctrl-C: this rank stops where it is, not with the others
            interrupted, together = True, False
        except EngineLostError as e:  # the state is intact (on the device or in host memory): save it
            interrupted, lost = True, e
            say(f"{e}\nending the run after step {done}")
        if together:
            # A run that ends in rollout (a lost server) leaves comms="suspend"'s groups suspended; the
            # checkpoint's gathers and the run's last barrier need them.
            pm.resume_comms()
        if cfg.save_every != 0 and done and saved_at != done:
            if interrupted and updating:
                say(f"interrupted during an update: step {done + 1} is lost; no checkpoint written for it")
            else:
                say(f"checkpoint: {save(done)}" + ("; resume=auto goes on from it" if lost else ""))
        if not interrupted and cfg.eval_every and done > start:
            log.eval(done, _evaluate(policy, prompts, rt, tl, done))
            pm.resume_comms()  # the evaluation's switch to rollout suspended them; the run's end meets
        policy.close()  # before the summary: the server's last report is in the ledger's final samples
    by = signal.Signals(stop.signum).name if stop.signum else None
    summary = log.finish(tl, pm.enabled, done=done, interrupted=interrupted, together=together, by=by)
    tl.check_leaks()
    if lost is not None:
        raise lost
    if interrupted or stop.signum:
        raise RunStopped(stop.signum or signal.SIGINT, together=together)
    return summary


def _resume(
    cfg: GRPOConfig, policy: Policy, prompts: PromptSource, rng: random.Random, rt: Runtime, say: Any
) -> int:
    """The step to start at: 0, or that of the checkpoint ``cfg.resume`` names, whose weights, optimizer
    state, RNG, data position and loss scale are loaded (the reference stays the initial policy); a
    checkpoint of another run (``identity.py``) is refused before anything is loaded."""
    out = Path(cfg.out_dir)
    if cfg.resume is None:
        if (last := checkpoint.latest(out)) is not None:
            say(f"{out} holds {last.name}: this run starts at step 0 (resume=auto would go on from it)")
        return 0
    where = checkpoint.latest(out) if cfg.resume == "auto" else Path(cfg.resume)
    if where is None:
        say(f"resume=auto: no checkpoint in {out}; starting at step 0")
        return 0
    st = checkpoint.load(
        where,
        model=policy.model,
        optimizer=policy.opt,
        world=rt.world,
        accept=lambda state: identity.check_checkpoint(where, state.get("config"), cfg),
    )
    checkpoint.set_rng_state(rng, st["rng"])
    prompts.load_state_dict(st.get("data"))
    if rt.scaler is not None and st.get("scaler"):
        rt.scaler.load_state_dict(st["scaler"])
    say(f"resumed from {where} at step {int(st['step'])}")
    return int(st["step"])


def _evaluate(policy: Policy, prompts: PromptSource, rt: Runtime, tl: MemoryTimeline, step: int) -> Any:
    """An evaluation of its own (after the last update): one more switch to rollout for it."""
    with tl.phase("rollout", step), policy.pm.rollout(sync_weights=policy.weight_sync()):
        policy.model.eval()
        engine = policy.make_engine()
        with policy.gathered():
            return prompts.evaluate(engine, rt.rank, rt.world, rt.ctl)


def _share_prompts(cfg: GRPOConfig, policy: Policy, max_len: int, say: Any) -> bool:
    """Whether scoring and training forward each group's prompt once (``share_prompts``, where the model's
    attention allows it: :mod:`.shared_prompts`); otherwise every sample carries its own copy."""
    if not cfg.share_prompts or cfg.group_size < 2:
        return False
    why = shared_prompts.unsupported(policy.model, max_len)
    if why is not None:
        say(f"share_prompts: {why}; each sample is scored with its own copy of the prompt")
    return why is None


def _score(
    policy: Policy,
    b: dict[str, torch.Tensor],
    mbs: int,
    rt: Runtime,
    groups: shared_prompts.Groups | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the sampled tokens under the policy before the update (the ratio's denominator) and
    under the reference model, which is brought in for this and sent back right after. With ``groups``
    (prompts shared), micro-batches of whole groups, each prompt forwarded once."""

    @torch.no_grad()
    def score(m: nn.Module) -> torch.Tensor:
        if groups is not None:
            return _score_shared(m, groups, b["ids"].shape[1], mbs, rt)
        parts = []
        for i in range(0, b["ids"].shape[0], mbs):
            ids, attn = b["ids"][i : i + mbs].to(rt.device), b["attn"][i : i + mbs].to(rt.device)
            parts.append(token_logprobs(m, ids, attn, rt.autocast).cpu())
        return torch.cat(parts)

    old = score(policy.model)
    if policy.ref is None:
        return old, None
    if policy.ref_state is not None:
        policy.ref_state.reload(blocking=False)
    refs = score(policy.ref)
    if policy.ref_state is not None:
        policy.ref_state.offload(params="offload", blocking=False)
    return old, refs


def _score_shared(
    m: nn.Module, groups: shared_prompts.Groups, width: int, mbs: int, rt: Runtime
) -> torch.Tensor:
    parts = []
    for chunks in shared_prompts.micro_batches(groups, range(groups.n_groups), mbs):
        packed = groups.pack(chunks, width).to(rt.device)
        with shared_prompts.packed_attention(m, packed):
            parts.append(shared_prompts.packed_logprobs(m, packed, rt.autocast).cpu())
    return torch.cat(parts)


def _update(
    cfg: GRPOConfig,
    policy: Policy,
    rt: Runtime,
    tl: MemoryTimeline,
    b: dict[str, torch.Tensor],
    adv: torch.Tensor,
    old: torch.Tensor,
    refs: torch.Tensor | None,
    step: int,
    groups: shared_prompts.Groups | None = None,
) -> tuple[float, float, float, int]:
    """``updates_per_step`` optimizer steps over a shuffled split of the batch, each from micro-batches.
    With ``groups`` (prompts shared) whole groups are shuffled and split, and a micro-batch forwards each
    prompt once. Returns (loss, summed KL, last gradient norm, optimizer steps skipped by the fp16 loss
    scaler)."""
    model, opt, scaler, device = policy.model, policy.opt, rt.scaler, rt.device
    n = b["ids"].shape[0] if groups is None else groups.n_groups
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + step))
    minis = [m for m in order.tensor_split(cfg.updates_per_step) if m.numel()]
    loss_sum = kl_sum = 0.0
    gnorm = 0.0
    skipped = 0
    for mini in minis:
        if groups is None:
            denom = max(b["resp"][mini].sum().item(), 1.0)
            parts: list[Any] = micro_batches(cfg, b, mini, rt)
        else:
            denom = max(b["resp"][groups.group_rows(mini.tolist())].sum().item(), 1.0)
            parts = group_micro_batches(cfg, groups, mini, rt)
        for mb in parts:
            packed = None
            if groups is not None:  # chunks of groups: a packed row each
                chunks, mb = mb, groups.rows(mb)
            # Right-padded: a micro-batch needs only the columns of its longest sequence.
            w = int(b["attn"][mb].sum(1).max())
            if groups is not None:
                packed = groups.pack(chunks, w).to(device)
            mask = b["resp"][mb, : w - 1].to(device)
            # A gradient checkpoint's recompute runs the packed attention too: backward inside the block.
            with nullcontext() if packed is None else shared_prompts.packed_attention(model, packed):
                if packed is None:
                    ids, attn = b["ids"][mb, :w].to(device), b["attn"][mb, :w].to(device)
                    logp = token_logprobs(model, ids, attn, rt.autocast)
                else:
                    logp = shared_prompts.packed_logprobs(model, packed, rt.autocast)
                loss, kl = grpo_loss(
                    logp,
                    old[mb, : w - 1].to(device),
                    refs[mb, : w - 1].to(device) if refs is not None else None,
                    adv[mb].to(device),
                    mask,
                    clip_eps=cfg.clip_eps,
                    kl_coef=cfg.kl_coef,
                    denom=denom,
                )
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.item() / len(minis)
            kl_sum += kl.item()
        tl.sample("train", step)
        if scaler is not None:
            scaler.unscale_(opt)  # clip the true gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        gnorm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += int(scaler.get_scale() < before)  # the scale drops exactly when a step is skipped
        else:
            opt.step()
        opt.zero_grad()
        tl.sample("train", step)
    return loss_sum, kl_sum, gnorm, skipped


def micro_batches(
    cfg: GRPOConfig, b: dict[str, torch.Tensor], mini: torch.Tensor, rt: Runtime
) -> list[torch.Tensor]:
    """The mini-batch's micro-batches: ``micro_batch_size`` rows each, or by token budget (the same count on
    every rank, since FSDP's collectives need every rank to run as many forward/backward passes)."""
    if not cfg.dynamic_batching:
        return list(mini.split(cfg.micro_batch_size))
    lengths = b["attn"][mini].sum(1).tolist()
    budget = cfg.max_tokens_per_micro_batch
    parts = token_budget_batches(lengths, budget, padded=True)[0]
    most = int(rt.all_reduce(torch.tensor([len(parts)]), op=dist.ReduceOp.MAX).item())
    if most > len(parts):  # another rank needs more: cut this one's as finely
        parts = token_budget_batches(lengths, budget, padded=True, min_micro_batches=most)[0]
    return [mini[torch.tensor(p, dtype=torch.long)] for p in parts if p]


def group_micro_batches(
    cfg: GRPOConfig, groups: shared_prompts.Groups, mini: torch.Tensor, rt: Runtime
) -> list[list[shared_prompts.Chunk]]:
    """:func:`micro_batches` of a mini-batch of whole groups (``mini``: group indices) whose prompts are
    shared: at most ``micro_batch_size`` rows each (whole groups, or a chunk of a larger group carrying the
    prompt), or by token budget, a group (or chunk) costing its packed length."""
    if not cfg.dynamic_batching:
        return shared_prompts.micro_batches(groups, mini.tolist(), cfg.micro_batch_size)
    budget = cfg.max_tokens_per_micro_batch
    chunks = groups.fit(mini.tolist(), budget)
    lengths = [groups.packed_length(c) for c in chunks]
    parts = token_budget_batches(lengths, budget, padded=True)[0]
    most = int(rt.all_reduce(torch.tensor([len(parts)]), op=dist.ReduceOp.MAX).item())
    if most > len(parts):  # another rank needs more: cut this one's as finely, its groups in more chunks
        chunks = groups.divide(chunks, most)  # every rank holds as many rows: enough for `most`
        lengths = [groups.packed_length(c) for c in chunks]
        parts = token_budget_batches(lengths, budget, padded=True, min_micro_batches=most)[0]
    return [[chunks[i] for i in p] for p in parts if p]


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
        require("train", "yaml", what="rlmem train")  # the overrides are YAML scalars
        cfg = load(GRPOConfig, args.config, overrides)
        # the rest of the extra this run imports (datasets, with data=FILE, is named where it is read)
        bar = ("tqdm",) if cfg.progress and sys.stderr.isatty() else ()
        require("train", "transformers", *bar, what="rlmem train")
    except ValueError as e:  # one line naming the key, as argparse would exit (2), without the usage block
        print(f"rlmem train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    done, status = False, 0
    try:
        run(cfg)
        done = True
    except RunStopped as e:  # 128 + the signal, what a scheduler reads as "stopped by it" (stop.py)
        status = e.exit_status
        done = e.together  # every rank stopped after the same step: they meet below like a finished run
    except ValueError as e:
        print(f"rlmem train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the loop began: nothing to save yet
        return 130
    except checkpoint.CheckpointError as e:
        print(f"rlmem train: error: {e}", file=sys.stderr)
        return 4
    except EngineLostError as e:
        print(f"rlmem train: error: {e}", file=sys.stderr)
        # Every rank raised it at the same exchange (the ranks agree on each): they meet below, so that
        # none is ended by the launcher before its own end is written.
        done = True
        return 5
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
                # Every rank finished (or lost a server together): meet before tearing the group down, or
                # one rank's teardown can race another's last traffic (seen as an abort at exit on Gloo).
                dist.barrier()
            dist.destroy_process_group()
    if distributed:
        # Every file is closed and every rank has met: leave without the interpreter's teardown, in which
        # a Gloo rank was seen to abort after a complete run (std::terminate, exit -6; once in ~15 runs of
        # the two-rank resume test on 2 cores), failing a run that had finished.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
