"""verl's own code for the tests: verl (PyPI) in a venv of its own, made once per machine and kept
(``RLMEM_VERL_VENV``, default ``~/.cache/rlmem/verl-<version>``). verl pins transformers < 5.11 and
Python < 3.13, which this checkout's environment does not meet.

verl is installed without its dependencies (ray[default], wandb, tensorboard, ... : none of them is needed
to import its training engines), then the packages that importing its engines and workers needs, at
versions with which they were seen to import; the last step imports them.

:func:`venv` makes (or finds) it, or says why it cannot; :func:`with_rlmem` installs this checkout into it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _helpers import install_checkout, make_venv

VERSION = "0.9.1"
TORCH = "2.13.0"
# What importing verl's engines and engine_workers needs (verl.protocol imports ray; verl.utils.dataset
# imports datasets and PIL; verl.workers.rollout.utils imports fastapi and uvicorn).
PACKAGES = (
    "numpy==2.4.6",
    "packaging==25.0",
    "ray==2.60.0",
    "tensordict==0.10.0",
    "transformers==5.10.4",
    "omegaconf==2.4.0",
    "peft==0.21.2",
    "codetiming==1.4.0",
    "datasets==5.2.0",
    "pillow==13.0.0",
    "fastapi==0.165.0",
    "uvicorn==0.54.0",
    "megatron-core==0.16.1",
)
MODULES = (
    "verl",
    "verl.utils.fsdp_utils",
    "verl.utils.megatron_utils",
    "verl.workers.engine.base",
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.megatron.transformer_impl",
    "verl.workers.engine_workers",
)


def venv() -> tuple[Path | None, str]:
    """(the venv's python, "") once verl's engines import there, or (None, why not)."""
    if not (3, 10) <= sys.version_info[:2] <= (3, 12):
        return None, f"verl {VERSION} needs Python >= 3.10, < 3.13 (this is {sys.version.split()[0]})"
    root = Path(os.environ.get("RLMEM_VERL_VENV", Path.home() / ".cache" / "rlmem" / f"verl-{VERSION}"))
    install = [
        ["{python}", "-m", "pip", "install", "-q", f"torch=={TORCH}"],
        ["{python}", "-m", "pip", "install", "-q", "--no-deps", f"verl=={VERSION}"],
        ["{python}", "-m", "pip", "install", "-q", *PACKAGES],
        ["{python}", "-c", "import " + ", ".join(MODULES)],
    ]
    return make_venv(root, install, "verl's venv", VERSION)


def with_rlmem(python: Path) -> str:
    """Install this checkout into the venv (the venv's torch and transformers stay); "" or why not."""
    return install_checkout(python, "verl's venv")
