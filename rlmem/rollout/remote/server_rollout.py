"""``rlmem train engine=server``: the rollout in ``rlmem serve``, a process of its own on the same GPU.

This process keeps the rollout copy of the policy in a :class:`~rlmem.colocate.SharedWeights` (buffers too,
so the server builds its model empty), starts a broker and the server (or joins the broker of one already
running, ``engine_url``), and drives it as :class:`~rlmem.RemoteEngine`: the phase switches are the broker's
fenced handoffs, a weight sync is the in-place copy into the shared memory, generation is HTTP. What the
server holds comes from its ledger entry. A server that dies ends the run with :class:`EngineLostError`
(after the checkpoint the loop writes).

Under torchrun every rank has its own server (and broker) on its GPU. Every exchange with a server (the
handoffs, a generation) is followed by the ranks' agreement on a Gloo group: a rank whose server died tells
the others there, so every rank raises at the same point, none is left waiting in a collective on the
device, and they save the checkpoint together. A rank learns of another's lost server when its own
exchange is done: within one rollout of the death.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...colocate.broker import Broker
from ...colocate.member import Member, PeerLostError, RemoteError
from ...colocate.weights import SharedWeights
from ...errors import OutOfMemoryError
from ..sampler.config import SamplerConfig
from .base import RemoteEngine

__all__ = ["SERVER_CATEGORIES", "EngineLostError", "ServerRollout"]

# What the timeline and the table show of the server: this process's shared copy, then the server's ledger.
SERVER_CATEGORIES = ("rollout_weights", "server_kv_cache", "server_torch_cache")
_START_S = 600.0  # loading a large model's config and CUDA can take a while; the process is watched meanwhile


class EngineLostError(RuntimeError):
    """The rollout server died or stopped answering; the run ends (with a checkpoint)."""


class ServerRollout:
    """The rollout engine of ``engine=server``, as the loop uses an engine.

    Args:
        model: the policy (its config is what the server builds; its weights are shared at each sync).
        device: this process's device (the server's too).
        weights_dtype: the rollout copy's dtype.
        sampler: the server's sampler (:class:`~rlmem.rollout.sampler.SamplerConfig`, passed whole as
            ``--sampler-config``), for a server this process starts.
        url: a running server (``engine_url``), or None to start one.
        log: where a started server's output goes.
        group: under torchrun, the Gloo group the ranks agree on after every exchange with their servers
            (None on one rank).

    Raises:
        EngineLostError: the server did not start, or died starting.
        ValueError: ``url``'s server joined no broker.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        weights_dtype: torch.dtype,
        sampler: SamplerConfig,
        url: str | None,
        log: Path,
        group: Any = None,
    ) -> None:
        missing = [m for m in ("httpx", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(
                f"engine=server needs {', '.join(missing)}: pip install 'rlmem[serve]' (or -e '.[serve]')"
            )
        self.proc: subprocess.Popen | None = None
        self.broker: Broker | None = None
        self.member: Member | None = None
        self.log = log
        self._group = group
        self._rank = dist.get_rank() if group is not None else None
        self._dir = Path(tempfile.mkdtemp(prefix="rlmem-serve-"))  # private (0700)
        self.shared = SharedWeights(model, weights_dtype, buffers=True, name="rollout_weights")
        try:
            if url is None:
                self.broker = Broker(self._dir / "broker.sock").start()
                broker_path = str(self.broker.path)
                url = self._start(model, device, broker_path, sampler)
            else:
                broker_path = self._broker_of(url)
            self.url = url
            self.member = Member("train", path=broker_path, device=device, name="rlmem train")
            self.member.track("rollout_weights", self.shared.region)
            self.remote = RemoteEngine(url, member=self.member, weights=self.shared, timeout=_START_S)
            self._stats = self.remote.stats()
        except BaseException:
            self.close()
            raise
        self._ledger: tuple[float, dict[str, int]] = (0.0, {})

    # -- starting -------------------------------------------------------------------------------------
    def _start(self, model: nn.Module, device: torch.device, broker: str, sampler: SamplerConfig) -> str:
        cfg_dir = self._dir / "model"
        model.config.save_pretrained(cfg_dir)  # the architecture alone: the weights are shared
        sock = self._dir / "serve.sock"
        argv = [sys.executable, "-m", "rlmem", "serve", str(cfg_dir), "--weights", "shared"]
        argv += ["--broker", broker, "--uds", str(sock), "--device", str(device)]
        argv += ["--sampler-config", sampler.to_json(), "--exit-with", str(os.getpid())]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            # Its own session: a Ctrl-C at the terminal reaches this process alone, which ends the step, saves
            # and then stops the server.
            env = _server_env()
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True, env=env)
        url = f"unix://{sock}"
        t0 = time.monotonic()
        probe = RemoteEngine(url, timeout=5.0)
        try:
            while not probe.health():
                if self.proc.poll() is not None:
                    raise EngineLostError(
                        f"rlmem serve exited with code {self.proc.returncode} while starting; its output is "
                        f"in {self.log}"
                    )
                if time.monotonic() - t0 > _START_S:
                    raise EngineLostError(f"rlmem serve did not answer within {_START_S:g} s; see {self.log}")
                time.sleep(0.1)
        finally:
            probe.close()
        return url

    @staticmethod
    def _broker_of(url: str) -> str:
        probe = RemoteEngine(url, timeout=30.0)
        try:
            health = probe.health_info()
        finally:
            probe.close()
        broker = health.get("broker")
        if not broker:
            raise ValueError(
                f"engine_url: the server at {url} joined no broker; start it with rlmem serve "
                "--weights shared --broker PATH (rlmem colocate broker runs one)"
            )
        return str(broker)

    # -- the engine, as the loop and PhaseManager use it ------------------------------------------------
    def track_train_state(self, state: Any) -> None:
        """Report the trainer's state in the ledger (what its acquire needs back when the server sleeps)."""
        assert self.member is not None
        self.member.track_train_state(state)

    def sleep(self, level: int = 1) -> None:
        self._call(self.remote.sleep, level)
        self._ledger = (0.0, {})  # what the server holds has changed: read it again

    def wake(self, tags: Any = None) -> None:
        self._call(self.remote.wake, tags)
        self._ledger = (0.0, {})

    def sync_weights(self) -> None:
        """The policy's weights into the shared copy the server reads (a device-side cast-copy)."""
        self.shared.sync()

    def generate(self, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
        out, self._stats = self._call(self._generate, [list(p) for p in prompts], **kw)
        return out  # type: ignore[return-value]

    def _generate(self, prompts: list[list[int]], **kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
        out = self._guard(self.remote.generate, prompts, **kw)
        return out, self._guard(self.remote.stats)

    @property
    def batch_size(self) -> int:
        return int(self._stats.get("batch_size") or 0)

    @property
    def captures(self) -> int:
        return int(self._stats.get("captures") or 0)

    @property
    def kv_bytes(self) -> int:
        return int(self._stats.get("kv_bytes") or 0)

    def memory(self) -> dict[str, int]:
        """Bytes by :data:`SERVER_CATEGORIES`: the shared copy here, the server's holdings from the ledger
        (read at most every 20 ms)."""
        now = time.monotonic()
        if now - self._ledger[0] > 0.02 and self.member is not None:
            held: dict[str, int] = {}
            try:
                for m in self.member.status()["members"]:
                    if m.get("role") == "rollout":
                        held = {f"server_{k}": int(v) for k, v in (m.get("holdings") or {}).items()}
            except (ConnectionError, TimeoutError, KeyError):
                held = {}
            self._ledger = (now, held)
        return {"rollout_weights": self.shared.region.resident_bytes, **self._ledger[1]}

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """``fn`` through :meth:`_guard`, then, under torchrun, the ranks' agreement: a failure on any rank
        raises on every rank (:class:`EngineLostError` naming the rank whose server was lost, else
        rlmem's :class:`OutOfMemoryError` naming the rank that ran out of memory, else ``RuntimeError``)."""
        if self._group is None:
            return self._guard(fn, *args, **kw)
        failed: BaseException | None = None
        try:
            out = self._guard(fn, *args, **kw)
        except (KeyboardInterrupt, SystemExit):
            raise  # a second Ctrl-C stops this rank at once; torchrun ends the others
        except Exception as e:
            failed = e
        kind = "error"
        if isinstance(failed, EngineLostError):
            kind = "lost"
        elif isinstance(failed, torch.OutOfMemoryError):
            kind = "oom"
        mine = None if failed is None else (kind, f"rank {self._rank}: {failed}")
        every: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(every, mine, group=self._group)
        if failed is not None:
            if kind == "lost":
                raise EngineLostError(mine[1]) from failed  # type: ignore[index]
            raise failed
        others = [m for m in every if m is not None]
        if others:
            # the most telling: a lost server ends the run with its checkpoint; running out of memory is
            # what a caller that tries another size catches
            for want, exc in (("lost", EngineLostError), ("oom", OutOfMemoryError)):
                if hit := next((msg for k, msg in others if k == want), None):
                    raise exc(hit)
            raise RuntimeError(others[0][1])
        return out

    def _guard(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except (ConnectionError, PeerLostError, RemoteError, TimeoutError) as e:
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=2.0)  # a server that is going: let it go, to name its exit
                except subprocess.TimeoutExpired:
                    pass
            dead = self.proc is not None and self.proc.poll() is not None
            lost = isinstance(e, (ConnectionError, PeerLostError))
            if dead or lost:
                who = (
                    f"pid {self.proc.pid}, exit code {self.proc.returncode}"
                    if dead and self.proc
                    else self.url
                )
                raise EngineLostError(
                    f"the rollout server ({who}) was lost: {e}"
                    + (f"; its output is in {self.log}" if self.proc else "")
                ) from e
            raise

    def close(self) -> None:
        """Stop a server this process started (SIGTERM, then SIGKILL after 30 s), leave the broker."""
        remote = getattr(self, "remote", None)
        if remote is not None:
            remote.close()
            self.remote = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10.0)
        if self.member is not None:
            self.member.close()
            self.member = None
        if self.broker is not None:
            self.broker.close()
            self.broker = None
        if not self.shared.region.closed:
            self.shared.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# What torchrun puts in a rank's environment: a server started from a rank is a process of one.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
_LAUNCHER_VARS += ("ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _server_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")
    }
