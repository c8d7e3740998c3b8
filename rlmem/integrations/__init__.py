"""Glue to other frameworks, one module each, importing its framework lazily: ``megatron`` (what a
Megatron-Core trainer holds, and how ``PhaseManager`` treats it), ``trl`` (a callback for TRL's
``GRPOTrainer``), ``verl`` (verl's engines offloading through TrainState, loaded by verl from
``VERL_USE_EXTERNAL_MODULES``), ``vllm_transfer`` (rlmem as a vLLM weight-transfer backend, loaded in vLLM's
processes), and ``hf`` (the name :class:`~rlmem.rollout.HFSampler` was first published under). May import
:mod:`rlmem.memory`, :mod:`rlmem.plan`, :mod:`rlmem.train`, :mod:`rlmem.colocate`, :mod:`rlmem.rollout` and
the layers below them; the recipes and benchmarks import it.
"""

import importlib
from typing import Any

_MODULES = ("hf", "megatron", "trl", "verl", "vllm_transfer")


def __getattr__(name: str) -> Any:
    # `import rlmem` then `rlmem.integrations.trl.manage(trainer)`: a module (and its framework) is imported
    # when first named, not with the package
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_MODULES)
