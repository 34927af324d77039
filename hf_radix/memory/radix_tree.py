"""Path-compressed radix tree mapping token-id prefixes to KV-pool slot indices (RadixAttention-style).

The tree only stores indices; K/V live in a pool owned elsewhere. Nodes hold a contiguous token segment
(`key`) and the slots holding its KV (`value`). Locks (`ref_count`) protect the path of an in-flight request;
unreferenced leaves are evicted in least-recently-used order, where "time" is an operation counter. Each
namespace (the adapter set that computed the K/V) has a root of its own; matches and inserts use the current
one, eviction takes the least recently used leaf of any.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from .radix_node import IntegrityError, MatchHandle, RadixNode, SizeInfo, as_int_array

__all__ = ["IntegrityError", "MatchHandle", "RadixNode", "RadixPrefixCache", "SizeInfo"]


class RadixPrefixCache:
    """Radix-tree prefix cache: match, insert, lock/unlock and LRU-evict token prefixes."""

    needs_snapshots = False  # True in `SnapshotRadixCache`: matches end at a state snapshot

    def __init__(self, page_size: int = 1) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = int(page_size)
        self._tick = 0
        self._seq = itertools.count()
        # Called with each leaf `evict` removes, while it is still attached (a host tier keeps a copy).
        self.on_evict: Callable[[RadixNode], None] | None = None
        self._namespace: Hashable = None
        self.reset()

    # ---------------------------------------------------------------- public API

    def reset(self) -> None:
        """Drops every node of every namespace; handles taken before become stale (their use raises)."""
        self._roots: dict[Hashable, RadixNode] = {}
        self.namespace = self._namespace
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._heap: list[tuple[int, int, RadixNode]] = []

    @property
    def namespace(self) -> Hashable:
        """The namespace that matches and inserts use; each one a tree of its own over one set of slots."""
        return self._namespace

    @namespace.setter
    def namespace(self, value: Hashable) -> None:
        root = self._roots.get(value)
        if root is None:
            empty = np.empty(0, dtype=np.int64)
            root = self._roots[value] = RadixNode(empty, empty, None, 0, 0)
        self._namespace, self._root = value, root

    def namespace_of(self, node: RadixNode) -> Hashable:
        """The namespace whose tree holds `node`."""
        while node.parent is not None:
            node = node.parent
        return next(name for name, root in self._roots.items() if root is node)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable, self._protected)

    def match_prefix(self, token_ids: Any) -> MatchHandle:
        """Finds the longest page-aligned cached prefix of `token_ids`; returns an unlocked handle."""
        ids = as_int_array(token_ids, "token_ids")
        node, length = self._walk(ids, self._next_tick())
        self._maybe_queue(node)
        return MatchHandle(self, length, node)

    def match_kv(self, token_ids: Any) -> MatchHandle:
        """The longest cached K/V prefix, whether or not a snapshot ends it (here: `match_prefix`)."""
        return RadixPrefixCache.match_prefix(self, token_ids)

    def insert_prefix(self, token_ids: Any, slot_indices: Any) -> tuple[int, MatchHandle]:
        """Inserts `token_ids` -> `slot_indices`; returns (length already cached, handle at its end).

        The tree keeps its own slots for the already-cached part; the caller frees its duplicates.
        """
        ids = as_int_array(token_ids, "token_ids")
        slots = as_int_array(slot_indices, "slot_indices")
        self._check_insert_args(ids, slots)
        tick = self._next_tick()
        node, length = self._walk(ids, tick)
        if length < len(ids):
            leaf = RadixNode(ids[length:].copy(), slots[length:].copy(), node, 0, tick)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += len(leaf.key)
            self._num_nodes += 1
            node = leaf
        self._maybe_queue(node)
        return length, MatchHandle(self, len(ids), node)

    def lock(self, handle: MatchHandle) -> None:
        """Protects the handle's path from eviction (ref_count += 1 up to the root)."""
        self._check_handle(handle)
        if handle.locked:
            raise ValueError("handle is already locked")
        node = handle.node
        while node.parent is not None:
            if node.ref_count == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.ref_count += 1
            node = node.parent
        handle.locked = True

    def unlock(self, handle: MatchHandle) -> None:
        """Releases a lock taken by `lock(handle)`."""
        self._check_handle(handle)
        if not handle.locked:
            raise ValueError("handle is not locked")
        node = handle.node
        while node.parent is not None:
            if node.ref_count <= 0:
                raise IntegrityError(f"unlock would drive ref_count negative at {node!r}")
            node = node.parent
        node = handle.node
        while node.parent is not None:
            node.ref_count -= 1
            if node.ref_count == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent
        handle.locked = False
        self._maybe_queue(handle.node)

    def evict(self, num_tokens: int) -> np.ndarray:
        """Removes LRU unreferenced leaves until >= `num_tokens` tokens are freed; returns their slots."""
        self._check_evict_size(num_tokens)
        freed: list[np.ndarray] = []
        self._evict_from(self._heap, num_tokens, freed)
        return np.concatenate(freed) if freed else np.empty(0, dtype=np.int64)

    def nodes(self) -> list[RadixNode]:
        """Every node of the current namespace but its root, each after its parent."""
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def slot_indices(self) -> np.ndarray:
        """Every slot index the tree holds, in every namespace (any order)."""
        values, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(node.children.values())
        return np.concatenate(values).astype(np.int64, copy=False)

    def check_integrity(self, locks: Iterable[MatchHandle] | None = None) -> None:
        """Verifies sizes, ref counts, parent/child links, page alignment and slot uniqueness.

        With `locks` (every handle that is locked, e.g. the live requests' handles), each node's ref_count
        must equal the number of those whose path covers it: a lock taken and never released fails.
        """
        expected = None if locks is None else self._lock_counts(locks)
        for root in self._roots.values():
            if root.parent is not None or len(root.key) or len(root.value) or root.ref_count:
                raise IntegrityError("a root must be empty, parentless and unreferenced")
        total = protected = evictable_leaves = 0
        nodes: list[RadixNode] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            child_refs = 0
            for ckey, child in node.children.items():
                if child.parent is not node:
                    raise IntegrityError(f"{child!r} has a wrong parent pointer")
                self._check_segment(child)
                if self._child_key(child.key) != ckey:
                    raise IntegrityError(f"{child!r} is filed under the wrong child key")
                if node.parent is not None and child.last_access > node.last_access:
                    raise IntegrityError(f"{child!r} was accessed after its parent {node!r}")
                child_refs += child.ref_count
                stack.append(child)
            if node.parent is None:
                continue
            if node.ref_count < child_refs:
                raise IntegrityError(f"{node!r} has ref_count below the sum of its children's ({child_refs})")
            if expected is not None and node.ref_count != expected.get(id(node), 0):
                raise IntegrityError(
                    f"{node!r}: the live locks add up to {expected.get(id(node), 0)} (a lock was leaked or "
                    "released twice)"
                )
            nodes.append(node)
            total += len(node.key)
            if node.ref_count > 0:
                protected += len(node.key)
            elif not node.children:
                evictable_leaves += 1
        if len(nodes) != self._num_nodes:
            raise IntegrityError(f"node count {len(nodes)} != tracked {self._num_nodes}")
        if protected != self._protected or total - protected != self._evictable:
            raise IntegrityError(
                f"sizes (evictable={total - protected}, protected={protected}) != tracked "
                f"(evictable={self._evictable}, protected={self._protected})"
            )
        if nodes:
            slots = np.concatenate([n.value for n in nodes])
            if len(np.unique(slots)) != len(slots):
                raise IntegrityError("a slot index appears more than once in the tree")
        queued = {id(n) for tick, _, n in self._heap if n.parent is not None and tick == n.last_access}
        if sum(id(n) in queued for n in nodes if n.ref_count == 0 and not n.children) != evictable_leaves:
            raise IntegrityError("an evictable leaf is missing from the eviction heap")

    # ---------------------------------------------------------------- internals

    def _lock_counts(self, locks: Iterable[MatchHandle]) -> dict[int, int]:
        """id(node) -> how many of the locked `locks` cover it."""
        counts: dict[int, int] = {}
        for handle in locks:
            if handle._cache is not self or not handle.locked:
                raise IntegrityError(f"{handle!r} is not a lock held on this tree")
            node = handle.node
            while len(node.key):  # up to its namespace's root, the only node with an empty key
                if node.parent is None:
                    raise IntegrityError(f"{handle!r} points at a node no longer in the tree")
                counts[id(node)] = counts.get(id(node), 0) + 1
                node = node.parent
        return counts

    def _check_evict_size(self, num_tokens: int) -> None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise ValueError(f"num_tokens must be an int, got {num_tokens!r}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens > self._evictable:
            raise ValueError(f"cannot evict {num_tokens} tokens: only {self._evictable} are evictable")

    def _evict_from(self, heap: list[tuple[int, int, RadixNode]], num_tokens: int, freed: list[np.ndarray],
                    bare_only: bool = False) -> int:
        """Pops `heap` and removes its evictable leaves until `num_tokens` tokens are freed (their slots
        appended to `freed`); returns the tokens freed. `bare_only`: only leaves without a snapshot, and
        the heap may run dry first."""
        total = 0
        while total < num_tokens:
            if not heap:
                if bare_only:
                    break
                raise IntegrityError("eviction heap ran dry before the evictable size was reached")
            tick, _, node = heapq.heappop(heap)
            if node.parent is None or tick != node.last_access:
                continue  # stale entry: node evicted or touched since it was queued
            if node.ref_count or node.children:
                node._queued_tick = -1  # re-queued when it becomes an evictable leaf again
                continue
            if bare_only and node.state_slot is not None:
                continue  # it has a snapshot now: the main heap holds it
            freed.append(self._remove_leaf(node))
            total += len(freed[-1])
        return total

    def _remove_leaf(self, node: RadixNode) -> np.ndarray:
        """Detaches the evictable leaf `node` (after `on_evict` saw it); returns its slots."""
        if self.on_evict is not None:
            self.on_evict(node)
        parent = node.parent
        del parent.children[self._child_key(node.key)]
        node.parent = None
        self._evictable -= len(node.key)
        self._num_nodes -= 1
        self._maybe_queue(parent)
        return node.value

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _child_key(self, seq: np.ndarray, pos: int = 0) -> Any:
        if self.page_size == 1:
            return int(seq[pos])
        return seq[pos:pos + self.page_size].tobytes()

    def _walk(self, ids: np.ndarray, tick: int) -> tuple[RadixNode, int]:
        """Follows `ids` down the tree, splitting a partially matched node; touches the path with `tick`."""
        node, pos, n, ps = self._root, 0, len(ids), self.page_size
        while n - pos >= ps:
            child = node.children.get(int(ids[pos]) if ps == 1 else ids[pos:pos + ps].tobytes())  # _child_key
            if child is None:
                break
            key = child.key
            m = min(len(key), n - pos)
            head, part = key[:m], ids[pos:pos + m]
            # a memcmp first: the usual whole-segment match
            matched = m if head.tobytes() == part.tobytes() else int((head != part).argmax())
            matched -= matched % ps
            pos += matched
            if matched < len(key):
                node = self._split(child, matched, tick)
                break
            child.last_access = tick
            node = child
        return node, pos

    def _split(self, node: RadixNode, pos: int, tick: int) -> RadixNode:
        """Splits `node` at `pos`; the new parent takes key[:pos], inherits ref_count and gets `tick`."""
        parent = node.parent
        assert parent is not None
        head = RadixNode(node.key[:pos], node.value[:pos], parent, node.ref_count, tick)
        parent.children[self._child_key(head.key)] = head
        node.key, node.value, node.parent = node.key[pos:], node.value[pos:], head
        head.children[self._child_key(node.key)] = node
        self._num_nodes += 1
        return head

    def _maybe_queue(self, node: RadixNode) -> None:
        """Pushes `node` on the eviction heap if it is an evictable leaf not yet queued at its access time."""
        if (node.ref_count or node.children or node.parent is None
                or node._queued_tick == node.last_access):
            return
        node._queued_tick = node.last_access
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            # In place: evict() holds a reference to this list while it re-queues parents.
            self._heap[:] = [e for e in self._heap if e[2].parent is not None and e[0] == e[2].last_access]
            heapq.heapify(self._heap)

    def path_values(self, node: RadixNode) -> list[np.ndarray]:
        """Values from `node` up to the root, deepest first; ValueError if `node` is no longer in the tree."""
        parts = []
        while node.parent is not None:
            parts.append(node.value)
            node = node.parent
        if all(node is not root for root in self._roots.values()):
            raise ValueError("stale handle: its node was evicted or the cache was reset")
        return parts

    def _check_handle(self, handle: MatchHandle) -> None:
        if not isinstance(handle, MatchHandle) or handle._cache is not self:
            raise ValueError("handle does not belong to this cache")
        self.path_values(handle.node)

    def _check_insert_args(self, ids: np.ndarray, slots: np.ndarray) -> None:
        ps = self.page_size
        if len(ids) != len(slots):
            raise ValueError(f"len(token_ids)={len(ids)} != len(slot_indices)={len(slots)}")
        if len(ids) % ps:
            raise ValueError(f"insert length {len(ids)} is not a multiple of page_size={ps}")
        if ps > 1 and len(slots) and not self._pages_ok(slots):
            raise ValueError(
                f"slot_indices must come in whole pages: each page of {ps} slots consecutive and starting "
                f"at a multiple of {ps}"
            )

    def _pages_ok(self, slots: np.ndarray) -> bool:
        pages = slots.reshape(-1, self.page_size)
        return bool((pages[:, 0] % self.page_size == 0).all()
                    and (pages - pages[:, :1] == np.arange(self.page_size)).all())

    def _check_segment(self, node: RadixNode) -> None:
        ps = self.page_size
        key, value = node.key, node.value
        if key.ndim != 1 or value.ndim != 1 or len(key) != len(value) or not len(key):
            raise IntegrityError(f"{node!r} must have 1-D key and value of equal, non-zero length")
        if len(node.key) % ps:
            raise IntegrityError(f"{node!r} length is not a multiple of page_size={ps}")
        if node.ref_count < 0:
            raise IntegrityError(f"{node!r} has a negative ref_count")
        if ps > 1 and not self._pages_ok(node.value):
            raise IntegrityError(f"{node!r} holds slot pages that are not aligned and consecutive")
