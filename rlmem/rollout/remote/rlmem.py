"""rlmem's own server (``rlmem serve``) as an engine of this process: :class:`RlmemRemote`.

Its endpoints: ``POST /sleep {"level": L}``, ``POST /wake {"tags": [...] | null}``, ``POST /generate``
``{"prompts" | "input_ids", "max_new_tokens", "temperature", ...}``, ``POST /update_weights_from_tensor``
(rlmem's handles), ``POST /flush_cache``, ``GET /memory``, ``GET /health`` (ready, sleeping, pid, the broker
it joined). A server started with ``--broker`` takes its memory handoff through the broker instead
(``member=``: see :mod:`rlmem.rollout.remote.base`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from ..engine import generation_length
from .base import RemoteEngine

__all__ = ["RlmemRemote"]


class RlmemRemote(RemoteEngine):
    """``rlmem serve`` driven by the engine protocol: ``RemoteEngine(url)`` (the default flavor).

    Example:
        >>> engine = RemoteEngine("unix:///tmp/rlmem.sock", device="cuda:0")
        >>> pm.add_engine(engine)   # doctest: +SKIP
    """

    flavor: ClassVar[str] = "rlmem"
    joins_broker: ClassVar[bool] = True

    def _release(self, level: int) -> bool:
        self._call("POST", "/sleep", json={"level": level})
        return True

    def _resume(self, tags: list[str] | None) -> bool:
        self._call("POST", "/wake", json={"tags": tags})
        return True

    def _generate(
        self,
        prompts: Sequence[Any],
        ids: bool,
        max_new_tokens: int | None,
        temperature: float,
        sampling: dict,
    ) -> Any:
        # no max_new_tokens: the server applies the same default, bounded by the room its cache leaves
        params = {"temperature": temperature, **sampling}
        if max_new_tokens is not None:
            params["max_new_tokens"] = generation_length(max_new_tokens)
        if ids:
            body = {"input_ids": [[int(t) for t in p] for p in prompts], **params}
            out = self._call("POST", "/generate", json=body, timeout=self.timeout)
            outs = [list(o) for o in out["output_ids"]]
        else:
            body = {"prompts": list(prompts), **params}
            outs = list(self._call("POST", "/generate", json=body, timeout=self.timeout)["completions"])
        return self._grouped(outs, 0, int(sampling.get("n", 1)), len(prompts))

    def update_weights_from_tensor(
        self, named: Any, *, partial: bool = False, check: bool = True
    ) -> dict[str, Any]:
        """Send ``named`` tensors (a mapping or ``(name, tensor)`` pairs) by rlmem's handles (CUDA IPC, or
        shared memory on the host): the server copies them into its weights by name before answering, so
        they may change once this returns. ``partial`` and ``check`` are SGLang's; the server checks every
        name and shape itself."""
        from ...colocate.ipc import share_tensors

        pairs = list(named.items()) if isinstance(named, dict) else list(named)
        return self._call("POST", "/update_weights_from_tensor", json={"tensors": share_tensors(pairs)})

    def stats(self) -> dict[str, Any]:
        """The cache's shape and what the server process holds (``GET /memory``)."""
        return self._call("GET", "/memory")

    def is_sleeping(self) -> bool:
        return bool(self._call("GET", "/health")["sleeping"])
