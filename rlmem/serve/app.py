"""The HTTP endpoints of ``rlmem serve`` (FastAPI): what :class:`~rlmem.RemoteEngine`'s ``rlmem`` flavor
speaks.

- ``GET /health`` → ``{"status": "ok", "ready", "sleeping", "level", "model", "pid"}``;
  ``GET /is_sleeping`` → ``{"is_sleeping"}`` (vLLM's shape); ``GET /memory`` → the cache's shape and what
  the process holds (its ledger entry with a broker);
- ``POST /generate`` ``{"prompts": [str]} | {"input_ids": [[int]]}, "max_new_tokens", "temperature",
  "top_p", "seed", "n"`` → ``{"output_ids", "completions" (with a tokenizer), "tokens", "seconds"}``
  (``n`` completions per prompt, prompt-major, each prompt's in a row); without
  ``max_new_tokens``, the room the longest prompt leaves within the server's ``max_len``, at most 256 (a
  prompt that leaves none is a 400);
- ``POST /sleep {"level": 1 | 2}``, ``POST /wake {"tags": ["weights", "kv_cache"] | null}``;
- ``POST /update_weights_from_tensor {"tensors": [...]}``: handles of another process's tensors
  (:func:`~rlmem.colocate.ipc.share_tensors`: CUDA IPC, or shared memory on the host), copied in by name;
- ``POST /flush_cache`` (no body, or ``{}``): there is no prefix cache to drop; answers ``{"flushed": true}``.

A malformed request is a 422 naming the field, a bad value a 400, a request the server cannot do now
(asleep, no weights yet) a 409, a device without the memory a 503 (``"out of memory: ..."``); every error
body is ``{"detail": message}`` (a 422's message is pydantic's list of errors, each with its field's
``loc``) and the server keeps serving. Types are strict, as rlmem's own argument checks are: a bool is not
an int (``{"level": true}`` is not level 1), a float is not a count (``"max_new_tokens": 3.0``), a string is
not a number; a float field takes an int (``"temperature": 1``) but not infinity or NaN. With a token every
request but ``/health`` needs ``Authorization: Bearer TOKEN`` (401 otherwise).
"""

from __future__ import annotations

import hmac
import os
from typing import Any, Literal

import torch
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from .core import NotReadyError, ServedModel

__all__ = ["make_app"]


class _Strict(BaseModel):
    """Strict types, unknown fields refused: pydantic's lax mode would take ``true`` for 1 and ``3.0`` or
    ``"3"`` for 3, which rlmem's own argument checks refuse, so a client's mistake would run as something
    it did not ask for."""

    model_config = ConfigDict(extra="forbid", strict=True)


class GenerateRequest(_Strict):
    prompts: list[str] | None = None
    input_ids: list[list[int]] | None = None
    # None: what fits max_len, at most 256 (rollout.engine.generation_length); the sampling fields state the
    # rule of _checks.check_sampling, so a bad value is a 422 here
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    # completions per prompt, as vLLM's and SGLang's n: prompt-major, each prompt's n in a row (a group,
    # whose prompt a sampler with share_prompts holds once)
    n: int = Field(1, ge=1, le=4096)


class SleepRequest(_Strict):
    # An int with bounds, not Literal[1, 2]: pydantic matches a literal by equality even in strict mode,
    # so ``true`` would be level 1.
    level: int = Field(1, ge=1, le=2)


class WakeRequest(_Strict):
    tags: list[Literal["weights", "kv_cache"]] | None = None


class _Handle(_Strict):
    """The types of the fields :func:`~rlmem.colocate.ipc.open_tensors` reads (it coerces with ``int()``
    and ``bool()``). A field left out stays out, for it to refuse with a 400 naming it; fields it does not
    read are let through, the layout being ``share_tensors``'s."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    dtype: str | None = None
    kind: str | None = None
    shape: list[int] | None = None
    stride: list[int] | None = None
    offset: int | None = None
    storage_bytes: int | None = None
    handle: str | None = None
    manager: str | None = None  # kind "shm"; the rest are "cuda_ipc"'s
    device: int | None = None
    storage_offset_bytes: int | None = None
    ref_counter_handle: str | None = None
    ref_counter_offset: int | None = None
    event_handle: str | None = None
    event_sync_required: bool | None = None


class TensorsRequest(_Strict):
    tensors: list[_Handle]


class FlushRequest(_Strict):
    """Nothing to give; a body with a field in it is a 422 rather than ignored."""


def make_app(core: ServedModel, *, token: str | None = None) -> Any:
    """The FastAPI application serving ``core``."""

    def check_token(authorization: str | None = Header(default=None)) -> None:
        if token is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong token: send Authorization: Bearer TOKEN")

    app = FastAPI(title="rlmem serve", docs_url=None, redoc_url=None)
    auth = [Depends(check_token)]

    async def oom(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"out of memory: {exc}"}, status_code=503)

    def error(status: int) -> Any:
        async def handler(request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse({"detail": str(exc)}, status_code=status)

        return handler

    app.add_exception_handler(ValueError, error(400))
    app.add_exception_handler(NotReadyError, error(409))
    app.add_exception_handler(torch.OutOfMemoryError, oom)  # rlmem's OutOfMemoryError among them
    app.add_exception_handler(TimeoutError, error(503))  # a fence or grant that did not come in time
    app.add_exception_handler(ConnectionError, error(503))  # the broker or the trainer went away
    app.add_exception_handler(Exception, error(500))  # answered with its message; the server goes on

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "ready": core.sampler is not None,
            "sleeping": core.level > 0,
            "level": core.level,
            "model": core.name,
            "pid": os.getpid(),
            "broker": None if core.member is None else str(core.member.path),
        }

    @app.get("/is_sleeping", dependencies=auth)
    def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": core.level > 0}

    @app.get("/memory", dependencies=auth)
    def memory() -> dict[str, Any]:
        return core.stats()

    @app.post("/generate", dependencies=auth)
    def generate(req: GenerateRequest) -> dict[str, Any]:
        """Completions; without ``max_new_tokens`` as many tokens as the longest prompt leaves room for
        within ``max_len``, at most 256 (:meth:`ServedModel.generate`), a 400 naming the prompt's length and
        ``max_len`` when it leaves none."""
        return core.generate(**req.model_dump())

    @app.post("/sleep", dependencies=auth)
    def sleep(req: SleepRequest) -> dict[str, Any]:
        return core.do_sleep(req.level)

    @app.post("/wake", dependencies=auth)
    def wake(req: WakeRequest) -> dict[str, Any]:
        return core.do_wake(req.tags)

    @app.post("/update_weights_from_tensor", dependencies=auth)
    def update(req: TensorsRequest) -> dict[str, Any]:
        return core.update_from_tensors([h.model_dump(exclude_unset=True) for h in req.tensors])

    @app.post("/flush_cache", dependencies=auth)
    def flush_cache(req: FlushRequest | None = None) -> dict[str, bool]:
        return {"flushed": True}

    return app
