"""``rlmem serve MODEL``: load the model (what ``rlmem train`` accepts, or a config alone whose weights a
trainer shares), size its KV cache, and serve it over HTTP (uvicorn) on a Unix socket or 127.0.0.1."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import secrets
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "serve_parser"]

from .._dtypes import DTYPE_NAMES as DTYPES
from .._dtypes import torch_dtype
from .._extras import need


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlmem serve",
        description="Serve a model for rollout: generate, sleep/wake by level and tag, weight updates.",
    )
    p.add_argument(
        "model",
        help="'tiny', a preset, a save_pretrained directory, a GGUF file or package (as rlmem train "
        "takes); with --weights shared, a directory with the config.json alone",
    )
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights (auto: bf16 on GPU)")
    p.add_argument("--compute-dtype", default=None, choices=list(DTYPES), help="autocast to this dtype")
    p.add_argument("--max-len", type=int, default=None, help="prompt + completion tokens (default 2048)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences the KV cache holds (default 16)")
    p.add_argument("--kv-budget", default=None, help="bytes the KV cache may take instead (e.g. 20GiB)")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"])
    p.add_argument(
        "--share-prompts",
        action="store_true",
        help="hold a prompt once in the KV cache for the completions of it in one request (n, or repeats)",
    )
    p.add_argument("--pad-id", type=int, default=None, help="without a tokenizer: the pad token id")
    p.add_argument("--eos-id", type=int, default=None, help="without a tokenizer: the EOS token id")
    p.add_argument(
        "--sampler-config",
        default=None,
        help="the sampler's settings as one JSON object (rlmem.rollout.sampler.SamplerConfig), instead of "
        "--max-len, --batch-size, --kv-budget, --compute-dtype, --cuda-graphs, --pad-id and --eos-id",
    )
    p.add_argument("--seed", type=int, default=0, help="for the random weights of 'tiny' and presets")
    p.add_argument(
        "--weights",
        default="model",
        choices=["model", "shared"],
        help="shared: the weights come from a trainer through --broker (the model is built empty)",
    )
    p.add_argument("--broker", default=None, help="join the device's broker at this socket (role rollout)")
    p.add_argument("--uds", default=None, help="listen on this Unix socket (its directory made private)")
    p.add_argument("--host", default="127.0.0.1", help="TCP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="TCP port (default 30000)")
    p.add_argument("--token", default=None, help="required bearer token (default $RLMEM_SERVE_TOKEN)")
    p.add_argument("--exit-with", type=int, default=None, help=argparse.SUPPRESS)  # the trainer's pid
    return p


def _say(msg: str) -> None:
    print(f"rlmem serve: {msg}", file=sys.stderr, flush=True)


def _device(spec: str) -> Any:
    import torch

    if spec == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: no CUDA device here")
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"--device must be cuda, cuda:N, cpu or auto, got {spec!r}")
    return dev


class _CharText:
    """The tiny model's character tokenizer, as the server uses one."""

    def __init__(self) -> None:
        from ..models.tiny import CharTokenizer

        self.tok = CharTokenizer()
        self.pad_id, self.eos_id = self.tok.PAD, self.tok.EOS

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, bos=True)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class _HFText:
    def __init__(self, tok: Any) -> None:
        self.tok, self.pad_id, self.eos_id = tok, tok.pad_id, tok.eos_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode_prompt(text)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


# the flags --sampler-config replaces, with their defaults
_SAMPLER_FLAGS = {
    "max_len": None,
    "batch_size": None,
    "kv_budget": None,
    "compute_dtype": None,
    "cuda_graphs": "auto",
    "pad_id": None,
    "eos_id": None,
}


def _sampler_config(args: argparse.Namespace) -> Any:
    """The ``--sampler-config`` JSON as a SamplerConfig, or None without it."""
    if args.sampler_config is None:
        return None
    from ..rollout.sampler.config import SamplerConfig

    both = [k for k, v in _SAMPLER_FLAGS.items() if getattr(args, k) != v]
    if both:
        flags = ", ".join("--" + k.replace("_", "-") for k in both)
        raise ValueError(f"--sampler-config holds the sampler's settings: leave out {flags}")
    try:
        return SamplerConfig.from_json(args.sampler_config)
    except ValueError as e:
        raise ValueError(f"--sampler-config: {e}") from None


def _from_flags(args: argparse.Namespace, model: Any, tok: Any) -> Any:
    """The sampler's config from the flags; what they leave out from the tokenizer and the model."""
    from .._units import parse_bytes
    from ..rollout.sampler.config import SamplerConfig

    pad = args.pad_id if args.pad_id is not None else getattr(tok, "pad_id", None)
    eos = args.eos_id if args.eos_id is not None else getattr(tok, "eos_id", None)
    if pad is None or eos is None:
        raise ValueError("without a tokenizer in the model's directory, give --pad-id and --eos-id")
    budget = None if args.kv_budget is None else parse_bytes(args.kv_budget, "--kv-budget")
    return SamplerConfig(
        max_len=args.max_len or min(2048, int(getattr(model.config, "max_position_embeddings", 2048))),
        batch_size=None if budget is not None else args.batch_size or 16,
        kv_budget_bytes=budget,
        pad_token_id=pad,
        eos_token_id=eos,
        compute_dtype=args.compute_dtype,
        cuda_graphs=args.cuda_graphs,
        share_prompts=args.share_prompts,
    )


