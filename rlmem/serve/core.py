"""What ``rlmem serve`` serves, without the HTTP: :class:`ServedModel`, an :class:`~rlmem.HFSampler` in a
server process with its lock, its sleep and wake, weight updates, and its seat at the device's broker.

One lock orders every use of the sampler: generations, sleeps, wakes and weight updates come from the
HTTP server's worker threads and from the broker's calls, never at once. Each such thread makes the
server's GPU its current device first: a thread starts on GPU 0, and a CUDA call there that names no device
would open a context (some 500 MiB) on GPU 0 for a server of another GPU. With a broker the process starts
asleep (nothing of its cache mapped) and takes the device only when granted; sleeps and wakes from either
front are the fenced release and the admitted acquire of :class:`~rlmem.rollout.EngineSeat`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..colocate import AttachedWeights, Member
from ..colocate.ipc import open_tensors
from ..rollout.engine import DEFAULT_MAX_NEW_TOKENS, generation_length
from ..rollout.remote.peer import EngineSeat
from ..rollout.sampler import HFSampler

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "NotReadyError", "ServedModel"]


class NotReadyError(RuntimeError):
    """The server cannot do this now (asleep, or waiting for its weights): HTTP 409."""


class ServedModel:
    """A causal LM served for rollout.

    Args:
        model: a ``transformers`` causal LM; on the meta device when its weights will come from a trainer
            (``attach_weights``, through the broker).
        tokenizer: ``encode(text) -> ids`` and ``decode(ids) -> text`` for text prompts
            (None: token ids only).
        sampler: :class:`HFSampler` keyword arguments (``max_len``, ``batch_size``, ``pad_token_id``, ...).
        member: this process's seat at the device's broker (role ``"rollout"``), or None.
        name: what ``/health`` calls the model.
        device: the server's device, made current on every thread that uses the sampler (None: left as is).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokenizer: Any = None,
        sampler: dict[str, Any],
        member: Member | None = None,
        name: str = "model",
        device: torch.device | None = None,
    ) -> None:
        self.model, self.tokenizer, self.name, self.member = model, tokenizer, name, member
        self.device = device
        self._kw = dict(sampler)
        self.lock = threading.RLock()
        self.sampler: HFSampler | None = None
        self.shared: AttachedWeights | None = None
        self.started = time.time()
        self.level = 0  # 0 awake; 1 or 2: asleep at that level
        self.seat = None
        if member is not None:
            self.seat = EngineSeat(member, self, {"kv_cache": self._kv_regions})
            self.level = 1  # until the broker grants it the device
        if next(model.parameters()).device.type != "meta":
            self.sampler = HFSampler(model, **self._kw, asleep=member is not None)

    def _bind_thread(self) -> None:
        """Make the server's GPU this thread's current device (see the module's docstring)."""
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """The lock, held by a thread whose current device is the server's."""
        with self.lock:
            self._bind_thread()
            yield

    def _kv_regions(self) -> tuple:
        return () if self.sampler is None else (self.sampler.region,)

    # -- the engine protocol (EngineSeat calls these) -------------------------------------------------
    def attach_weights(self, weights: AttachedWeights) -> None:
        """Sample from the trainer's shared weights from now on; this process's own (if it loaded any) are
        let go."""
        with self._using():
            self.shared = weights
            if self.sampler is None:
                self.sampler = HFSampler(
                    self.model, **self._kw, weights=weights.tensors, asleep=self.level > 0
                )
            else:
                self.sampler.use_weights(weights.tensors)
            if any(p.device.type != "meta" for p in self.model.parameters()):
                self.model.to("meta")  # its own weights are not read any more
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.empty_cache()

    def sleep(self, level: int = 1) -> None:
        with self._using():
            s = self._need_sampler("sleep")
            s.sleep(level)
            if s.region.device.type == "cuda":
                torch.cuda.synchronize(s.region.device)
                torch.cuda.empty_cache()  # the forward passes' cached blocks go back too
            self.level = level

    def wake(self, tags: Sequence[str] | None = None) -> None:
        with self._using():
            s = self._need_sampler("wake")
            s.wake(tags)
            if tags is None or "kv_cache" in tags:
                self.level = 0

    # -- what the HTTP endpoints call ---------------------------------------------------------------
    def do_sleep(self, level: int) -> dict[str, Any]:
        """Sleep; through the broker's fenced release when it has a seat there."""
        if self.seat is not None:
            return {"fence": self.seat.sleep([], level)}
        self.sleep(level)
        return {}

    def do_wake(self, tags: Sequence[str] | None) -> dict[str, Any]:
        """Wake; admitted by the broker first when it has a seat there."""
        if self.seat is not None:
            return {"grant": self.seat.wake([], None if tags is None else list(tags))}
        self.wake(tags)
        return {}

    def generate(
        self,
        *,
        input_ids: list[list[int]] | None = None,
        prompts: list[str] | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        n: int = 1,
    ) -> dict[str, Any]:
        """Completions of token-id prompts (``input_ids``) or text ones (``prompts``, which need a
        tokenizer): ``output_ids`` always, ``completions`` (text) with a tokenizer; ``n`` per prompt,
        prompt-major (each prompt ``n`` times in a row: a group, whose prompt the sampler holds once with
        ``share_prompts``).

        ``max_new_tokens=None``: the one default (:func:`rlmem.rollout.engine.generation_length`, at most
        :data:`DEFAULT_MAX_NEW_TOKENS`), bounded by the room the longest prompt leaves within the sampler's
        ``max_len``: a fixed default would refuse every such request on a server whose ``max_len`` is that
        default or less.

        Raises:
            ValueError: bad arguments; a prompt that leaves no room for a completion within ``max_len``.
            NotReadyError: asleep, or no weights yet.
        """
        if (input_ids is None) == (prompts is None):
            raise ValueError("give exactly one of prompts (text) or input_ids (token ids)")
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError(f"{self.name} was served without a tokenizer: send input_ids")
            input_ids = [list(self.tokenizer.encode(p)) for p in prompts]
        assert input_ids is not None
        if not input_ids:
            raise ValueError("no prompts given")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        input_ids = [ids for ids in input_ids for _ in range(n)]
        with self._using():
            s = self._need_sampler("generate")
            if self.level:
                raise NotReadyError(f"{self.name} is asleep (level {self.level}): wake it first")
            if self.shared is not None:
                try:
                    _ = self.shared.tensors  # raises if unmapped or the trainer is gone
                except Exception as e:
                    raise NotReadyError(str(e)) from e
            vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
            for i, ids in enumerate(input_ids):
                bad = [t for t in ids if not 0 <= t < (vocab or 2**62)]
                if bad:
                    raise ValueError(f"input_ids[{i}] has token {bad[0]} outside the vocabulary of {vocab}")
            if max_new_tokens is None:
                longest = max(len(ids) for ids in input_ids)
                if longest >= s.max_len:
                    raise ValueError(
                        f"a prompt of {longest} tokens leaves no room for a completion within "
                        f"max_len={s.max_len}: shorten it (or serve with a larger --max-len)"
                    )
                max_new_tokens = generation_length(None, room=s.max_len - longest)
            t0 = time.perf_counter()
            out = s.generate(
                input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
            seconds = time.perf_counter() - t0
        res: dict[str, Any] = {
            "output_ids": out,
            "tokens": sum(len(o) for o in out),
            "seconds": seconds,
        }
        if self.tokenizer is not None:
            res["completions"] = [self.tokenizer.decode(o) for o in out]
        return res

    def update_from_tensors(self, handles: list[dict]) -> dict[str, Any]:
        """Copy tensors another process shares by handle (:func:`~rlmem.colocate.ipc.share_tensors`) into
        the weights, by name; every name and shape is checked before anything is written.

        Raises:
            ValueError: an unknown name, a shape that differs, a malformed handle. NotReadyError: the
                weights are the trainer's shared ones (it updates them itself), or asleep.
        """
        with self._using():
            s = self._need_sampler("update_weights_from_tensor")
            if self.shared is not None:
                raise NotReadyError(
                    "the weights are a trainer's shared weights: the trainer updates them in place"
                )
            if s.weights_region is not None and s.weights_region.paused:
                raise NotReadyError("the weights are asleep: wake them first")
            own = s.weights if s.weights is not None else dict(self.model.named_parameters())
            opened = open_tensors(handles)
            for name, t in opened:
                dst = own.get(name)
                if dst is None:
                    raise ValueError(f"no weight named {name!r} (the model has e.g. {next(iter(own))!r})")
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"{name!r}: shape {tuple(t.shape)}, the weight's is {tuple(dst.shape)}")
            t0 = time.perf_counter()
            with torch.no_grad():
                for name, t in opened:
                    own[name].copy_(t)
            dev = s.region.device
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # copied before the sender may change or free them
            nbytes = sum(t.numel() * t.element_size() for _, t in opened)
            del opened
            return {"updated": len(handles), "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def stats(self) -> dict[str, Any]:
        """What ``GET /memory`` answers: the cache's shape, what the process holds, its ledger entry."""
        s = self.sampler
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "ready": s is not None,
            "level": self.level,
            "shared_weights": self.shared is not None,
        }
        if s is not None:
            out.update(
                max_len=s.max_len,
                batch_size=s.batch_size,
                kv_bytes=s.kv_bytes,
                captures=s.captures,
                tokens_generated=s.tokens_generated,
                memory=s.memory(),
            )
        if self.member is not None:
            out["holdings"] = self.member.holdings()
            out["broker"] = str(self.member.path)
        elif s is not None and s.region.device.type == "cuda":
            out["holdings"] = {**s.memory(), "torch_cache": int(torch.cuda.memory_reserved(s.region.device))}
        return out

    def serve_broker(self, stop: threading.Event) -> threading.Thread:
        """Answer the broker's calls (the trainer's :class:`~rlmem.rollout.PeerEngine`) on a thread, until
        ``stop`` is set."""
        assert self.seat is not None and self.member is not None
        member, handlers = self.member, self.seat.handlers()

        def loop() -> None:
            self._bind_thread()  # the fences' synchronizes and the handoff's copies
            try:
                member.serve(handlers, until=stop.is_set)
            except Exception:
                stop.set()  # the broker went away: nothing more to serve

        t = threading.Thread(target=loop, name="rlmem-serve-broker", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        with self._using():
            if self.member is not None:
                self.member.close()
            if self.sampler is not None:
                self.sampler.region.close()

    def _need_sampler(self, what: str) -> HFSampler:
        if self.sampler is None:
            raise NotReadyError(f"{what}: {self.name} has no weights yet (waiting for the trainer's)")
        return self.sampler
