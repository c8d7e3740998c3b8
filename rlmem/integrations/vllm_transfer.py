"""rlmem as a vLLM weight-transfer backend (``"rlmem"``): vLLM's workers map the trainer's
:class:`~rlmem.colocate.SharedWeights` and load their weights from it, with no copy of handles per tensor.

Loaded inside vLLM's processes through its plugin entry point (``vllm.general_plugins``, installed with
rlmem): :func:`register` adds the backend to vLLM's ``WeightTransferEngineFactory``. A server started with
``--weight-transfer-config '{"backend": "rlmem"}'`` (and ``VLLM_SERVER_DEV_MODE=1``) then takes:

- ``POST /init_weight_transfer_engine {"init_info": {"socket": PATH}}``: each worker connects to the Unix
  socket the trainer serves (:class:`~rlmem.rollout.RemoteEngine` makes it, private to the user) and
  receives the shared weights' layout and the descriptors of their memory (file descriptors passed over the
  socket: no pickle), which it maps once;
- ``/start_weight_update``, ``/update_weights {"update_info": {"names": [...] | null, "partial": bool}}``,
  ``/finish_weight_update``: vLLM's layerwise reload around ``model.load_weights`` over the mapped views (all
  names, or those given), as its own IPC backend loads; a sync is one pass over memory the two processes
  share, on the device on a GPU;
- ``/update_weights {"update_info": {"action": "verify", "names": ...}}`` (a session of its own, after the
  load's): what the model holds compared with what loading the shared weights gives
  (:func:`rlmem.integrations._weight_check.shadow_verify`); differences raise, naming the parameters.

What vLLM's own reload does not do, this backend does (vLLM 0.32's code, ``model_executor/model_loader/``):

- **The update is checked before anything is loaded.** ``reload/layerwise.py`` puts every layer on the meta
  device at ``start_weight_update`` and loads what comes: a weight larger than the model's is narrowed
  silently (``parameter.py``, ``load_column_parallel_weight``), a partial set leaves layers old, and any
  exception leaves meta tensors in the model (its next request kills the engine core) and buffered weights
  that the next update replays. Here the whole update is checked against the checkpoint the server loaded
  (its safetensors headers: names, shapes, dtypes; the set complete unless ``partial``; a tied pair
  consistent) before the reload starts; a refused update changes nothing. An exception while loading puts
  every layer's own tensors back and forgets what was buffered.
- **A tied ``lm_head`` follows its embedding.** The reload processes each layer that loaded weights; a tied
  ``lm_head`` loads none (``load_weights`` skips it), so what its quantization method made at load time stays
  (``reload/__init__.py``, limitation 2). On the CPU that is a packed copy of the old weight
  (``vocab_parallel_embedding.py`` -> ``layers/utils.py`` ``dispatch_cpu_unquantized_gemm``): after every
  update it is made again here. On a GPU the same method does nothing and the head reads the embedding's
  parameter, which the reload updated in place: the same call, a no-op there.

``RemoteEngine(flavor="vllm").update_weights(weights)`` drives these calls. Where rlmem cannot be installed in
the server's environment, ``update_weights(weights, backend="ipc")`` speaks vLLM's own ``ipc`` backend instead
(``rlmem/rollout/remote/vllm.py``: a staging buffer exported by CUDA IPC, a copy per chunk).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..colocate import wire
from ..colocate.weight_check import Checkpoint, check_update, read_checkpoint, shadow_verify
from ..colocate.weights import AttachedWeights, attach_weights

NAME = "rlmem"
ACTIONS = ("load", "verify")
_PROBE_COLUMNS = 8  # one-hot rows per packed weight: its first and last input column and six others

log = logging.getLogger(__name__)


@dataclass
class RLMemInitInfo(WeightTransferInitInfo):
    """Where the trainer hands out its shared weights: a Unix socket, and how long to wait for it."""

    socket: str
    timeout: float = 60.0


@dataclass
class RLMemUpdateInfo(WeightTransferUpdateInfo):
    """The names to load (None: every shared weight); ``partial``: a subset of the model's weights is
    meant; ``action``: ``"load"``, or ``"verify"`` (compare what the model holds with the shared weights)."""

    names: list[str] | None = None
    partial: bool = False
    action: str = "load"


class RLMemWeightTransferEngine(WeightTransferEngine[RLMemInitInfo, RLMemUpdateInfo]):
    """A vLLM worker's side of the ``"rlmem"`` backend (see the module docstring)."""

    init_info_cls = RLMemInitInfo
    update_info_cls = RLMemUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.attached: AttachedWeights | None = None
        self.checkpoint: Checkpoint | None = None  # what the server loaded: updates are checked against it
        self._checkpoint_read = False
        self._loading = False  # a layerwise reload is open on the model
        self._socket: str | None = None
        self._hf_meta: Any = None  # transformers' model of the served one on the meta device (False: none)
        self._timeout = 10.0

    def init_transfer_engine(self, init_info: RLMemInitInfo) -> None:
        sock = wire.connect(init_info.socket, timeout=init_info.timeout)
        try:
            wire.check_peer(sock)  # the trainer's process, of this user
            wire.send(sock, {"op": "attach"})
            msg, fds = wire.recv(sock, timeout=init_info.timeout)
        finally:
            sock.close()
        self._socket, self._timeout = init_info.socket, init_info.timeout
        if self.attached is not None:
            self.attached.close()
        self.attached = attach_weights(msg["spec"], fds)
        if not self._checkpoint_read:
            self._checkpoint_read = True
            where = {"revision": getattr(self.model_config, "revision", None)}
            where["download_dir"] = getattr(
                getattr(self.vllm_config, "load_config", None), "download_dir", None
            )
            try:
                self.checkpoint = read_checkpoint(str(self.model_config.model), where)
            except LookupError as e:
                log.warning(
                    "rlmem weight transfer: updates are not checked before loading (names, shapes, "
                    "completeness): the checkpoint the server loaded cannot be read here: %s",
                    e,
                )

    def start_weight_update(self) -> None:
        # The layerwise reload starts once the update is known good (receive_weights): started here, a
        # refused update would leave the model on the meta device.
        self._loading = False

    def receive_weights(self, update_info: RLMemUpdateInfo) -> None:
        if self.attached is None:
            raise RuntimeError("rlmem weight transfer: init_weight_transfer_engine was not called")
        if update_info.action not in ACTIONS:
            raise ValueError(
                f"rlmem weight transfer: action must be one of {ACTIONS}, got {update_info.action!r}"
            )
        views = self.attached.tensors
        names = list(views) if update_info.names is None else list(update_info.names)
        unknown = [n for n in names if n not in views]
        if unknown:
            raise ValueError(f"rlmem weight transfer: no shared weight named {unknown[0]!r}")
        if update_info.action == "verify":
            try:
                took = self.verify(names)
            except RuntimeError as e:
                self._report({"action": "verify", "error": str(e)})
                raise
            self._report({"action": "verify", "verified": len(names), "seconds": took})
            return
        if self.checkpoint is not None:
            try:
                # shapes only where a layout is converted (no bytes moved to check them)
                sent = [p for g in self.checkpoint_groups(names, meta=True) for p in g]
                partial = bool(update_info.partial)
                check_update(sent, self.checkpoint, partial, "the vllm server", "weight update")
            except ValueError as e:
                self._report({"action": "load", "error": str(e)})
                raise
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._loading = True
        try:
            with disable_mtp_completeness_check(), torch.no_grad():
                self.model.load_weights(itertools.chain.from_iterable(self.checkpoint_groups(names)))
        except BaseException as e:
            self._abandon()
            self._report(
                {
                    "action": "load",
                    "error": f"loading failed half way ({e!r}); the layers that "
                    "loaded before it hold the new weights, the others their old ones",
                }
            )
            raise

    def finish_weight_update(self) -> None:
        if not self._loading:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._loading = False
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            self._abandon()
            raise
        self._reprocess_tied()

    def shutdown(self) -> None:
        if self.attached is not None:
            self.attached.close()
            self.attached = None

    def checkpoint_groups(
        self, names: list[str], *, meta: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The shared weights ``names`` one decoder layer at a time, named and laid out as the checkpoint the
        server loaded: as they are, or, for a model that transformers holds in another layout than it
        saves (its experts fused in one tensor since transformers 5, saved one per expert), converted as
        transformers saves them (its ``revert_weight_conversion``, on a model on the meta device; a fused
        tensor's pieces are views of it where they can be, else copies of one layer at a time). ``meta``:
        shapes and dtypes only."""
        from vllm.distributed.weight_transfer.base import layerwise_groups

        assert self.attached is not None
        views = self.attached.tensors
        convert = self._converter(names)
        for group in layerwise_groups(names):
            pairs = {n: views[n].to("meta") if meta and convert is not None else views[n] for n in group}
            if convert is not None:
                pairs = convert(pairs)
            yield list(pairs.items())

    def _converter(
        self, names: list[str]
    ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
        """transformers' conversion back to the checkpoint's layout, where the names are not the
        checkpoint's and transformers has one for the model (None otherwise: the names go as they are, and
        the check names those the model does not have)."""
        if self.checkpoint is None or all(
            n in self.checkpoint.tensors or n == "lm_head.weight" for n in names
        ):
            return None
        if self._hf_meta is None:
            try:
                from transformers import AutoModelForCausalLM

                with torch.device("meta"):
                    self._hf_meta = AutoModelForCausalLM.from_config(self.model_config.hf_config)
            except Exception as e:  # no such class, or a transformers without it: nothing to convert with
                log.warning("rlmem weight transfer: no transformers model to convert the layout with: %s", e)
                self._hf_meta = False
        if self._hf_meta is False:
            return None
        from transformers.core_model_loading import revert_weight_conversion

        model = self._hf_meta
        return lambda pairs: revert_weight_conversion(model, pairs)

    def _report(self, report: dict[str, Any]) -> None:
        """Tell the trainer (its Handout) what became of the update: vLLM's answer to a failed call carries
        no reason. Best effort: a trainer gone away must not fail the worker."""
        if self._socket is None:
            return
        rank = int(getattr(self.parallel_config, "rank", 0) or 0)
        try:
            sock = wire.connect(self._socket, timeout=self._timeout)
            try:
                wire.send(sock, {"op": "report", "report": {**report, "rank": rank}})
            finally:
                sock.close()
        except (OSError, ValueError) as e:
            log.warning("rlmem weight transfer: could not report to the trainer: %s", e)

    # -- what vLLM's reload leaves to its callers ---------------------------------------------------------
    def _tied_modules(self) -> list[torch.nn.Module]:
        """Each module whose weight is another module's (earlier in the model), once."""
        seen: set[int] = set()
        out = []
        for mod in self.model.modules():
            w = mod._parameters.get("weight")
            if w is None:
                continue
            if id(w) in seen:
                out.append(mod)
            seen.add(id(w))
        return out

    def _reprocess_tied(self) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        for mod in self._tied_modules():
            method = getattr(mod, "quant_method", None)
            # unquantized only: what it makes is a function of the weight alone, so making it again is
            # what a load would have made (a quantized method's processing is not known to be repeatable)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(mod)

    def _abandon(self) -> None:
        """A load that failed half way: every layer gets its own tensors back (those a finished layer
        already updated keep the new values), and nothing stays buffered for the next update."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _place_kernel_tensors

        self._loading = False
        for layer in self.model.modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load():
                continue
            if info.kernel_tensors is not None:
                _place_kernel_tensors(layer, info)
            info.reset()
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload

    def verify(self, names: list[str]) -> float:
        """Compare what the model holds with loading ``names`` from the shared weights again (into
        shadows, one decoder layer at a time), bit for bit; the seconds it took.

        Raises:
            RuntimeError: naming the parameters that differ.
        """
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        assert self.attached is not None
        t0 = time.perf_counter()
        groups = self.checkpoint_groups(names)
        params = dict(self.model.named_parameters())

        def load(pairs: Iterable[tuple[str, torch.Tensor]]) -> Any:
            with disable_mtp_completeness_check():
                return self.model.load_weights(pairs)

        differ = shadow_verify(
            params,
            load,
            groups,
            default_loader=default_weight_loader,
            template=self._as_loaded,
            probe=self._probe_packed,
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        log.info("rlmem weight transfer: verified %d weights in %.3f s", len(names), took)
        if differ:
            more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
            raise RuntimeError(
                f"rlmem weight transfer: after the update {len(differ)} parameters of the served model "
                f"differ from the shared weights: {', '.join(differ[:8])}{more}"
            )
        return took

    def _as_loaded(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The parameter as it was when loaded: vLLM's CPU backend replaces a linear layer's weight by an
        empty one once it has packed it; the reload's records (meta tensors) keep its shape, class and
        loader."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        if param.numel() > 0:
            return param
        mod_name, _, pname = name.rpartition(".")
        layer = self.model.get_submodule(mod_name) if mod_name else self.model
        info = LAYERWISE_INFO.get(layer)
        meta = None if info is None else info.restore_metadata[0].get(pname)
        if meta is None:
            return param
        from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

        like = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        like.__class__ = meta.__class__
        like.__dict__ = meta.__dict__.copy()
        # the reload wraps the loaders of these records (online_process_loader): the original loads
        like.weight_loader = _get_original_loader(meta)  # type: ignore[attr-defined]
        return like

    def _probe_packed(self, shadows: dict[int, torch.Tensor]) -> list[str]:
        """Layers that multiply by a packed copy of their weight (vLLM's CPU backend: ``cpu_linear``): one-hot
        rows through it give columns of the weight it holds, exactly (each output is one product by 1 plus
        zeros); compared with the shadow's columns where the shadow was loaded."""
        differ = []
        for mod_name, mod in self.model.named_modules():
            w = mod._parameters.get("weight")
            fn = getattr(mod, "cpu_linear", None)
            if w is None or fn is None or id(w) not in shadows:
                continue
            want = shadows[id(w)]
            if want.ndim != 2:
                continue
            k = want.shape[1]
            gen = torch.Generator().manual_seed(k)
            cols = sorted({0, k - 1, *torch.randint(0, k, (_PROBE_COLUMNS - 2,), generator=gen).tolist()})
            x = torch.zeros(len(cols), k, dtype=want.dtype, device=want.device)
            x[torch.arange(len(cols)), torch.tensor(cols)] = 1
            with torch.no_grad():
                got = fn(x, w, None)
            ref = want[:, cols].t()
            loaded = ~torch.isnan(ref) if ref.is_floating_point() else torch.ones_like(ref, dtype=torch.bool)
            if got.shape != ref.shape or not torch.equal(got[loaded].to(ref.dtype), ref[loaded]):
                differ.append(f"{mod_name}.weight (its packed copy)")
        return differ


def register() -> None:
    """vLLM's plugin hook: the ``"rlmem"`` backend in its factory (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(NAME, __name__, "RLMemWeightTransferEngine")
    except ValueError:  # registered already (the plugins of a process loaded twice)
        pass
