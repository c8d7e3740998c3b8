"""rlmem in verl, in one line: ``export VERL_USE_EXTERNAL_MODULES=rlmem.integrations.verl``.

verl imports the modules that variable names in every one of its processes (``verl/__init__.py``), before
its engines. This module then makes the offload and reload of verl's FSDP (FSDP1 and FSDP2) and Megatron
engines go through a :class:`~rlmem.TrainState`, with verl's own offload flags
(``actor_rollout_ref.actor.fsdp_config.param_offload`` / ``optimizer_offload``, Megatron's the same) as
they are. As verl 0.9.1 moves an engine's state: every move goes through ``BaseEngine.to(device, model,
optimizer, grad)`` and the helpers it calls (``offload_fsdp_model_to_cpu``, ``load_fsdp_model_to_gpu``,
``offload_fsdp_optimizer``, ``load_fsdp_optimizer``, and ``offload_megatron_*`` / ``load_megatron_*``), which
the engines' modules also call directly for checkpoints and the weight sync. What changes:

- ``FSDPEngine.to`` and ``MegatronEngine.to`` adopt the engine's model and optimizer into a TrainState the
  first time they offload (forward-only engines, a reference model, are left to verl).
- The helper names the engines' modules imported point at rlmem's: for an adopted engine they offload and
  reload by category (the weights alone where verl asks for the weights alone), to pinned host memory that
  is allocated once, at the link's rate, with every device address the same after each reload; for anything
  else they are verl's own. The checkpoint and weight-sync paths read the offloaded state in place.
- ``RLMEM_VERL_OPTIMIZER=step``: the optimizer states stay in host memory when verl loads the engine for
  training and come back only for ``optimizer.step()``, going back after it (the update's peak is lower by
  their size). Default ``offload``: as verl asks.
- ``RLMEM_VERL_COMMS=suspend``: at the switch to rollout (the actor worker's ``update_weights``, just before
  the rollout's KV cache is woken) every NCCL group of the process is suspended
  (:func:`rlmem.comm.suspend`), until the next collective on any of them or the next time an engine enters
  its train or eval mode. Default ``keep``.

verl's version is checked first: one this module was not tested with is refused, naming the tested ones, and
so is a patched function whose signature is not the one tested; nothing is patched then. What is not
supported (refused where it would be adopted, left to verl otherwise) is in docs/verl.md.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import comm
from .._checks import check_choice
from ..train import TrainState

__all__ = [
    "COMMS_ENV",
    "OPTIMIZER_ENV",
    "TESTED",
    "Settings",
    "install",
    "patched",
    "settings",
    "state_of",
]

TESTED = ("0.9.1",)
COMMS_ENV = "RLMEM_VERL_COMMS"
OPTIMIZER_ENV = "RLMEM_VERL_OPTIMIZER"
COMMS = ("keep", "suspend")
OPTIMIZER = ("offload", "step")

_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_MEGATRON = "verl.workers.engine.megatron.transformer_impl"
_BASE = "verl.workers.engine.base"
_WORKERS = "verl.workers.engine_workers"

# Every function patched or replaced, with its parameters as verl 0.9.1 has them: a verl that renamed one or
# changed its parameters is refused rather than half-patched.
SIGNATURES: dict[tuple[str, str], str] = {
    (_FSDP, "FSDPEngine.to"): "self, device, model=True, optimizer=True, grad=True",
    (_FSDP, "offload_fsdp_model_to_cpu"): "model, empty_cache=True",
    (_FSDP, "load_fsdp_model_to_gpu"): "model",
    (_FSDP, "offload_fsdp_optimizer"): "optimizer",
    (_FSDP, "load_fsdp_optimizer"): "optimizer, device_id",
    (_MEGATRON, "MegatronEngine.to"): "self, device, model=True, optimizer=True, grad=True",
    (_MEGATRON, "offload_megatron_model_to_cpu"): "models",
    (_MEGATRON, "load_megatron_model_to_gpu"): "models, load_grad=True, load_frozen_params=True",
    (_MEGATRON, "offload_megatron_optimizer"): "optimizers",
    (_MEGATRON, "load_megatron_optimizer"): "optimizers",
    (_BASE, "BaseEngineCtx.__enter__"): "self",
    (_WORKERS, "ActorRolloutRefWorker.update_weights"): "self, global_steps=None, mode='auto'",
}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the environment asked for (read once, when this module is imported).

    Args:
        comms: ``RLMEM_VERL_COMMS``: ``"keep"`` (default) or ``"suspend"``.
        optimizer: ``RLMEM_VERL_OPTIMIZER``: ``"offload"`` (default: as verl asks) or ``"step"``.

    Raises:
        ValueError: a value not allowed, naming the variable.
    """

    comms: str = "keep"
    optimizer: str = "offload"

    def __post_init__(self) -> None:
        check_choice(COMMS_ENV, self.comms, COMMS)
        check_choice(OPTIMIZER_ENV, self.optimizer, OPTIMIZER)

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            comms=os.environ.get(COMMS_ENV, "keep").strip() or "keep",
            optimizer=os.environ.get(OPTIMIZER_ENV, "offload").strip() or "offload",
        )


