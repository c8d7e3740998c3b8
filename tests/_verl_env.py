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
import subprocess
import sys
from pathlib import Path

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
    py = root / "bin" / "python"
    done = root / ".rlmem-ready"
    if done.is_file():
        return py, ""
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(root)],
        [str(py), "-m", "pip", "install", "-q", f"torch=={TORCH}"],
        [str(py), "-m", "pip", "install", "-q", "--no-deps", f"verl=={VERSION}"],
        [str(py), "-m", "pip", "install", "-q", *PACKAGES],
        [str(py), "-c", "import " + ", ".join(MODULES)],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return None, f"could not make verl's venv ({' '.join(cmd[2:5])}): {' | '.join(tail)}"
    done.write_text(VERSION)
    return py, ""


def with_rlmem(python: Path) -> str:
    """Install this checkout into the venv (editable, no dependencies: the venv's torch and transformers
    stay); "" or why it could not."""
    root = Path(__file__).resolve().parent.parent
    cmd = [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(root)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return f"could not install rlmem into verl's venv: {tail}"
    return ""
