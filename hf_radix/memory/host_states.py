"""State snapshots in the host tier, for a cache manager of a model with state layers.

The host tree is then a `SnapshotRadixCache` over a host `StatePool`: when the GPU tree evicts a leaf
with a snapshot, or drops a snapshot alone (`evict_snapshots`, short of state slots), the snapshot is
copied out with the K/V of its path; a match that the host tree can carry to a later snapshot gets the
missing K/V and that snapshot copied back into the GPU tree. Host snapshots are LRU within their slots.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .radix_snapshots import SnapshotRadixCache, StateSlots
from .radix_tree import IntegrityError, MatchHandle, RadixPrefixCache
from .state_pool import StatePool, StatePoolError

__all__ = ["HostSnapshots"]


class SnapshotTier(Protocol):
    """What the snapshot side reads and calls of its host tier (`host_tier.HostTier`)."""

    tree: RadixPrefixCache
    page_size: int
    manager: Any
    restored_tokens: int

    def copy_pages(self, gpu_slots: np.ndarray, host_slots: np.ndarray, *, to_host: bool) -> None: ...


class HostSnapshots:
    """The snapshot side of a `HostTier` whose manager has `state_slots`; replaces the tier's tree."""

    def __init__(self, tier: SnapshotTier, gpu: StateSlots, num_slots: int) -> None:
        if tier.tree.size_info.total_size:
            raise ValueError("attach a host tier to a manager with state layers while the tier is empty")
        self.tier, self.gpu = tier, gpu
        pool = StatePool(list(gpu.pool.specs.values()), num_slots, "cpu")
        tier.tree = SnapshotRadixCache(tier.page_size, pool)
        self.host = StateSlots(pool, tier.tree)

    def keep(self, ids: np.ndarray, slot: int) -> None:
        """After the tier stored the evicted path `ids`: copies its snapshot (GPU slot `slot`) too, when
        the whole path fit and a host slot is free or held by an unlocked snapshot."""
        handle = self.tier.tree.match_kv(ids)
        if handle.cached_len != len(ids) or handle.state_slot is not None:
            return
        try:
            host = self.host.alloc(zero=False)
        except StatePoolError:
            return
        self.host.pool.load_state_dict([host], self.gpu.pool.state_dict([slot]))
        self.tier.tree.attach_snapshot(handle, len(ids), host)

    def extend_match(self, ids: np.ndarray, handle: MatchHandle) -> MatchHandle:
        """`HostTier.extend_match` for snapshot trees: the GPU match `handle` carried to the host tree's
        deepest snapshot on `ids`, its missing K/V and the snapshot copied back (all or nothing)."""
        tier, manager = self.tier, self.tier.manager
        host_handle = tier.tree.match_prefix(ids)
        target = host_handle.cached_len
        if target <= handle.cached_len:
            return handle
        kv = manager.tree.match_kv(ids[:target])  # the GPU may hold K/V past its last snapshot
        manager.tree.lock(kv)  # taking pages or a state slot below must not evict what is extended
        tier.tree.lock(host_handle)  # nor may what that evicts to host push out what is read here
        try:
            count = target - kv.cached_len
            if count > manager.available_size or not self.gpu.available:
                return handle
            at = kv
            if count:
                ps = tier.page_size
                pages = manager.take_pages(count // ps)
                slots = (pages[:, None] + np.arange(ps, dtype=np.int64)).reshape(-1)
                tier.copy_pages(slots, host_handle.matched_indices()[kv.cached_len :], to_host=False)
                present, at = manager.tree.insert_prefix(
                    ids[:target], np.concatenate([kv.matched_indices(), slots])
                )
                if present != kv.cached_len:
                    raise IntegrityError(
                        f"the GPU tree grew under a locked match ({present} != {kv.cached_len})"
                    )
            slot = self.gpu.alloc(zero=False)
            self.gpu.pool.load_state_dict([slot], self.host.pool.state_dict([host_handle.state_slot]))
            self.gpu.tree.attach_snapshot(at, target, slot)
        finally:
            tier.tree.unlock(host_handle)
            manager.tree.unlock(kv)
        tier.restored_tokens += count
        longer = manager.tree.match_prefix(ids)
        longer.restored_len = longer.cached_len - handle.cached_len
        return longer

    def check_integrity(self) -> None:
        """Host state slots in use are exactly the host tree's snapshots."""
        self.host.check([])