_lock = threading.RLock()
_settings: Settings | None = None
_patched: dict[str, list[str]] = {}  # module name -> what was patched in it
_states: dict[int, TrainState] = {}  # id(engine.module) and id(engine.optimizer) -> its TrainState
_held: list[Any] = []  # the objects whose ids key _states: an id stays theirs while the process lives


def settings() -> Settings:
    """The settings in force (after :func:`install`)."""
    return _settings or Settings.from_env()


def patched() -> dict[str, list[str]]:
    """What has been patched so far, by verl module."""
    with _lock:
        return {k: list(v) for k, v in _patched.items()}


def state_of(engine: Any) -> TrainState | None:
    """The TrainState an engine's model was adopted into, or None (not adopted, or not yet)."""
    return _states.get(id(getattr(engine, "module", None)))


def verl_version() -> str:
    """The installed verl's version.

    Raises:
        ImportError: verl is not installed.
    """
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError as e:
        raise ImportError(
            "rlmem.integrations.verl needs verl installed (pip install 'rlmem[verl]'); it was tested with "
            f"verl {', '.join(TESTED)}"
        ) from e


def _params(fn: Any) -> str:
    out = []
    for p in inspect.signature(fn).parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        out.append(f"{prefix}{p.name}" + ("" if p.default is p.empty else f"={p.default!r}"))
    return ", ".join(out)


def _lookup(module: Any, dotted: str) -> Any:
    obj = module
    for part in dotted.split("."):
        obj = obj.__dict__[part] if isinstance(obj, type) else getattr(obj, part)
    return obj


def check_signatures(module: Any) -> None:
    """Raise unless every function this module patches in ``module`` is there with the tested parameters.

    Raises:
        RuntimeError: naming the function, the parameters found and the ones tested.
    """
    for (mod, dotted), want in SIGNATURES.items():
        if mod != module.__name__:
            continue
        try:
            got = _params(_lookup(module, dotted))
        except (AttributeError, KeyError) as e:
            raise RuntimeError(
                f"rlmem.integrations.verl: {mod}.{dotted} is not in verl {verl_version()} (tested with "
                f"{', '.join(TESTED)}); nothing was patched in {mod}"
            ) from e
        if got != want:
            raise RuntimeError(
                f"rlmem.integrations.verl: {mod}.{dotted} takes ({got}) in verl {verl_version()}, not "
                f"({want}) as in the versions tested ({', '.join(TESTED)}); nothing was patched in {mod}"
            )


# -- the engines' state -----------------------------------------------------------------------------


def _adopt(engine: Any) -> TrainState | None:
    """The engine's TrainState, adopting its model and optimizer the first time (None for a forward-only
    engine or one without a model yet)."""
    module = getattr(engine, "module", None)
    if module is None or getattr(getattr(engine, "engine_config", None), "forward_only", False):
        return None
    with _lock:
        state = _states.get(id(module))
        if state is None:
            name = type(engine).__name__
            if getattr(engine, "_uses_fsdp2_cpu_offload_policy", False):
                raise ValueError(
                    f"rlmem.integrations.verl cannot adopt verl's {name}: FSDP2's CPUOffloadPolicy "
                    "(fsdp_config.offload_policy) keeps its parameters in host memory already; turn it off "
                    "for rlmem to offload them, or unset VERL_USE_EXTERNAL_MODULES"
                )
            optimizer = getattr(engine, "optimizer", None)
            try:
                state = TrainState(
                    module, optimizer, optimizer_on_step=settings().optimizer == "step", name=f"verl {name}"
                )
            except ValueError as e:
                raise ValueError(
                    f"rlmem.integrations.verl cannot adopt verl's {name}: {e}. Unset "
                    "VERL_USE_EXTERNAL_MODULES for verl's own offload"
                ) from e
            for obj in (module, optimizer):
                if obj is not None:
                    _states[id(obj)] = state
                    _held.append(obj)
        return state


