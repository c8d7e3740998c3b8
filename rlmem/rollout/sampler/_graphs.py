"""Decode steps as CUDA graph replays, over batch-size and cache-length buckets.

Decode steps run from fixed buffers (:class:`Decode`: token ids, positions, a prepared 4-D attention mask)
into the static cache, so on a GPU each step is one CUDA graph replay: one graph per batch-size bucket
(powers of two up to ``batch_size``) and cache-length bucket (multiples of ``kv_block``), captured on first
use or all at once (:meth:`DecodeGraphs.capture_all`). A step attends over the columns of its length bucket
only, not the whole cache: at batch 64 the keys and values outweigh the weights, and reading the unfilled
part of the cache would double a step's bytes. The cache's addresses never change, so the graphs survive
its sleep and wake and the train phase between rollouts without re-capture; they are captured again only if
the weights they read move (:meth:`DecodeGraphs.follow`). Every graph allocates from one private pool,
counted from the allocator's segments. Without CUDA graphs the same buffers feed eager steps. A shared
layout's steps (``_prefix``) have buffers of their own, by layout and groups, and graphs by the pair of
prompt and own column buckets; the same pool, dropped and followed with the others.

A step that cannot be captured raises :class:`CaptureError` (the sampler then decodes eagerly), and leaves
the process as it was: one that waits for the device (a copy to the host, ``.item()``) is found in its
warm-up, under torch's sync debug mode, before any capture begins; a capture that fails all the same is
undone (:meth:`DecodeGraphs.capture`). No garbage is collected during a capture: a finalizer run there (a
dead sampler's Region synchronises the device and unmaps its memory) would break it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._units import round_up
from ._cache import Forward, RowViews
from ._slots import decode_writes, row_bases, step_index

__all__ = ["CaptureError", "Decode", "DecodeGraphs", "length_block"]


class CaptureError(RuntimeError):
    """A decode step that ran eagerly could not be captured into a CUDA graph (the cause is chained): an op
    that copies to the host or synchronises, or one the driver refuses in a capture."""


def _not_captured(e: BaseException) -> BaseException:
    """What a failed capture raises: a :class:`CaptureError` for an error of the step's ops; running out of
    memory, an interrupt or an exit as they are."""
    if not isinstance(e, Exception) or isinstance(e, torch.OutOfMemoryError):
        return e
    err = CaptureError(f"{type(e).__name__}: {e}")
    err.__cause__ = e
    return err


# What torch's sync debug mode says of an op that waits for the device (``warn_or_error_on_sync`` in
# c10/cuda/CUDAFunctions.cpp, called by ``memcpy_and_sync`` and ``stream_synchronize``): a copy to or from
# host memory without ``non_blocking``, ``.item()``, ``nonzero``. Not of ``torch.cuda.synchronize()``, an
# event's ``synchronize()``, nor a ``non_blocking`` copy from pageable memory.
_SYNC = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Where this thread's ops wait for the device within the block: ``file:line`` of the Python code that
    called each, as torch's sync debug mode reports them, in the list yielded.

    The mode is set to ``"warn"`` for the block (and put back after), not ``"error"``: it is the process's,
    and another thread's sync meanwhile is then only warned of instead of raising in that thread.
    Warnings other than this thread's syncs pass through.
    """
    me = threading.get_ident()
    found: list[str] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=_SYNC)  # every one, not once per line
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None):
            if threading.get_ident() == me and _SYNC in str(message):
                found.append(f"{filename}:{lineno}")
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        before = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
        try:
            if before is not None:
                torch.cuda.set_sync_debug_mode("warn")
            yield found
        finally:
            if before is not None:
                torch.cuda.set_sync_debug_mode(before)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic garbage collection within the block (as it was after it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _stop_recording(device: int, pool: Any) -> None:
    """End the caching allocator's recording into ``pool`` that a failed capture left, and drop the
    reference to the pool its ``capture_begin`` took; nothing if it is not recording (the capture ended it).

    ``CUDAGraph::capture_end`` (aten/src/ATen/cuda/CUDAGraph.cpp) raises at ``cudaStreamEndCapture`` for a
    capture the driver invalidated, before it ends the recording: every later ``capture_begin`` into the
    pool then fails ("already recording to mempool_id"), and ``torch.cuda.empty_cache()`` asserts that no
    capture is underway. ``reset()`` drops the pool's reference only for a capture that ended.
    """
    # Its name before torch 2.8 was _cuda_endAllocateCurrentStreamToPool (where it takes no pool, nothing)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    end = end or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
    try:
        end(device, pool)  # type: ignore[misc]
    except (RuntimeError, TypeError):
        return
    with contextlib.suppress(RuntimeError):
        torch._C._cuda_releasePool(device, pool)


def _end_rng_capture(device: torch.device) -> None:
    """Take the device's default CUDA generator out of the capture mode a failed capture left it in (every
    random op after it raised "Offset increment outside graph capture encountered unexpectedly").

    ``capture_begin`` registers that generator with every graph and starts its capture, and only a capture
    that ends stops it (``capture_epilogue``, from ``capture_end``; torch binds nothing else): so one of a
    single kernel, in a pool of its own, on the current (side) stream, never replayed. Neither step touches
    the generator's seed or offset.
    """
    scratch = torch.zeros((), device=device)
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            scratch.add_(1)
        finally:
            graph.capture_end()
    except Exception:
        _stop_recording(torch.cuda.current_device(), pool)


def length_block(max_len: int, kv_block: int | None) -> int:
    """The cache-length buckets' granularity: ``kv_block``, checked, or ``max_len / 8`` rounded up to a
    multiple of 64 (at most 8 buckets, graphs, per batch size)."""
    if kv_block is None:
        return round_up(-(-max_len // 8), 64)
    if not isinstance(kv_block, int) or kv_block < 8 or kv_block % 8:
        raise ValueError(f"kv_block must be a positive multiple of 8 or None, got {kv_block!r}")
    return kv_block


class Decode:
    """Fixed inputs of one decode step for ``size`` rows: token ids, positions and the 4-D attention mask
    (True: attend) over the whole cache, updated in place; with CUDA graphs, one graph per cache-length
    bucket and the output logits they all write."""

    def __init__(self, size: int, max_len: int, heads: int, device: torch.device) -> None:
        self.ids = torch.zeros((size, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((size, 1), dtype=torch.long, device=device)
        self.mask = torch.zeros((size, 1, 1, max_len), dtype=torch.bool, device=device)
        # Where a step writes each row's keys and values (``_slots.step_index``): column 0 until set.
        self.base = row_bases(size, heads, max_len, device)
        self.index = self.base.clone()
        self.rows = torch.arange(size, device=device)
        self.graphs: dict[Any, Any] = {}  # by cache-length bucket (a shared layout's: prompt and own columns)
        self.logits: torch.Tensor | None = None

    def step_mask(self, length: Any) -> torch.Tensor:
        """The mask a step over the length bucket ``length`` attends with."""
        return self.mask[..., :length]

    def start(self, prompt_mask: torch.Tensor, last_pos: torch.Tensor, width: int) -> None:
        """Set up for a batch whose prompts fill ``width`` columns (rows past the batch attend to the first
        position only: their outputs are not used, and a row with nothing to attend to would be NaN)."""
        n = prompt_mask.shape[0]
        self.ids.zero_()
        self.pos.zero_()
        self.pos[:n, 0] = last_pos
        self.mask.zero_()
        self.mask[:n, 0, 0, :width] = prompt_mask.bool()
        self.mask[n:, 0, 0, 0] = True

    def advance(self, ids: torch.Tensor, column: int) -> None:
        """The next step's inputs: the sampled ids at the next position, attending to the new column."""
        self.ids[: ids.shape[0], 0] = ids
        self.pos.add_(1)
        step_index(self.base, column, self.index)
        self.mask[:, 0, 0, column] = True


class DecodeGraphs:
    """The decode buffers of each batch-size bucket and, with CUDA graphs, their graphs by cache-length
    bucket, in one private memory pool.

    Args:
        enabled: capture graphs (a cache on a CUDA device); otherwise the buffers feed eager steps.
        batch_size, max_len: the cache's rows and columns.
        kv_block: granularity of the cache-length buckets.
        device: the cache's device.
    """

    def __init__(
        self, enabled: bool, batch_size: int, max_len: int, kv_block: int, device: torch.device
    ) -> None:
        self.enabled = enabled
        self.batch_size = batch_size
        self.max_len = max_len
        self.kv_block = kv_block
        self.device = device
        self.captures = 0  # so far: one per rows and length bucket, again only if the weights move
        self.decoders: dict[int, Decode] = {}  # by rows; with CUDA graphs, each holds its graphs
        self.shared: dict[Any, Decode] = {}  # a shared layout's (``_prefix``), by layout and groups
        self.pool: Any = None
        self.pool_bytes = 0  # device memory the captured graphs' private pool holds
        self.stream: Any = None  # where the graphs are warmed up and captured
        self.fingerprint: tuple[int, ...] = ()  # where the weights were when the graphs were captured

    def buckets(self) -> list[int]:
        sizes = [1 << k for k in range(self.batch_size.bit_length()) if 1 << k < self.batch_size]
        return [*sizes, self.batch_size]

    def bucket(self, n: int) -> int:
        """The rows a batch of ``n`` sequences decodes with: its bucket with graphs, ``n`` without."""
        return next(b for b in self.buckets() if b >= n) if self.enabled else n

    def length(self, n: int) -> int:
        """The cache-length bucket that holds ``n`` columns."""
        return min(self.max_len, round_up(n, self.kv_block))

    def decoder(self, size: int, cache: Any) -> Decode:
        """The fixed decode buffers of ``size`` rows over ``cache`` (and their graphs, with CUDA graphs)."""
        d = self.decoders.get(size)
        if d is None:
            heads = cache.layers[0].keys.shape[1]
            d = self.decoders[size] = Decode(size, self.max_len, heads, self.device)
        return d

    def shared_decoder(self, key: Any, make: Callable[[], Decode]) -> Decode:
        """The decode buffers of a shared layout's bucket ``key``, made by ``make`` on first use."""
        d = self.shared.get(key)
        if d is None:
            d = self.shared[key] = make()
        return d

    def follow(self, fingerprint: tuple[int, ...]) -> None:
        """Drop the graphs if the weights they read moved: ``fingerprint`` is where the weights and buffers
        are now (their data pointers)."""
        if fingerprint != self.fingerprint:
            self.drop()
            self.fingerprint = fingerprint

    def drop(self) -> None:
        """Forget the graphs (the decode buffers stay, with what a generation in progress put there); PyTorch
        frees the graphs' pool once none holds it."""
        for d in (*self.decoders.values(), *self.shared.values()):
            d.graphs.clear()
        self.pool = None
        self.pool_bytes = 0

    def release(self) -> int:
        """Forget the graphs and hand their pool back to the device; returns the bytes it held."""
        freed = self.pool_bytes
        if self.decoders or self.shared:
            self.drop()
            if self.enabled:  # emptying the cache hands the freed pool back to the driver
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        return freed

    def capture_all(self, cache: Any, decoder: Callable[[int], Decode], forward: Forward) -> None:
        """Capture every graph not captured yet, each batch-size bucket over each cache-length bucket, of
        ``forward`` over ``cache``; ``decoder`` gives the buffers of a bucket (once the weights are where the
        graphs will read them).

        Raises:
            CaptureError: a step could not be captured (the graphs captured before it are kept).
        """
        views = RowViews(cache, self.batch_size, self.max_len)
        lengths = sorted({self.length(n) for n in range(1, self.max_len + 1)})
        try:
            cache.reset()
            for rows in self.buckets():
                d = decoder(rows)
                d.mask.zero_()
                d.mask[..., 0] = True  # a row with nothing to attend to would compute NaN
                with decode_writes(views.layers, d.index, views.whole):
                    for length in lengths:
                        if length not in d.graphs:
                            views.use(rows, length)
                            self.capture(d, length, forward, count=False)
        finally:
            views.use(None)
            cache.reset()
            self.count_pool()

    @torch.no_grad()  # with autograd on, the logits buffer would keep every graph's activations alive
    def capture(self, d: Decode, length: Any, forward: Forward, *, count: bool = True) -> Any:
        """The graph of one decode step of ``forward`` from ``d``'s buffers over the first ``length`` cache
        columns (the cache's views must span them; a shared layout's ``length`` is its prompt and own
        columns), kept in ``d.graphs``.

        Raises:
            CaptureError: the step waits for the device (found in its warm-up: no capture begun), or its
                capture failed; that capture is undone, and the graphs captured before it are dropped (the
                next capture starts a pool of its own).
        """
        # Warm-up runs write this step's keys and values at the rows' columns (``_slots.decode_writes``, in
        # force wherever a step is captured): the replay rewrites the same ones.
        mask = d.step_mask(length)
        # One side stream for every capture: the pool's freed blocks are reused only by allocations on the
        # stream that freed them, so graphs captured on streams of their own would not share memory.
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        side = self.stream
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            # Twice, each run writing the same column (the next would lie past the length bucket's view):
            # once for the libraries' lazy set-up and the fused kernels' compilation, then as the capture
            # will run it, watched for what a capture refuses, with no garbage collected (a finalizer's sync
            # would be taken for the step's; see the module docstring for the capture's).
            forward(d.ids, mask, d.pos)
            with gc_paused(), host_syncs() as syncs:
                out = forward(d.ids, mask, d.pos)
        current.wait_stream(side)
        if syncs:
            raise CaptureError(f"the step waits for the device: {_SYNC} at {syncs[0]}")
        if d.logits is None:  # outside the pool: every length's graph of these rows writes here
            d.logits = torch.empty_like(out)
        del out
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # The model's own output is a temporary of the pool, so graphs of other lengths reuse its memory.
        # Captured on the side stream, not through ``torch.cuda.graph``: that empties PyTorch's device and
        # host caches before every capture, and the next warm-up then allocates all again from the driver
        # (most of a capture's time when the buckets are captured in a row).
        side.wait_stream(current)
        try:
            with gc_paused(), torch.cuda.stream(side):
                # capture_end is called once: here, or by _abandon after an error between the two
                began = ending = False
                try:
                    # thread_local: another thread of the process (a server's) may call the driver meanwhile
                    graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                    began = True
                    d.logits.copy_(forward(d.ids, mask, d.pos))
                    ending = True
                    graph.capture_end()
                except BaseException as e:
                    self._abandon(graph, end=began and not ending)
                    raise _not_captured(e)  # noqa: B904 (the cause is chained there)
        finally:
            current.wait_stream(side)
        d.graphs[length] = graph
        self.captures += 1
        if count:
            self.count_pool()
        return graph

    def _abandon(self, graph: Any, *, end: bool) -> None:
        """Undo a capture that failed, from its stream, so that the process goes on as before it began:
        the stream's capture ended (``end``: an op raised in the middle of it; or the stream still
        captures), the allocator's recording into the pool ended and the pool's reference the capture took
        dropped (``_stop_recording``), the graphs and the pool forgotten (the next capture allocates from a
        new pool: torch's pinned-host allocator also records per pool, with nothing in Python to end it),
        the device's default generator out of capture mode (``_end_rng_capture``). Raises nothing: the
        caller raises what made the capture fail."""
        if end or torch.cuda.is_current_stream_capturing():
            with contextlib.suppress(Exception):
                graph.capture_end()  # ends the stream's capture even where it raises (an invalidated one)
        device = torch.cuda.current_device()
        _stop_recording(device, self.pool)
        with contextlib.suppress(Exception):
            graph.reset()
        self.drop()
        with contextlib.suppress(Exception):
            _end_rng_capture(torch.device("cuda", device))

    def count_pool(self) -> None:
        """The pool's segments are reserved for the graphs alone and stay reserved while they live (through
        sleep and the train phase too). Counted from the allocator's segments: the difference of the
        reserved bytes around a capture would also see what the capture allocated for other pools."""
        self.pool_bytes = sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if self.pool is not None and tuple(seg.get("segment_pool_id", ())) == tuple(self.pool)
        )