def load(args: argparse.Namespace, device: Any, max_len: int | None = None) -> tuple[Any, Any]:
    """The model (on the meta device with ``--weights shared``) and its tokenizer (or None); ``max_len``:
    the sequences it must position ('tiny' is built for them)."""
    import torch

    from ..models.load import empty_model, load_model
    from ..models.tokenizer import load_tokenizer

    if args.weights == "shared":
        model = empty_model(args.model)
        tok = None
        try:
            tok = _HFText(load_tokenizer(args.model, chat_template="none"))
        except ValueError:
            pass
        return model.eval(), tok
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto if args.dtype == "auto" else torch_dtype(args.dtype)
    tok: Any = None
    if args.model == "tiny":
        tok = _CharText()
        model = load_model(
            "tiny", device, dtype, seed=args.seed, vocab=tok.tok.vocab_size, max_len=max_len or 0
        )
    else:
        model = load_model(args.model, device, dtype, seed=args.seed)
        try:
            tok = _HFText(load_tokenizer(args.model, chat_template="none"))
        except ValueError:
            tok = None
    return model.eval(), tok


def _check_uds(path: Path, token: str | None) -> None:
    d = path.parent
    if not d.exists():
        d.mkdir(parents=True, mode=0o700)
    mode = d.stat().st_mode
    if token is None and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"--uds: {str(d)!r} is open to other users; use a private directory or give --token")


def _watch_parent(pid: int, server: Any) -> None:
    def loop() -> None:
        while not server.should_exit:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                _say(f"the process that started it (pid {pid}) is gone: stopping")
                server.should_exit = True
                return
            time.sleep(0.5)

    threading.Thread(target=loop, name="rlmem-serve-parent", daemon=True).start()


def _server_class(uvicorn: Any) -> Any:
    class Server(uvicorn.Server):
        """SIGTERM and SIGINT stop it gracefully, and then the process cleans up and exits 0 (uvicorn's own
        handling raises the signal again once stopped, which would skip the clean-up)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    return Server


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rlmem serve``."""
    p = serve_parser()
    args = p.parse_args(argv)
    try:
        return _run(args)
    except ValueError as e:
        p.error(str(e))
    return 2


def _run(args: argparse.Namespace) -> int:
    # before anything is loaded: without the extra, one line naming it rather than a traceback
    need("fastapi", extra="serve", what="rlmem serve")
    uvicorn = need("uvicorn", extra="serve", what="rlmem serve")

    from ..colocate import Member
    from .app import make_app
    from .core import ServedModel

    token = args.token or os.environ.get("RLMEM_SERVE_TOKEN") or None
    if args.uds is None and token is None:
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"--host {args.host}: listening beyond this machine needs --token")
        token = secrets.token_urlsafe(24)
        _say(f"token (pass --token to choose one): {token}")
    if args.uds is not None:
        _check_uds(Path(args.uds), token)
    given = _sampler_config(args)
    for name in ("max_len", "batch_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {v}")
    if args.seed < 0:
        raise ValueError(f"--seed must be an int >= 0, got {args.seed}")
    device = _device(args.device)
    if device.type == "cuda":
        import torch

        # Made current before anything touches CUDA: a call that takes no device (a stream, a synchronize,
        # a graph's pool) otherwise opens a context on GPU 0, some 500 MiB there per server of another GPU.
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    _say(
        f"loading {args.model} on {device}"
        + (" (weights from the trainer)" if args.weights == "shared" else "")
    )
    model, tok = load(args, device, given.max_len if given is not None else args.max_len)
    n = sum(p.numel() for p in model.parameters())
    _say(f"loaded {n / 1e6:.1f}M parameters in {time.perf_counter() - t0:.1f} s")
    sc = given or _from_flags(args, model, tok)
    if device.type != "cuda":
        sc = dataclasses.replace(sc, cuda_graphs="off")
    kw = sc.sampler_kwargs()
    member = None
    if args.broker is not None:
        member = Member("rollout", path=args.broker, device=device, name=f"rlmem serve {args.model}")
    core = ServedModel(model, tokenizer=tok, sampler=kw, member=member, name=str(args.model), device=device)
    if core.sampler is not None:
        s = core.sampler
        _say(f"KV cache: {s.batch_size} sequences x {s.max_len} tokens ({s.kv_bytes / 2**30:.2f} GiB)")
    stop = threading.Event()
    if member is not None:
        core.serve_broker(stop)
    config = uvicorn.Config(
        make_app(core, token=token),
        uds=args.uds,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=30,
    )
    server = _server_class(uvicorn)(config)
    where = f"unix:{args.uds}" if args.uds else f"http://{args.host}:{args.port}"

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            _say(f"listening on {where}")

    threading.Thread(target=announce, daemon=True).start()
    if args.exit_with is not None:
        _watch_parent(args.exit_with, server)
    try:
        server.run()  # SIGTERM and SIGINT end it gracefully (requests in flight are finished)
    finally:
        stop.set()
        core.close()
        if args.uds:
            Path(args.uds).unlink(missing_ok=True)
    _say("stopped")
    return 0
