"""Decode steps as CUDA graph replays, over batch-size and cache-length buckets.

Decode steps run from fixed buffers (:class:`Decode`: token ids, positions, a prepared 4-D attention mask)
into the static cache, so on a GPU each step is one CUDA graph replay: one graph per batch-size bucket
(powers of two up to ``batch_size``) and cache-length bucket (multiples of ``kv_block``), captured on first
use or all at once (:meth:`DecodeGraphs.capture_all`). A step attends over the columns of its length bucket
only, not the whole cache: at batch 64 the keys and values outweigh the weights, and reading the unfilled
part of the cache would double a step's bytes. The cache's addresses never change, so the graphs survive
its sleep and wake and the train phase between rollouts without re-capture; they are captured again only if
the weights they read move (:meth:`DecodeGraphs.follow`). Every graph allocates from one private pool,
counted from the allocator's segments. Without CUDA graphs the same buffers feed eager steps; a step whose
warm-up ran but whose capture failed raises :class:`CaptureError` (the sampler then decodes eagerly).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .._units import round_up
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
        self.graphs: dict[int, Any] = {}
        self.logits: torch.Tensor | None = None

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

    def follow(self, fingerprint: tuple[int, ...]) -> None:
        """Drop the graphs if the weights they read moved: ``fingerprint`` is where the weights and buffers
        are now (their data pointers)."""
        if fingerprint != self.fingerprint:
            self.drop()
            self.fingerprint = fingerprint

    def drop(self) -> None:
        """Forget the graphs (the decode buffers stay, with what a generation in progress put there); PyTorch
        frees the graphs' pool once none holds it."""
        for d in self.decoders.values():
            d.graphs.clear()
        self.pool = None
        self.pool_bytes = 0

    def release(self) -> int:
        """Forget the graphs and hand their pool back to the device; returns the bytes it held."""
        freed = self.pool_bytes
        if self.decoders:
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
    def capture(self, d: Decode, length: int, forward: Forward, *, count: bool = True) -> Any:
        """The graph of one decode step of ``forward`` from ``d``'s buffers over the first ``length`` cache
        columns (the cache's views must span them), kept in ``d.graphs``.

        Raises:
            CaptureError: the step ran eagerly (its warm-up) but could not be captured.
        """
        # Warm-up runs write this step's keys and values at the rows' columns (``_slots.decode_writes``, in
        # force wherever a step is captured): the replay rewrites the same ones.
        mask = d.mask[..., :length]
        # One side stream for every capture: the pool's freed blocks are reused only by allocations on the
        # stream that freed them, so graphs captured on streams of their own would not share memory.
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # Twice before this sampler's first capture (lazy initialisation of the libraries), then once;
            # each run writes the same column (the next would lie past the length bucket's view).
            for _ in range(2 if self.captures == 0 else 1):
                out = forward(d.ids, mask, d.pos)
        torch.cuda.current_stream(self.device).wait_stream(side)
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
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # thread_local: another thread of the process (a server's) may call the driver meanwhile
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                d.logits.copy_(forward(d.ids, mask, d.pos))
            except BaseException as e:
                # An invalidated capture cannot end cleanly; ``e`` is what says why it failed.
                with contextlib.suppress(Exception):
                    graph.capture_end()
                raise _not_captured(e)  # noqa: B904 (the cause is chained there)
            try:
                graph.capture_end()
            except Exception as e:
                raise _not_captured(e)  # noqa: B904
        torch.cuda.current_stream(self.device).wait_stream(side)
        d.graphs[length] = graph
        self.captures += 1
        if count:
            self.count_pool()
        return graph

    def count_pool(self) -> None:
        """The pool's segments are reserved for the graphs alone and stay reserved while they live (through
        sleep and the train phase too). Counted from the allocator's segments: the difference of the
        reserved bytes around a capture would also see what the capture allocated for other pools."""
        self.pool_bytes = sum(
            seg["total_size"]
            for seg in torch.cuda.memory_snapshot()
            if self.pool is not None and tuple(seg.get("segment_pool_id", ())) == tuple(self.pool)
        )
