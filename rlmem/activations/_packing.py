"""The saved-tensor hooks of the activation offloader and what they do per offloaded storage: ``_pack``
keeps a tensor, shares a storage already copied, or starts its copy into the host pool; the in-flight
queue lets device copies go once their copies are seen complete or waited for in stream order; in
backward, ``_unpack`` serves a storage from the device or reloads it (on demand, or the layer below one
layer ahead), with autograd's in-place check.

:class:`SavedTensorHooks` is a base class of :class:`ActivationOffloader` (``_handle``), not an object of
its own: its methods run once per saved tensor and read the step's state from ``self`` directly, as they
did as the handle's own methods, so moving them here adds no call and no attribute read to that path.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ._autoplan import StepTimes
from ._pool import HostPool
from ._saved import Entry, Kept, Packed, eligible, storage_bytes, version_error, view_of
from ._transfer import CudaCopies, HostCopies

__all__ = ["RELEASE_LAG", "SavedTensorHooks"]

# At the start of layer i, the compute stream waits for the copies of layers <= i - RELEASE_LAG and their
# device memory is freed: one layer of compute to hide each layer's copies behind.
RELEASE_LAG = 2


class SavedTensorHooks:
    """The pack and unpack hooks of :class:`ActivationOffloader` and the release order of its entries.

    The state below is the handle's, set in its ``__init__`` (the step's part reset when a step ends); the
    annotations only name it (no class attribute is made, so every read is the instance's, as before).
    """

    device: torch.device
    min_bytes: int
    prefetch: bool
    _active: bool
    _backward: bool  # this step's backward has begun (its first unpack)
    _gen: int  # the step's number: a packed tensor of another step may not be unpacked
    _scope: list[tuple[str, int] | None]  # the scope stack (``None``: not offloaded)
    _selected: set[tuple[str, int]] | None  # the plan's scopes (``None``: every chosen one)
    _measure: dict[tuple[str, int], list[Any]] | None  # measured step: [bytes, first mark, count] per scope
    _seen: set[int]  # storages a measured step has counted
    _entries: list[Entry]
    _by_storage: dict[int, Entry]  # by the storage's data_ptr
    _inflight: deque[Entry]  # device tensors held until their copy is seen done
    _groups: dict[int, list[Entry]]  # entries per layer
    _fetched: set[int]  # layers backward has begun to unpack
    _keep_from: int  # the first of the last RELEASE_LAG layers, whose copies the forward pass keeps
    _kept: list[Entry]
    _kept_seen: int
    _step: dict[str, Any]
    _times: StepTimes
    _copies: CudaCopies | HostCopies
    _pool: HostPool | None

    def _pack(self, t: torch.Tensor) -> Any:
        scope = self._scope[-1] if self._scope else None
        if scope is None or (self._selected is not None and scope not in self._selected):
            if self._by_storage and type(t) is torch.Tensor and t.device == self.device:
                # Saved again outside the chosen modules (a norm's output is also the MLP's input): share
                # the copy, or the device storage would stay referenced and offloading would free nothing.
                e = self._shared(t, t.untyped_storage())
                if e is not None:
                    e.refs += 1
                    return Packed(e, t, self._gen)
            return Kept(t)
        if self._copies.capturing():
            raise RuntimeError(
                "rlmem.offload_activations does not support CUDA graph capture yet: run the captured "
                "region outside the offload context or disable offloading for it"
            )
        if not eligible(t, self.device):
            self._step["kept_ineligible"] += 1
            return Kept(t)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes == 0:
            self._step["kept_small"] += 1
            return Kept(t)
        if self._measure is not None:
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                rec = self._measure.setdefault(scope, [0, None, 0])
                rec[0] += nbytes
                rec[2] += 1
                if rec[1] is None:
                    rec[1] = self._copies.mark()
            return Kept(t)
        e = self._shared(t, storage)
        if e is None:
            e = self._offload(t, storage, nbytes, scope)
            self._by_storage[storage.data_ptr()] = e
        e.refs += 1
        return Packed(e, t, self._gen)

    def _shared(self, t: torch.Tensor, storage: Any) -> Entry | None:
        """The entry already holding ``t``'s storage, unchanged since it was copied, if any."""
        e = self._by_storage.get(storage.data_ptr())
        if e is not None and e.storage() is storage and e.version == t._version:
            self._step["dedup_hits"] += 1
            return e
        return None

    def _offload(self, t: torch.Tensor, storage: Any, nbytes: int, scope: tuple[str, int]) -> Entry:
        assert self._pool is not None
        name, layer = scope
        e = Entry(nbytes, layer, storage, t._version)
        host = self._pool.alloc(nbytes)
        e.d2h_done = self._copies.copy_out(storage_bytes(storage), host)
        if self._copies.asynchronous:
            e.dev = t
            self._inflight.append(e)
            if layer >= self._keep_from:
                self._kept.append(e)
        e.host = host
        self._entries.append(e)
        self._groups.setdefault(layer, []).append(e)
        st = self._step
        st["offloaded_bytes"] += nbytes
        st["offloaded_tensors"] += 1
        st["by_name"][name] = st["by_name"].get(name, 0) + nbytes
        return e

    def _release_through(self, group: int) -> None:
        """Free the device copies of layers <= ``group`` in stream order: the compute stream waits for their
        copies, so what it allocates next may reuse the memory.

        The caching allocator counts memory in the order the host issues work, and the host runs ahead of
        the device: a copy the host has not yet seen complete cannot be freed by polling, however early the
        device finished it. Waiting in stream order frees it on time; it stalls the compute only if the
        copies fall more than ``RELEASE_LAG`` layers behind, which the budget mode avoids.
        """
        q = self._inflight
        n = 0
        while n < len(q) and q[n].group <= group:
            n += 1
        if not n:
            return
        # One wait covers them all (the copies run in order on one stream), enqueued before the memory
        # goes back to the allocator.
        self._copies.order_after(q[n - 1].d2h_done)
        for _ in range(n):
            self._copied(q.popleft())

    def _poll(self) -> None:
        q = self._inflight
        while q and q[0].group < self._keep_from and self._copies.done(q[0].d2h_done):
            self._copied(q.popleft())
        if self._kept_seen < len(self._kept):
            self._note_kept()

    def _note_kept(self) -> None:
        """Note which of the kept layers' copies completed before any in-place change of their tensor (the
        host copy then holds the saved value, should the device tensor change later)."""
        k = self._kept
        while self._kept_seen < len(k) and self._copies.done(k[self._kept_seen].d2h_done):
            e = k[self._kept_seen]
            e.clean = e.dev is not None and e.dev._version == e.version
            self._kept_seen += 1

    @staticmethod
    def _copied(e: Entry) -> None:
        """Let go of the device storage of an entry whose copy is done (or waited for)."""
        if e.dev is not None and e.dev._version != e.version:
            e.modified = True  # changed in place while its copy was in flight
        e.dev = None

    def _unpack(self, p: Any) -> torch.Tensor:
        if not self._backward and self._active:
            self._backward_started()
        if isinstance(p, Kept):
            if p.tensor._version != p.version:
                raise version_error()
            return p.tensor
        if p.gen != self._gen:
            raise RuntimeError(
                "rlmem.offload_activations: backward ran after the offload context that saved its tensors "
                "ended; put forward and backward inside one `with` block"
            )
        e = p.entry
        if e.dev is not None and e.dev._version != e.version:
            if not e.clean:
                raise version_error()
            # Changed in place after its copy completed: the host copy holds the saved value (letting go
            # of the device tensor also lets go of the saved view, checked next, if nothing else holds it).
            self._drop(e)
        orig = p.ref()
        if e.modified or (orig is not None and orig._version != p.version):
            raise version_error()
        if e.group not in self._fetched:
            self._release_after(e.group)
        buf = self._device_copy(e)
        self._prefetch_before(e.group)
        out = view_of(buf, p)
        e.refs -= 1
        if e.refs <= 0:
            self._drop(e)
        return out

    def _backward_started(self) -> None:
        # Where the forward pass left the offloaded bytes: still on the device because the copy had not
        # completed, or released by rlmem but kept alive by another reference (then offloading frees nothing).
        # What is still in flight stays on the device until backward is done with it (not polled away:
        # the last layers' copies have completed by now, and letting their memory go would mean reloading
        # what backward needs first).
        self._backward = True
        self._times.backward_start = self._copies.mark()
        self._note_kept()
        st = self._step
        for e in self._entries:
            if e.dev is not None:
                if not self._copies.done(e.d2h_done):
                    st["copying_at_backward_bytes"] += e.nbytes
            elif e.storage() is not None:
                st["held_elsewhere_bytes"] += e.nbytes
        st["allocated_at_backward"] = self._times.allocated_at_backward = self._copies.allocated()

    def _device_copy(self, e: Entry) -> torch.Tensor:
        st = self._step
        if e.dev is not None:
            st["served_resident"] += 1
            return storage_bytes(e.dev.untyped_storage())
        if e.reload is None:
            self._reload(e)
            st["reloaded_on_demand"] += 1
        else:
            st["reloaded_prefetched"] += 1
        self._copies.order_after(e.ready)
        assert e.reload is not None
        return e.reload

    def _reload(self, e: Entry) -> None:
        assert e.host is not None
        buf = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
        e.ready = self._copies.copy_in(e.host, buf, e.d2h_done)
        e.reload = buf
        self._step["reloaded_bytes"] += e.nbytes

    def _release_after(self, group: int) -> None:
        # Backward reached an earlier layer: the later layers' reloads are done with. Not every saved
        # tensor is unpacked, so reference counts alone would keep some reloads until the step ends.
        for g, entries in self._groups.items():
            if g > group:
                for e in entries:
                    if e.reload is not None or e.dev is not None:
                        self._drop(e)

    def _reload_ahead(self, below: int) -> None:
        """Start the copies back of the highest offloaded layer under ``below`` (not yet reloaded)."""
        prev = [g for g in self._groups if g < below]
        if not prev:
            return
        for e in self._groups[max(prev)]:
            if e.dev is None and e.reload is None and e.refs > 0:
                self._reload(e)

    def _prefetch_before(self, group: int) -> None:
        if group in self._fetched:
            return
        self._fetched.add(group)
        if self.prefetch:
            self._reload_ahead(group)

    def _drop(self, e: Entry) -> None:
        if e.dev is not None:
            # Its copy may still be reading it: free it in stream order after the copy.
            self._copies.order_after(e.d2h_done)
        e.dev = None
        e.reload = None
