"""Where and how ``rlmem train`` computes: the device, this process's rank among the world of ranks, and
the precision (autocast and the fp16 loss scaler). Stopping a run on a signal is ``stop.py``'s."""

from __future__ import annotations

import datetime
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._dtypes import torch_dtype
from .config import GRPOConfig, OffloadKeys

__all__ = ["Runtime", "local_rank", "rollout_dtype", "setup"]

# The longest one rank waits on the control group for the others: a rollout, or a checkpoint's save.
CTL_TIMEOUT_S = 1800.0


@dataclass
class Runtime:
    """The run's device, rank and world size, precision, and the loss scaler of fp16 (None otherwise).

    ``rollout_dtype`` is the config's, resolved: ``"auto"`` is the autocast dtype on a GPU (every inference
    engine samples from weights in it; under autocast the matrix products see them in it anyway), no copy
    otherwise. ``ctl`` is a Gloo group for the rollout's own reductions while the NCCL groups are suspended,
    and for the ranks' agreement on each exchange with their servers (None on one rank, or unless
    ``comms='suspend'`` or ``engine='server'``). ``offload`` is whether rlmem switches memory between the
    phases (:meth:`~rlmem.recipes.config.OffloadKeys.enabled`, resolved here once)."""

    device: torch.device
    rank: int
    world: int
    precision: str
    param_dtype: torch.dtype
    amp_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None
    rollout_dtype: torch.dtype | None = None  # the rollout copy's (``rollout_dtype``), None: no copy
    ctl: Any = None
    offload: bool = False

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()

    def synchronize(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """``t`` summed (or reduced by ``op``) over the ranks, on the CPU; ``t`` itself on one rank."""
        if self.world == 1:
            return t
        on = t.to(self.device)
        dist.all_reduce(on, **({"op": op} if op is not None else {}))
        return on.cpu()


def setup(cfg: GRPOConfig) -> Runtime:
    """The runtime ``cfg`` asks for; starts torch.distributed when launched by torchrun.

    Raises:
        ValueError: no CUDA for ``device='cuda'``, prompts that do not split over the ranks, or
            ``comms='suspend'`` where it cannot work.
    """
    device, rank, world = _setup_device(cfg)
    on_cuda = device.type == "cuda"
    precision = cfg.precision if cfg.precision != "auto" else ("bf16-mixed" if on_cuda else "fp32")
    amp_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    # fp16's narrow range needs dynamic loss scaling; a step whose gradients overflow is skipped.
    rt = Runtime(
        device=device,
        rank=rank,
        world=world,
        precision=precision,
        param_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
        amp_dtype=amp_dtype,
        scaler=torch.amp.GradScaler(device.type) if precision == "fp16-mixed" else None,
        rollout_dtype=rollout_dtype(cfg.rollout_dtype, amp_dtype, on_cuda),
        offload=OffloadKeys.of(cfg).enabled(on_cuda),
    )
    if cfg.comms == "suspend":
        _check_suspend(rt)
    if world > 1 and (cfg.comms == "suspend" or cfg.engine == "server"):
        # Gloo, on the host: it works while NCCL's communicators are suspended, and with a server per rank
        # the ranks agree on every exchange with their servers through it (a rank whose server died must
        # not leave the others waiting in a collective on the device).
        rt.ctl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CTL_TIMEOUT_S))
    return rt


def rollout_dtype(value: str | None, amp_dtype: torch.dtype | None, on_cuda: bool) -> torch.dtype | None:
    """The rollout copy's dtype for the config's ``rollout_dtype``: ``"auto"`` is the autocast dtype on a
    GPU (the 2.7B example under autocast kept 4.5 GiB of bf16 weight casts in its graphs' pool through the
    train phase, against 0.2 GiB with a bf16 copy, and its fp32 weights on the device during rollout), and
    no copy elsewhere; ``"none"`` / None: no copy."""
    if value == "auto":
        return amp_dtype if on_cuda else None
    return None if value in (None, "none") else torch_dtype(value)


def _setup_device(cfg: GRPOConfig) -> tuple[torch.device, int, int]:
    """(device, rank, world size)."""
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return torch.device(want, 0) if want == "cuda" else torch.device("cpu"), 0, 1
    local = local_rank()
    device = torch.device("cuda", local) if want == "cuda" else torch.device("cpu")
    if want == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kw = {"device_id": device} if want == "cuda" else {}
        dist.init_process_group("nccl" if want == "cuda" else "gloo", **kw)
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step ({cfg.prompts_per_step}) must be divisible by the {world} ranks")
    return device, dist.get_rank(), world


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 without torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _check_suspend(rt: Runtime) -> None:
    if not (rt.offload and rt.on_cuda and rt.world > 1):
        raise ValueError(
            "comms='suspend' releases NCCL communicators during rollout: it needs several ranks "
            f"(torchrun) on CUDA with offload on; this run has {rt.world} rank(s) on {rt.device.type}, "
            f"offload {'on' if rt.offload else 'off'}"
        )
    from ..comm import nccl_driver

    drv = nccl_driver()
    if not drv.can_suspend:
        # The rebuild fallback gives the group objects new communicators, but FSDP2's DTensor reductions
        # (gradient clipping) reach communicators by group name from C++, where they are gone.
        raise ValueError(
            f"comms='suspend' needs an NCCL that can suspend communicators (>= 2.29.7); this process "
            f"loaded {drv.describe}. Load a newer libnccl with LD_PRELOAD before torch starts, or use "
            "comms='keep'"
        )
