"""Host-memory tier of the prefix cache: pages the GPU pool evicts are kept in (pinned) host memory, LRU.

The tier is a second radix tree over its own host page pool. When the GPU tree evicts a leaf, the K/V of
its whole path that the host tree lacks are copied out (device-to-host on a side stream) and inserted
there. When a match on the GPU tree stops short of what the host tree holds, the rest is copied back
into freshly allocated GPU pages and inserted into the GPU tree before the handle is returned, so the
request's forward reads it like any cached prefix. Copies are ordered with events on the streams
(`wait_stream`): the host never waits on the GPU. The host tree keeps its copy after a copy back, so a
prefix evicted again costs no second copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.utils import logging

from .host_states import HostSnapshots
from .radix_tree import IntegrityError, MatchHandle, RadixNode, RadixPrefixCache

if TYPE_CHECKING:
    from .cache_manager import CacheManager
    from .kv_pool import KVPool

logger = logging.get_logger(__name__)

__all__ = ["HostTier", "host_tier_tokens"]

# The pool is [2, layers, pages, page_size, heads, dim]; the host buffer keeps each page contiguous.
STAGING_BYTES = 128 << 20  # two GPU buffers, allocated once: a copy goes through them in chunks


def host_tier_tokens(pool: KVPool, tokens: int | None, gigabytes: float | None) -> int | None:
    """Host tier capacity in tokens from `host_cache_tokens` or `host_cache_gb` (None or 0: no tier)."""
    if tokens and gigabytes:
        raise ValueError("give host_cache_tokens or host_cache_gb, not both")
    if gigabytes:
        if not gigabytes > 0:
            raise ValueError(f"host_cache_gb must be > 0, got {gigabytes}")
        tokens = int(gigabytes * 1e9) // pool.shape.bytes_per_token(pool.dtype)
    if tokens is None or tokens == 0:
        return None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < pool.page_size:
        raise ValueError(f"host_cache_tokens must be an int >= page_size ({pool.page_size}), got {tokens!r}")
    return tokens


def _runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    """(offset, first page, count) of each run of consecutive page numbers in `pages`."""
    if not len(pages):
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(pages)]])
    return [(int(s), int(pages[s]), int(e - s)) for s, e in zip(starts, ends)]


class HostTier:
    """LRU prefix cache in host memory behind a GPU `CacheManager`; see the module docstring."""

    def __init__(self, pool: KVPool, num_tokens: int, staging_pages: int | None = None,
                 state_slots: int | None = None):
        ps = pool.page_size
        self.pool = pool
        self.page_size = ps
        self.num_pages = num_tokens // ps
        self.tree = RadixPrefixCache(ps)
        cuda = pool.device.type == "cuda"
        shape = pool.shape
        self.stream = torch.cuda.Stream(pool.device) if cuda else None
        page_bytes = ps * shape.bytes_per_token(pool.dtype)
        self._chunk_pages = staging_pages or max(1, STAGING_BYTES // page_bytes)
        staging = self._chunk_pages * ps * shape.num_layers * shape.num_kv_heads * max(shape.head_dim,
                                                                                     shape.value_dim)
        with torch.inference_mode(False):  # normal tensors: written in place inside and outside it
            # Page-major host copies of the pool's keys and values: [pages, layers, page_size, heads, dim].
            self.keys, self.values = (
                torch.empty((self.num_pages, shape.num_layers, ps, shape.num_kv_heads, dim),
                            dtype=pool.dtype, pin_memory=cuda)
                for dim in (shape.head_dim, shape.value_dim)
            )
            # Layer-major and page-major staging of one chunk of keys or values, allocated once: a copy
            # allocates no device memory (no allocator stall or out-of-memory mid-run). Only the side
            # stream uses them, so a copy never rewrites them while an earlier one still reads them.
            self._staging = [torch.empty(staging, dtype=pool.dtype, device=pool.device) for _ in range(2)]
        self._free = np.arange(self.num_pages, dtype=np.int64) * ps  # first slot of each free page, sorted
        self.manager: CacheManager | None = None
        # a manager with state layers: snapshots kept here too (`state_slots` of them; default: as many as
        # the manager's state pool holds)
        self.snapshots: HostSnapshots | None = None
        self._state_slots = state_slots
        self.stored_tokens = 0  # copied out to host memory
        self.restored_tokens = 0  # copied back into GPU pages
        self.evicted_tokens = 0  # dropped from the host tier (LRU)
        self.dropped_tokens = 0  # evicted from the GPU with no room left here
        logger.info(
            "host tier: %d tokens, %.2f GiB%s",
            self.num_pages * ps,
            self.num_pages * page_bytes / 2**30,
            " pinned" if cuda else "",
        )

    def attach(self, manager: CacheManager) -> None:
        """Puts the tier behind `manager`: its evictions come here and its matches look here."""
        if manager.page_size != self.page_size:
            raise ValueError("the host tier and the cache manager must share one page size")
        if manager.state_slots is not None:
            slots = self._state_slots or manager.state_slots.pool.num_slots
            self.snapshots = HostSnapshots(self, manager.state_slots, slots)
        elif self.snapshots is not None:
            raise ValueError("this host tier keeps state snapshots: attach it to a manager with state layers")
        self.manager = manager
        manager.host_tier = self
        manager.tree.on_evict = self._keep
        if self.snapshots is not None:  # a snapshot the GPU drops alone (short of state slots) comes here too
            manager.tree.on_drop_snapshot = self._keep

    def detach(self) -> None:
        """Undoes `attach`: the manager evicts and matches without the tier again."""
        self.manager.host_tier = None
        self.manager.tree.on_evict = None
        if self.snapshots is not None:
            self.manager.tree.on_drop_snapshot = None

    # -- GPU -> host ---------------------------------------------------------------------------------
    def _keep(self, node: RadixNode) -> None:
        """Eviction callback of the GPU tree: copies the part of `node`'s path the host tree lacks, and
        `node`'s snapshot (an evicted leaf's, or one the GPU drops alone from a node it keeps)."""
        keys, values, snapshot = [], [], node.state_slot
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        current = self.tree.namespace  # the evicted leaf may belong to another adapter set's tree
        self.tree.namespace = self.manager.tree.namespace_of(node)
        try:
            ids = np.concatenate(keys[::-1])
            self._store(ids, values)
            if snapshot is not None and self.snapshots is not None:
                self.snapshots.keep(ids, snapshot)
        finally:
            self.tree.namespace = current

    def _store(self, ids: np.ndarray, values: list[np.ndarray]) -> None:
        """Copies the part of the path `ids` (slots: `values`, deepest first) that the host tree lacks."""
        handle = self.tree.match_kv(ids)  # also marks the path recently used
        have = handle.cached_len
        if have == len(ids):
            return
        self.tree.lock(handle)
        try:
            room = len(self._free) * self.page_size + self.tree.size_info.evictable_size
            count = min(len(ids) - have, room)
            self.dropped_tokens += len(ids) - have - count
            if count == 0:
                return
            host = self._take(count // self.page_size)
            self.copy_pages(np.concatenate(values[::-1])[have : have + count], host, to_host=True)
            self.tree.insert_prefix(ids[: have + count], np.concatenate([handle.matched_indices(), host]))
            self.stored_tokens += count
        finally:
            self.tree.unlock(handle)

    def _take(self, count: int) -> np.ndarray:
        """Slots of `count` host pages, evicting the least recently used host prefixes on shortfall."""
        ps = self.page_size
        if count > len(self._free):
            freed = self.tree.evict((count - len(self._free)) * ps)
            self.evicted_tokens += len(freed)
            self._free = np.sort(np.concatenate([self._free, freed[::ps]]))  # sorted: copies in long runs
        return self._pop_free(count)

    def _pop_free(self, count: int) -> np.ndarray:
        taken, self._free = self._free[:count], self._free[count:]
        return (taken[:, None] + np.arange(self.page_size, dtype=np.int64)).reshape(-1)

    # -- pages written from the host (cache_io) ------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def take_free_pages(self, count: int) -> np.ndarray:
        """Slots of `count` free host pages (evicting nothing) for the host to write: waits first for the
        copies in flight, so that none still reads or writes them."""
        if count > len(self._free):
            raise ValueError(f"{count} host pages asked for, {len(self._free)} free")
        self.wait_for_copies()
        return self._pop_free(count)

    def release_pages(self, slots: np.ndarray) -> None:
        """Returns whole host pages (all their slots) to the free list."""
        firsts = np.asarray(slots, dtype=np.int64)[:: self.page_size]
        self._free = np.sort(np.concatenate([self._free, firsts]))

    # -- host -> GPU ---------------------------------------------------------------------------------
    def extend_match(self, ids: np.ndarray, handle: MatchHandle) -> MatchHandle:
        """Extends a GPU match with what the host tree holds beyond it (copied into fresh GPU pages).

        Returns `handle` when the host has nothing more (or the GPU no room), else an unlocked handle of
        the GPU tree at the end of the longer prefix, with `restored_len` set to the tokens copied back.
        """
        ps, gpu_len = self.page_size, handle.cached_len
        if len(ids) - gpu_len < ps or not self.tree.size_info.total_size:
            return handle
        if self.snapshots is not None:
            return self.snapshots.extend_match(ids, handle)
        host_handle = self.tree.match_prefix(ids)
        host_len = host_handle.cached_len
        if host_len <= gpu_len:
            return handle
        manager = self.manager
        manager.tree.lock(handle)  # the allocation below must not evict the prefix being extended
        self.tree.lock(host_handle)  # nor may what it evicts to host push out the copy being read
        try:
            room = manager.available_size
            count = min(host_len - gpu_len, room - room % ps)
            if count == 0:
                return handle
            pages = manager.take_pages(count // ps)
            slots = (pages[:, None] + np.arange(ps, dtype=np.int64)).reshape(-1)
            self.copy_pages(slots, host_handle.matched_indices()[gpu_len : gpu_len + count], to_host=False)
            present, longer = manager.tree.insert_prefix(
                ids[: gpu_len + count], np.concatenate([handle.matched_indices(), slots])
            )
            if present != gpu_len:
                raise IntegrityError(f"the GPU tree grew under a locked match ({present} != {gpu_len})")
        finally:
            self.tree.unlock(host_handle)
            manager.tree.unlock(handle)
        longer.restored_len = count
        self.restored_tokens += count
        return longer

    # -- copies --------------------------------------------------------------------------------------
    def _index(self, pages: np.ndarray) -> torch.Tensor:
        """Page numbers on the pool's device, uploaded without a host sync."""
        index = torch.from_numpy(np.ascontiguousarray(pages))
        if self.stream is None:
            return index
        return index.pin_memory().to(self.pool.device, non_blocking=True)

    def _slot_index(self, pages: np.ndarray) -> torch.Tensor:
        """The pool slots of `pages`, page after page, on the pool's device."""
        ps = self.page_size
        return self._index((pages[:, None] * ps + np.arange(ps)).reshape(-1))

    def _staged(self, pages: int, pool_side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the staging buffers for `pages` pages of one side of the pool: layer-major
        `[layers, pages, page_size, heads, dim]` (the pool's order) and page-major
        `[pages, layers, page_size, heads, dim]` (the host buffers' order)."""
        layers, _, heads, dim = pool_side.shape
        size = layers * pages * self.page_size * heads * dim
        layer_major = self._staging[0][:size].view(layers, pages, self.page_size, heads, dim)
        page_major = self._staging[1][:size].view(pages, layers, self.page_size, heads, dim)
        return layer_major, page_major

    def copy_pages(self, gpu_slots: np.ndarray, host_slots: np.ndarray, *, to_host: bool) -> None:
        """Copies whole pages between the pool and the host buffers (`to_host`: out), chunk by chunk
        through the staging buffers, on the side stream."""
        ps = self.page_size
        host_pages, gpu_pages = host_slots[::ps] // ps, gpu_slots[::ps] // ps
        with self._side_stream():
            for lo in range(0, len(host_pages), self._chunk_pages):
                hi = lo + self._chunk_pages
                index, runs = self._slot_index(gpu_pages[lo:hi]), _runs(host_pages[lo:hi])
                for pool_side, host_side in ((self.pool.keys, self.keys), (self.pool.values, self.values)):
                    layer_major, page_major = self._staged(len(index) // ps, pool_side)
                    if to_host:
                        torch.index_select(pool_side, 1, index, out=layer_major.flatten(1, 2))
                        page_major.copy_(layer_major.transpose(0, 1))
                    for at, page, count in runs:
                        host, staged = host_side[page : page + count], page_major[at : at + count]
                        (host if to_host else staged).copy_(staged if to_host else host, non_blocking=True)
                    if not to_host:
                        layer_major.copy_(page_major.transpose(0, 1))
                        pool_side.index_copy_(1, index, layer_major.flatten(1, 2))

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """Runs the block on the side stream, after the work queued so far on the current stream (which
        may still write or read the pages) and before any work queued on it later (GPU-side waits only)."""
        if self.stream is None:
            yield
            return
        main = torch.cuda.current_stream(self.pool.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            yield
        main.wait_stream(self.stream)

    def wait_for_copies(self) -> None:
        """Blocks until every copy issued so far has landed (before the host reads its buffers: a save)."""
        if self.stream is not None:
            self.stream.synchronize()

    # -- maintenance ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drops every host-resident prefix."""
        self.tree.reset()
        self._free = np.arange(self.num_pages, dtype=np.int64) * self.page_size

    def check_integrity(self) -> None:
        """Raises IntegrityError unless the host tree is sound, unlocked, and free + held == host pages."""
        self.tree.check_integrity()
        if self.snapshots is not None:
            self.snapshots.check_integrity()
        ps, size = self.page_size, self.tree.size_info
        if size.protected_size:
            raise IntegrityError(f"{size.protected_size} host-tier tokens are still locked between calls")
        if len(self._free) + size.total_size // ps != self.num_pages:
            raise IntegrityError(
                f"host page leak: free {len(self._free)} + held {size.total_size // ps} != {self.num_pages}"
            )
        firsts = np.concatenate([self._free, self.tree.slot_indices()[::ps]])
        if (
            len(np.unique(firsts)) != len(firsts)
            or np.any(firsts % ps)
            or np.any(firsts >= self.num_pages * ps)
        ):
            raise IntegrityError("a host page is free and held at once, misaligned, or out of range")

    def stats(self) -> dict:
        return {
            "host_pool_tokens": self.num_pages * self.page_size,
            "host_tree_tokens": self.tree.size_info.total_size,
            "host_stored_tokens": self.stored_tokens,
            "host_restored_tokens": self.restored_tokens,
            "host_evicted_tokens": self.evicted_tokens,
            "host_dropped_tokens": self.dropped_tokens,
        }