def _empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _offload(state: TrainState, *, model: bool, grads: str, optimizer: bool) -> None:
    state.offload(
        params="offload" if model else "keep",
        grads=grads if model else "keep",
        optimizer="offload" if optimizer else "keep",
        blocking=True,  # verl's rollout takes the device memory right after
    )
    _empty_cache()


def _reload(state: TrainState, *, model: bool, grads: bool, optimizer: bool) -> None:
    # With RLMEM_VERL_OPTIMIZER=step the states come back for optimizer.step() alone (TrainState's
    # optimizer_on_step), so a load of the optimizer leaves them where they are.
    optimizer = optimizer and settings().optimizer != "step"
    state.reload(params=model, buffers=model, grads=model and grads, optimizer=optimizer, blocking=True)


def _helpers(originals: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """rlmem's versions of verl's offload helpers: an adopted model or optimizer through its TrainState,
    anything else through verl's own helper."""

    def routed(name: str, how: Callable[..., None]) -> Callable[..., Any]:
        orig = originals[name]
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def helper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            state = _states.get(id(obj))
            if state is None:
                return orig(obj, *args, **kwargs)
            bound = sig.bind(obj, *args, **kwargs)
            bound.apply_defaults()
            rest = list(bound.arguments.items())[1:]  # after the model or optimizer itself
            how(state, **dict(rest))
            return None

        helper.__rlmem__ = True  # type: ignore[attr-defined]
        return helper

    table: dict[str, Callable[..., None]] = {
        # FSDP: verl's model offload moves the gradients with the parameters (Module.to); FSDP's are None
        # after the train mode's zero_grad, so "offload" keeps whatever is there.
        "offload_fsdp_model_to_cpu": lambda st, empty_cache=True: _offload(
            st, model=True, grads="offload", optimizer=False
        ),
        "load_fsdp_model_to_gpu": lambda st: _reload(st, model=True, grads=True, optimizer=False),
        "offload_fsdp_optimizer": lambda st: _offload(st, model=False, grads="keep", optimizer=True),
        "load_fsdp_optimizer": lambda st, device_id: _reload(st, model=False, grads=False, optimizer=True),
        # Megatron: verl's model offload drops the gradient buffer (resize to 0) and zeroes it on load;
        # "discard" does the same, and grads come back only when asked (load_grad).
        "offload_megatron_model_to_cpu": lambda st: _offload(
            st, model=True, grads="discard", optimizer=False
        ),
        "load_megatron_model_to_gpu": lambda st, load_grad=True, load_frozen_params=True: _reload(
            st, model=True, grads=load_grad, optimizer=False
        ),
        "offload_megatron_optimizer": lambda st: _offload(st, model=False, grads="keep", optimizer=True),
        "load_megatron_optimizer": lambda st: _reload(st, model=False, grads=False, optimizer=True),
    }
    return {name: routed(name, table[name]) for name in originals}


def _patch_engine(module: Any, cls_name: str, names: tuple[str, ...]) -> list[str]:
    cls = getattr(module, cls_name)
    orig_to = cls.__dict__["to"]
    if getattr(orig_to, "__rlmem__", False):
        return []

    @functools.wraps(orig_to)
    def to(self: Any, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> Any:
        if device == "cpu" and (model or optimizer):
            _adopt(self)
        return orig_to(self, device, model=model, optimizer=optimizer, grad=grad)

    to.__rlmem__ = True  # type: ignore[attr-defined]
    cls.to = to
    ours = _helpers({n: getattr(module, n) for n in names})
    for name, fn in ours.items():
        setattr(module, name, fn)
    return [f"{cls_name}.to", *names]


def _patch_fsdp(module: Any) -> list[str]:
    names = (
        "offload_fsdp_model_to_cpu",
        "load_fsdp_model_to_gpu",
        "offload_fsdp_optimizer",
        "load_fsdp_optimizer",
    )
    return _patch_engine(module, "FSDPEngine", names)


def _patch_megatron(module: Any) -> list[str]:
    names = (
        "offload_megatron_model_to_cpu",
        "load_megatron_model_to_gpu",
        "offload_megatron_optimizer",
        "load_megatron_optimizer",
    )
    return _patch_engine(module, "MegatronEngine", names)


# -- NCCL between phases ----------------------------------------------------------------------------


def suspend_comms() -> Any:
    """Suspend every NCCL group of this process until the next collective on one of them (all ranks of the
    trainer call it at the same point). Returns :func:`rlmem.comm.suspend`'s result."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return comm.suspend(None, resume_on_use=True)


def resume_comms() -> Any:
    """Resume what :func:`suspend_comms` suspended (a no-op when nothing is)."""
    if not comm.suspended():
        return None
    return comm.resume(None)


def _patch_base(module: Any) -> list[str]:
    if settings().comms != "suspend":
        return []
    cls = module.BaseEngineCtx
    orig = cls.__dict__["__enter__"]
    if getattr(orig, "__rlmem__", False):
        return []

    @functools.wraps(orig)
    def __enter__(self: Any) -> Any:
        resume_comms()  # an engine's phase starts: its collectives follow
        return orig(self)

    __enter__.__rlmem__ = True  # type: ignore[attr-defined]
    cls.__enter__ = __enter__
    return ["BaseEngineCtx.__enter__"]


def _patch_workers(module: Any) -> list[str]:
    if settings().comms != "suspend":
        return []
    cls = module.ActorRolloutRefWorker
    orig = cls.__dict__["update_weights"]
    if getattr(orig, "__rlmem__", False):
        return []

    @functools.wraps(orig)  # keeps verl's dispatch attributes (register's)
    async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        rollout = getattr(self, "rollout", None)
        wake = getattr(rollout, "resume", None)
        if wake is None:
            return await orig(self, *args, **kwargs)
        own = "resume" in getattr(rollout, "__dict__", {})

        async def resume(*a: Any, tags: Any = None, **kw: Any) -> Any:
            # The weights are synced and the engine offloaded: the rollout's KV cache is about to take the
            # memory, NCCL's included.
            if tags is not None and "kv_cache" in list(tags):
                suspend_comms()
            return await wake(*a, tags=tags, **kw)

        rollout.resume = resume
        try:
            return await orig(self, *args, **kwargs)
        finally:
            if own:
                rollout.resume = wake
            else:
                del rollout.resume

    update_weights.__rlmem__ = True  # type: ignore[attr-defined]
    cls.update_weights = update_weights
    return ["ActorRolloutRefWorker.update_weights"]


_PATCHES: dict[str, Callable[[Any], list[str]]] = {
    _FSDP: _patch_fsdp,
    _MEGATRON: _patch_megatron,
    _BASE: _patch_base,
    _WORKERS: _patch_workers,
}


def _apply(module: Any) -> None:
    with _lock:
        if module.__name__ in _patched:
            return
        check_signatures(module)
        _patched[module.__name__] = _PATCHES[module.__name__](module)


class _Loader(importlib.abc.Loader):
    """verl's own loader, then the patch, before anything can use the module."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _apply(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each of verl's engine modules as it is imported (verl imports this module from its own
    ``__init__``, before its engines)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PATCHES or name in _patched:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> list[str]:
    """Check verl's version and patch its engines: those imported already now, the others as they are
    imported. Idempotent; called when this module is imported. Returns the modules patched so far.

    Raises:
        ImportError: verl is not installed.
        RuntimeError: verl is a version this module was not tested with (naming those it was), or a
            function it patches changed (named); nothing is patched.
        ValueError: ``RLMEM_VERL_COMMS`` or ``RLMEM_VERL_OPTIMIZER`` has a value not allowed.
    """
    global _settings
    version = verl_version()
    if version not in TESTED:
        raise RuntimeError(
            f"rlmem.integrations.verl was tested with verl {', '.join(TESTED)}; this is verl {version}, "
            "whose engines it has not checked, so it patches nothing. Install a tested verl, or unset "
            "VERL_USE_EXTERNAL_MODULES / external_lib"
        )
    with _lock:
        _settings = Settings.from_env()
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
        for name in _PATCHES:
            if name in sys.modules and name not in _patched:
                _apply(sys.modules[name])
        return sorted(_patched)


install()
