"""SGLang's side of :class:`~rlmem.rollout.RemoteEngine`: which memory tags a sleep level releases,
which of them may be resumed, the sampling keys its ``/generate`` takes, and its ``flattened_bucket`` weight
format.

As SGLang's server behaves (read at sglang ``main`` cf7923615, 2026-08; paths under ``python/sglang/srt``):

- ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` take ``{"tags": [...] | null}`` (null or
  empty: all of ``kv_cache``, ``weights``, ``cuda_graph``; ``constants.py:2-10``,
  ``managers/scheduler_components/weight_updater.py:209-210, 251-252``).
- Resuming a tag that is not released is ``self.offload_tags.remove(tag)`` on a set, a ``KeyError``
  (``weight_updater.py:254-255``); a release while anything runs or waits fails ``assert
  self.is_fully_idle()`` (``weight_updater.py:203-205``). Either exception ends the scheduler, which sends
  SIGQUIT to its parent (``managers/scheduler.py:4957-4960``), whose handler kills the whole server
  (``managers/tokenizer_manager.py:3753-3762``): the HTTP caller gets no answer. So this client sends a tag's
  resume only after its own release of it, and a release only after its own generations have ended and the
  server has flushed its cache (``/flush_cache?timeout=``, which succeeds only once the scheduler is idle).
- The weights survive a release only on a server started with ``--enable-weights-cpu-backup``, and nothing
  is given back without ``--enable-memory-saver`` (``server_args.py:3329-3338``); ``GET /server_info`` has
  both as top-level keys (``entrypoints/http_server.py:771-806``). No endpoint says what is released.
- ``/health`` runs a one-token generation by default (``http_server.py:646-720``,
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``): not sent while the KV cache is released.
- ``sampling_params`` is splatted into ``SamplingParams(**kwargs)`` (``managers/tokenizer_manager.py:1339``):
  an unknown key is an error there (``sampling/sampling_params.py:54-82`` lists the keys; the seed is
  ``sampling_seed``). ``n`` samples come back prompt-major (``tokenizer_manager.py:1850-1870``); a completion
  cut short has ``meta_info.finish_reason.type == "abort"`` (``managers/schedule_batch.py:219-280``).
- ``POST /update_weights_from_tensor`` with ``load_format="flattened_bucket"``: ``serialized_named_tensors``
  is a list of base64 strings, one per tensor-parallel rank (each rank reads its own,
  ``managers/tp_worker.py:198-209``), each a ``ForkingPickler`` dump (``utils/common.py:2719-2758``, unpickled
  with an allow-list of ``torch.`` and ``sglang.srt.weight_sync.tensor_bucket.``) of ``{"flattened_tensor":
  uint8 tensor, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]}`` with
  byte offsets, read back as ``flat[start_idx:end_idx].view(dtype).reshape(shape)``
  (``weight_sync/tensor_bucket.py:7-107``, ``model_executor/.../weight_updater.py:330-385``).
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import importlib.util
import io
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

# SGLang's release order (its resume runs them in reverse; each request names them in this order).
ORDER = ("kv_cache", "weights", "cuda_graph")
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)
_RENAMED = {"seed": "sampling_seed"}
_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


def release_tags(level: int, info: Mapping[str, Any], released: Iterable[str], url: str) -> list[str]:
    """The tags a ``sleep(level)`` releases on a server whose ``/server_info`` is ``info``: every tag not
    released yet (the weights survive level 1 only where the server backs them up).

    Raises:
        ValueError: the server gives nothing back (no ``--enable-memory-saver``), or level 1 on a server
            that would discard the weights (no ``--enable-weights-cpu-backup``).
    """
    if not info.get("enable_memory_saver"):
        raise ValueError(
            f"sglang server at {url} was started without --enable-memory-saver: its release gives no memory "
            "back (start it with that flag)"
        )
    if level == 1 and not info.get("enable_weights_cpu_backup"):
        raise ValueError(
            f"sleep(level=1) keeps the weights, which the sglang server at {url} discards on release "
            "(started without --enable-weights-cpu-backup): start it with that flag, or use level 2 and "
            "update its weights after the wake"
        )
    done = set(released)
    return [t for t in ORDER if t not in done]


def resume_tags(asked: Sequence[str] | None, released: Iterable[str]) -> list[str]:
    """The tags of ``asked`` (None: all) to resume: those this client released, ``cuda_graph`` with
    ``kv_cache`` unless named on its own."""
    want = set(ORDER if asked is None else asked)
    if "kv_cache" in want:
        want.add("cuda_graph")
    done = set(released)
    return [t for t in ORDER if t in want and t in done]


def sampling_params(max_new_tokens: int, temperature: float, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """``sampling_params`` for SGLang's ``/generate`` (``seed`` becomes ``sampling_seed``).

    Raises:
        ValueError: a key SGLang's ``SamplingParams`` does not take (it would fail the request there).
    """
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    for k, v in sampling.items():
        key = _RENAMED.get(k, k)
        if key not in SAMPLING_KEYS:
            allowed = ", ".join(sorted(SAMPLING_KEYS))
            raise ValueError(
                f"sampling parameter {k!r} is not one SGLang takes; allowed: {allowed} (and seed, sent as "
                "sampling_seed)"
            )
        out[key] = v
    return out


def completions(out: Any, ids: bool) -> tuple[list[Any], int]:
    """The texts (token ids for token-id prompts) of ``/generate``'s answer, in its order (prompt-major),
    and how many came back aborted (cut short on the server's side)."""
    rows = out if isinstance(out, list) else [out]
    cut = sum(((r.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "abort" for r in rows)
    return [list(r["output_ids"]) if ids else r["text"] for r in rows], cut


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """The fields SGLang's bucket metadata has (pickled under SGLang's class name, see :func:`bucket`)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def bucket(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's flattened bucket of ``named`` tensors (one device): their bytes back to back in one uint8
    tensor, and where each lies."""
    flat, meta, at = [], [], 0
    for name, t in named:
        b = t.detach().contiguous().view(-1).view(torch.uint8)
        meta.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + b.numel(), b.numel()))
        flat.append(b)
        at += b.numel()
    if not flat:
        raise ValueError("update_weights_from_tensor: no tensors given")
    devices = {b.device for b in flat}
    if len(devices) > 1:
        where = sorted(map(str, devices))
        raise ValueError(f"update_weights_from_tensor: the tensors are on several devices, {where}")
    return {"flattened_tensor": torch.cat(flat), "metadata": meta}


def serialize(obj: Any) -> str:
    """``obj`` as SGLang's ``MultiprocessingSerializer`` takes it: a ``ForkingPickler`` dump (tensors by
    handle: CUDA IPC, or shared memory on the host), base64. The metadata is pickled under SGLang's class
    name, which SGLang's unpickler allows, without SGLang installed here."""
    from multiprocessing.reduction import ForkingPickler

    theirs = sys.modules.get(_BUCKET_MODULE)
    if theirs is None and importlib.util.find_spec("sglang") is not None:
        theirs = importlib.import_module(_BUCKET_MODULE)
    buf = io.BytesIO()
    if theirs is not None:  # SGLang is here: its own class
        ForkingPickler(buf).dump(_as_theirs(obj, theirs))
        return base64.b64encode(buf.getvalue()).decode()
    # pickle writes a class by its module's name, which must import: the names resolve to this class for
    # the dump only
    parts = _BUCKET_MODULE.split(".")
    added = [".".join(parts[: i + 1]) for i in range(len(parts))]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[_BUCKET_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]
    saved = FlattenedTensorMetadata.__module__
    FlattenedTensorMetadata.__module__ = _BUCKET_MODULE
    try:
        ForkingPickler(buf).dump(obj)
    finally:
        FlattenedTensorMetadata.__module__ = saved
        for name in added:
            del sys.modules[name]
    return base64.b64encode(buf.getvalue()).decode()


def _as_theirs(obj: dict[str, Any], module: types.ModuleType) -> dict[str, Any]:
    cls = module.FlattenedTensorMetadata
    return {**obj, "metadata": [cls(**dataclasses.asdict(m)) for m in obj["metadata"]]}
