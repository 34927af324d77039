"""The radix tree of a model with state layers: K/V prefixes plus state snapshots on nodes.

A state layer (Gated DeltaNet, Mamba2, short convolution) can only continue from its state after the
prefix, so a prefix is usable only where a node holds a snapshot (`RadixNode.state_slot`, a
`StatePool` slot: the state after the node's last token). Matches back off to the deepest such node;
snapshots are attached after the forward that ended there. Leaves without a snapshot serve no match
and are evicted first; snapshots of unlocked nodes can be dropped alone (`evict_snapshots`) when the
pool is short of slots. The tree frees the slots of the snapshots it drops; see docs/hybrid.md, §4.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .radix_node import IntegrityError, MatchHandle, RadixNode, as_int_array
from .radix_tree import RadixPrefixCache
from .state_pool import StatePool, StatePoolError

__all__ = ["SnapshotRadixCache", "StateSlots"]


class SnapshotRadixCache(RadixPrefixCache):
    """A `RadixPrefixCache` whose matches end at state snapshots; snapshot slots come from `state_pool`."""

    needs_snapshots = True

    def __init__(self, page_size: int, state_pool: StatePool) -> None:
        self.state_pool = state_pool
        # Called with each node whose snapshot `evict_snapshots` drops, before it drops it (a host tier
        # keeps a copy; the snapshots of evicted leaves go to `on_evict`).
        self.on_drop_snapshot: Callable[[RadixNode], None] | None = None
        self._snapshots: dict[int, RadixNode] = {}  # slot -> the node holding it, in every namespace
        super().__init__(page_size)

    def reset(self) -> None:
        """Drops every node and frees every snapshot slot."""
        self.state_pool.free(list(self._snapshots))
        self._snapshots = {}  # slot -> the node holding it, in every namespace
        self._bare_heap: list[tuple[int, int, RadixNode]] = []  # evictable leaves queued without one
        super().reset()

    # ---------------------------------------------------------------- public API

    def match_prefix(self, token_ids: Any) -> MatchHandle:
        """The longest cached prefix of `token_ids` that ends at a snapshot (length 0: none)."""
        ids = as_int_array(token_ids, "token_ids")
        node, length = self._walk(ids, self._next_tick())
        self._maybe_queue(node)
        while node.state_slot is None and node.parent is not None:
            length -= len(node.key)
            node = node.parent
        return MatchHandle(self, length, node)

    def attach_snapshot(self, handle: MatchHandle, length: int, slot: int) -> int | None:
        """Makes `slot` the snapshot of the node ending `length` tokens into `handle`'s path (splitting
        a node there). Returns the slot to free when that node already has a snapshot (`slot`), else None.
        """
        self._check_handle(handle)
        if not 0 < length <= handle.cached_len or length % self.page_size:
            raise ValueError(
                f"snapshot length {length} must be a multiple of page_size={self.page_size} in "
                f"(0, {handle.cached_len}]"
            )
        if slot in self._snapshots:
            raise IntegrityError(f"state slot {slot} is already a snapshot")
        node, end = handle.node, handle.cached_len
        while end - len(node.key) >= length:
            end -= len(node.key)
            node = node.parent
        if end > length:  # inside `node`: its upper part becomes the node ending at `length`
            node = self._split(node, len(node.key) - (end - length), node.last_access)
        if node.state_slot is not None:
            return slot
        node.state_slot = slot
        self._snapshots[slot] = node
        return None

    def evict_snapshots(self, count: int) -> int:
        """Frees the snapshots of up to `count` least recently used unlocked nodes (their K/V stay);
        returns how many were freed."""
        victims = heapq.nsmallest(
            count, (n for n in self._snapshots.values() if not n.ref_count), key=lambda n: n.last_access
        )
        for node in victims:
            if self.on_drop_snapshot is not None:
                self.on_drop_snapshot(node)
            self._drop_snapshot(node)
            if not node.children:  # a leaf without a snapshot now: trimmed first
                self._queue_bare(node)
        return len(victims)

    @property
    def num_evictable_snapshots(self) -> int:
        """Snapshots that `evict_snapshots` could free now (on no locked path)."""
        return sum(not n.ref_count for n in self._snapshots.values())

    def snapshot_slots(self) -> list[int]:
        """Every state slot the tree holds as a snapshot, in every namespace."""
        return list(self._snapshots)

    def evict(self, num_tokens: int) -> np.ndarray:
        """Like `RadixPrefixCache.evict`, leaves without a snapshot first; frees evicted snapshots."""
        self._check_evict_size(num_tokens)
        freed: list[np.ndarray] = []
        done = self._evict_from(self._bare_heap, num_tokens, freed, bare_only=True)
        self._evict_from(self._heap, num_tokens - done, freed)
        return np.concatenate(freed) if freed else np.empty(0, dtype=np.int64)

    def check_integrity(self, locks: Iterable[MatchHandle] | None = None) -> None:
        """Also: the snapshot index names exactly the nodes with a snapshot, all in the tree, and every
        evictable leaf without a snapshot is queued for trimming."""
        super().check_integrity(locks)
        holders: dict[int, RadixNode] = {}
        bare: list[RadixNode] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.state_slot is not None:
                if node.parent is None or node.state_slot in holders:
                    raise IntegrityError(f"state slot {node.state_slot} is held twice or by a root")
                holders[node.state_slot] = node
            elif node.parent is not None and not node.children and not node.ref_count:
                bare.append(node)
        if holders.keys() != self._snapshots.keys() or any(
            self._snapshots[s] is not n for s, n in holders.items()
        ):
            raise IntegrityError("the snapshot index disagrees with the nodes' state slots")
        queued = {id(n) for tick, _, n in self._bare_heap if tick == n.last_access}
        if any(id(n) not in queued for n in bare):
            raise IntegrityError("an evictable leaf without a snapshot is missing from the trimming heap")

    # ---------------------------------------------------------------- internals

    def _drop_snapshot(self, node: RadixNode) -> None:
        slot = node.state_slot
        node.state_slot = None
        del self._snapshots[slot]
        self.state_pool.free([slot])

    def _remove_leaf(self, node: RadixNode) -> np.ndarray:
        value = super()._remove_leaf(node)
        if node.state_slot is not None:
            self._drop_snapshot(node)
        return value

    def _maybe_queue(self, node: RadixNode) -> None:
        queued = node._queued_tick
        super()._maybe_queue(node)
        if node.state_slot is None and node._queued_tick != queued:  # just queued, without a snapshot
            self._queue_bare(node)

    def _queue_bare(self, node: RadixNode) -> None:
        """Queues the leaf `node` (no snapshot) for trimming before any leaf with one."""
        if node.ref_count or node.parent is None:
            return
        heapq.heappush(self._bare_heap, (node.last_access, next(self._seq), node))
        if len(self._bare_heap) > 2 * self._num_nodes + 1024:
            live = [e for e in self._bare_heap if e[2].parent is not None and e[0] == e[2].last_access]
            self._bare_heap[:] = live
            heapq.heapify(self._bare_heap)


class StateSlots:
    """A cache manager's state slots: running rows' (taken and freed by the manager) and the tree's
    snapshots, all from one `StatePool`."""

    def __init__(self, pool: StatePool, tree: SnapshotRadixCache) -> None:
        self.pool = pool
        self.tree = tree

    @property
    def available(self) -> int:
        """Slots that `take` can hand out now: free ones plus unlocked snapshots (admission control)."""
        return self.pool.num_free + self.tree.num_evictable_snapshots

    def alloc(self, zero: bool = True) -> int:
        """A slot, freeing the least recently used unlocked snapshot when none is free."""
        if not self.pool.num_free and not self.tree.evict_snapshots(1):
            raise StatePoolError(f"state pool out of slots: all {self.pool.num_slots} are running or locked")
        return self.pool.alloc(1, zero=zero)[0]

    def take(self, source: int | None) -> int:
        """A slot holding a copy of slot `source` (zeros if None): a running row's state, restored from
        its matched snapshot."""
        slot = self.alloc(zero=source is None)
        if source is not None:
            self.pool.copy_slot(source, slot)
        return slot

    def snapshot(self, handle: MatchHandle, source: int) -> bool:
        """Attaches a copy of slot `source` at the end of `handle`'s path, unless a snapshot is there
        already; returns whether it attached one."""
        if handle.state_slot is not None:
            return False
        return self.attach(handle, handle.cached_len, self.take(source))

    def hold(self, held: tuple[int, int] | None, source: int, length: int) -> tuple[int, int]:
        """Copies slot `source` (the state after `length` tokens) into the held slot of `held` (a
        `(length, slot)` pair; a new slot if None), to attach later; returns the new pair."""
        if length <= 0 or length % self.tree.page_size:
            raise ValueError(f"a held snapshot ends at a page multiple > 0, not {length}")
        slot = self.alloc(zero=False) if held is None else held[1]
        self.pool.copy_slot(source, slot)
        return length, slot

    def attach(self, handle: MatchHandle, length: int, slot: int) -> bool:
        """`SnapshotRadixCache.attach_snapshot`, freeing `slot` if that node has a snapshot already."""
        duplicate = self.tree.attach_snapshot(handle, length, slot)
        if duplicate is not None:
            self.pool.free([duplicate])
        return duplicate is None

    def check(self, running: list[int | None]) -> None:
        """Every allocated slot is held once, by running rows (`running`: their own and held slots) or one
        snapshot; no other
        slot is allocated, and the free list is disjoint from them."""
        try:
            self.pool.check_integrity()
        except StatePoolError as e:
            raise IntegrityError(str(e)) from e
        if None in running:
            raise IntegrityError("a running request has no state slot")
        held = running + self.tree.snapshot_slots()
        if len(set(held)) != len(held):
            raise IntegrityError("a state slot is held twice (by running requests or snapshots)")
        used = self.pool.used_slots
        if set(held) != used:
            leaked, unallocated = sorted(used - set(held)), sorted(set(held) - used)
            raise IntegrityError(
                f"state slots: allocated but held by nobody {leaked}; held but not allocated {unallocated}"
            )
