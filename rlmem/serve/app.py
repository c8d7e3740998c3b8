"""The HTTP endpoints of ``rlmem serve`` (FastAPI): what :class:`~rlmem.RemoteEngine`'s ``rlmem`` flavor
speaks.

- ``GET /health`` → ``{"status": "ok", "ready", "sleeping", "level", "model", "pid"}``;
  ``GET /is_sleeping`` → ``{"is_sleeping"}`` (vLLM's shape); ``GET /memory`` → the cache's shape and what
  the process holds (its ledger entry with a broker);
- ``POST /generate`` ``{"prompts": [str]} | {"input_ids": [[int]]}, "max_new_tokens", "temperature",
  "top_p", "seed"`` → ``{"output_ids", "completions" (with a tokenizer), "tokens", "seconds"}``;
- ``POST /sleep {"level": 1 | 2}``, ``POST /wake {"tags": ["weights", "kv_cache"] | null}``;
- ``POST /update_weights_from_tensor {"tensors": [...]}``: handles of another process's tensors
  (:func:`~rlmem.colocate.ipc.share_tensors`: CUDA IPC, or shared memory on the host), copied in by name;
- ``POST /flush_cache``: there is no prefix cache to drop; answers ``{"flushed": true}``.

A malformed request is a 422 naming the field, a bad value a 400, a request the server cannot do now
(asleep, no weights yet) a 409, a device without the memory a 503 (``"out of memory: ..."``); every error
body is
``{"detail": message}`` and the server keeps serving. With a token every request but ``/health`` needs
``Authorization: Bearer TOKEN`` (401 otherwise).
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
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Strict):
    prompts: list[str] | None = None
    input_ids: list[list[int]] | None = None
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None


class SleepRequest(_Strict):
    level: Literal[1, 2] = 1


class WakeRequest(_Strict):
    tags: list[Literal["weights", "kv_cache"]] | None = None


class TensorsRequest(_Strict):
    tensors: list[dict[str, Any]]


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
        return core.generate(**req.model_dump())

    @app.post("/sleep", dependencies=auth)
    def sleep(req: SleepRequest) -> dict[str, Any]:
        return core.do_sleep(req.level)

    @app.post("/wake", dependencies=auth)
    def wake(req: WakeRequest) -> dict[str, Any]:
        return core.do_wake(req.tags)

    @app.post("/update_weights_from_tensor", dependencies=auth)
    def update(req: TensorsRequest) -> dict[str, Any]:
        return core.update_from_tensors(req.tensors)

    @app.post("/flush_cache", dependencies=auth)
    def flush_cache() -> dict[str, bool]:
        return {"flushed": True}

    return app
