"""Tests for hf_radix.memory.radix_snapshots: the radix tree of models with state layers, checked against
a reference dict (prefix -> the state after it) with a real `StatePool` whose slots hold a fake state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_radix_tree import _machine

from hf_radix.hybrid_layers import StateKindSpec, StateLayerSpec
from hf_radix.memory.radix_snapshots import SnapshotRadixCache
from hf_radix.memory.radix_tree import IntegrityError, MatchHandle, RadixPrefixCache
from hf_radix.memory.state_pool import StatePool

pytestmark = pytest.mark.slow  # the memory layer's own logic: no transformers version changes it

SPEC = [StateLayerSpec(0, (StateKindSpec("recurrent", (1,), torch.float64),))]
NUM_PAGES = 24
NUM_SLOTS = 8


def fake_state(prefix: tuple[int, ...]) -> float:
    """The 'state after `prefix`': distinct for distinct prefixes, never 0 (a zeroed slot)."""
    value = 1
    for t in prefix:
        value = value * 7 + t + 1
    return float(value)


def read(pool: StatePool, slot: int) -> float:
    return float(pool.tensors[(0, "recurrent")][slot, 0])


def write(pool: StatePool, slot: int, value: float) -> None:
    pool.tensors[(0, "recurrent")][slot, 0] = value


def snapshots(tree: SnapshotRadixCache) -> dict[tuple[int, ...], int]:
    """Path tokens -> snapshot slot, for every node of the current namespace with a snapshot."""
    out, stack = {}, [((), tree._root)]
    while stack:
        path, node = stack.pop()
        for child in node.children.values():
            cpath = path + tuple(child.key.tolist())
            if child.state_slot is not None:
                out[cpath] = child.state_slot
            stack.append((cpath, child))
    return out


def bare_tokens(tree: SnapshotRadixCache) -> int:
    """Tokens of unlocked nodes with no snapshot at or below them: what eviction trims before any snapshot."""

    def walk(node) -> tuple[bool, int]:
        clean, tokens = node.state_slot is None and not node.ref_count, 0
        for child in node.children.values():
            child_clean, child_tokens = walk(child)
            clean, tokens = clean and child_clean, tokens + child_tokens
        return clean, tokens + (len(node.key) if clean else 0)

    return sum(walk(child)[1] for child in tree._root.children.values())


class SnapshotMachine(RuleBasedStateMachine):
    """Random inserts (with snapshots), matches, locks, evictions of K/V and of snapshots."""

    PAGE_SIZE = 1

    def __init__(self) -> None:
        super().__init__()
        self.ps = self.PAGE_SIZE
        self.pool = StatePool(SPEC, NUM_SLOTS)
        self.tree = SnapshotRadixCache(self.ps, self.pool)
        self.free = list(range(0, NUM_PAGES * self.ps, self.ps))
        self.ref: dict[tuple[int, ...], float] = {}  # prefix -> state, for every snapshot in the tree
        self.locks: list[tuple[MatchHandle, int | None]] = []  # locked handle, its snapshot slot then
        self.seen: list[list[int]] = [[]]

    def _tokens(self, data, base: list[int], max_pages: int) -> list[int]:
        keep = len(base) - data.draw(st.integers(0, len(base) // self.ps)) * self.ps  # most of it, often
        pages = data.draw(st.integers(0, max_pages))
        extra = data.draw(st.lists(st.integers(0, 1), min_size=pages * self.ps, max_size=pages * self.ps))
        return base[:keep] + extra

    def _reconcile(self) -> None:
        """After an eviction: snapshots only disappear, and those of locked handles stay."""
        held = snapshots(self.tree)
        assert set(held) <= set(self.ref), "a snapshot appeared out of nowhere"
        self.ref = {k: v for k, v in self.ref.items() if k in held}
        for handle, slot in self.locks:
            assert handle.state_slot == slot, "a locked node's snapshot was evicted"

    def _evict(self, tokens: int) -> None:
        self.free += self.tree.evict(tokens)[:: self.ps].tolist()

    @rule(data=st.data(), i=st.integers(0, 100), at=st.integers(0, 100))
    def insert(self, data, i: int, at: int) -> None:
        seq = self._tokens(data, self.seen[-1 - i % len(self.seen)], 4)  # often the latest
        need = len(seq) // self.ps - len(self.free)
        if need > 0:
            if need * self.ps > self.tree.size_info.evictable_size:
                return
            snaps_before = len(self.ref)
            bare = bare_tokens(self.tree)
            self._evict(need * self.ps)
            self._reconcile()
            if need * self.ps <= bare:
                assert len(self.ref) == snaps_before, "a snapshot was evicted before a bare leaf"
        pages, self.free = self.free[: len(seq) // self.ps], self.free[len(seq) // self.ps :]
        slots = (np.asarray(pages, dtype=np.int64)[:, None] + np.arange(self.ps)).reshape(-1)
        present, handle = self.tree.insert_prefix(seq, slots)
        self.free += pages[: present // self.ps]
        self.seen.append(seq)
        if not seq:
            return
        length = (at % (len(seq) // self.ps) + 1) * self.ps
        if not self.pool.num_free:
            self.tree.evict_snapshots(1)
            self._reconcile()
            if not self.pool.num_free:
                return
        slot = self.pool.alloc(1)[0]
        value = fake_state(tuple(seq[:length]))
        write(self.pool, slot, value)
        duplicate = self.tree.attach_snapshot(handle, length, slot)
        if duplicate is not None:
            assert duplicate == slot and self.ref[tuple(seq[:length])] == value
            self.pool.free([duplicate])
        self.ref[tuple(seq[:length])] = value

    @rule(data=st.data(), i=st.integers(0, 100), lock=st.booleans(), at_snapshot=st.booleans())
    def match(self, data, i: int, lock: bool, at_snapshot: bool) -> None:
        if at_snapshot and self.ref:  # a snapshot's prefix and more
            seq = list(list(self.ref)[i % len(self.ref)]) + data.draw(st.lists(st.integers(0, 1), max_size=9))
        else:
            seq = self._tokens(data, self.seen[-1 - i % len(self.seen)], 2)
            seq += data.draw(st.lists(st.integers(0, 1), max_size=self.ps - 1))  # an unaligned tail
        handle = self.tree.match_prefix(seq)
        hits = [len(k) for k in self.ref if tuple(seq[: len(k)]) == k]
        expected = max(hits, default=0)
        assert handle.cached_len == expected
        if expected:
            assert read(self.pool, handle.state_slot) == fake_state(tuple(seq[:expected]))
        else:
            assert handle.state_slot is None
        if lock:
            self.tree.lock(handle)
            self.locks.append((handle, handle.state_slot))

    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        if self.locks:
            handle, _ = self.locks.pop(i % len(self.locks))
            self.tree.unlock(handle)

    @rule(frac=st.floats(0, 1))
    def evict(self, frac: float) -> None:
        evictable = self.tree.size_info.evictable_size
        tokens = int(frac * evictable) // self.ps * self.ps
        snaps_before, bare = len(self.ref), bare_tokens(self.tree)
        self._evict(tokens)
        self._reconcile()
        if tokens <= bare:
            assert len(self.ref) == snaps_before, "a snapshot was evicted before a bare leaf"

    @rule(count=st.integers(0, NUM_SLOTS))
    def evict_snapshots(self, count: int) -> None:
        size, before = self.tree.size_info, len(self.ref)
        evictable = self.tree.num_evictable_snapshots
        assert self.tree.evict_snapshots(count) == min(count, evictable)
        self._reconcile()
        assert len(self.ref) == before - min(count, evictable)
        assert self.tree.size_info == size, "evicting snapshots must keep the K/V"

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity(locks=[h for h, _ in self.locks])
        held = snapshots(self.tree)
        assert set(held) == set(self.ref)
        assert all(read(self.pool, slot) == self.ref[k] for k, slot in held.items())
        assert self.pool.used_slots == set(held.values()), "state slot leak"
        assert len(self.free) + self.tree.size_info.total_size // self.ps == NUM_PAGES, "page leak"


TestSnapshotsPS1 = _machine(1, SnapshotMachine).TestCase
TestSnapshotsPS4 = _machine(4, SnapshotMachine).TestCase


# ----------------------------------------------------------------------------- unit tests


def _tree(ps: int = 1, slots: int = NUM_SLOTS) -> tuple[SnapshotRadixCache, StatePool]:
    pool = StatePool(SPEC, slots)
    return SnapshotRadixCache(ps, pool), pool


def _snap(tree: SnapshotRadixCache, handle: MatchHandle, length: int) -> int | None:
    slot = tree.state_pool.alloc(1)[0]
    return tree.attach_snapshot(handle, length, slot)


def test_plain_tree_has_no_snapshots() -> None:
    tree = RadixPrefixCache(1)
    _, handle = tree.insert_prefix([1, 2, 3], [0, 1, 2])
    assert not tree.needs_snapshots and handle.state_slot is None
    assert tree.match_prefix([1, 2, 3]).cached_len == 3  # no back-off


def test_match_backs_off_to_the_deepest_snapshot_never_inside_a_node() -> None:
    tree, pool = _tree()
    _, handle = tree.insert_prefix([1, 2, 3, 4, 5, 6], np.arange(6))
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).cached_len == 0  # K/V but no snapshot: a miss
    assert _snap(tree, handle, 2) is None  # splits [1..6] at 2: the lower part keeps no snapshot
    assert _snap(tree, handle, 6) is None
    assert tree.match_prefix([1, 2, 3, 4, 9]).cached_len == 2  # splits at 4, backs off to 2
    match = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert match.cached_len == 6 and match.state_slot == handle.node.state_slot
    assert tree.match_prefix([1, 2, 3, 4]).state_slot == tree.match_prefix([1, 2]).state_slot
    tree.check_integrity()
    assert pool.num_used == 2


def test_split_never_creates_a_snapshot() -> None:
    tree, _ = _tree()
    _, handle = tree.insert_prefix([1, 2, 3, 4], np.arange(4))
    _snap(tree, handle, 4)
    tree.insert_prefix([1, 2, 7, 7], np.arange(10, 14))  # splits [1..4] at 2
    upper = tree._root.children[1]
    assert len(upper.key) == 2 and upper.state_slot is None and len(upper.children) == 2
    assert tree.match_prefix([1, 2]).cached_len == 0
    assert tree.match_prefix([1, 2, 3, 4]).cached_len == 4


def test_attach_on_a_snapshot_returns_the_new_slot() -> None:
    tree, pool = _tree()
    _, handle = tree.insert_prefix([1, 2], [0, 1])
    assert _snap(tree, handle, 2) is None
    assert _snap(tree, handle, 2) == 1  # the second slot, for the caller to free
    pool.free([1])
    tree.check_integrity()
    assert pool.num_used == 1


@pytest.mark.parametrize("length", [0, 3, 5])
def test_attach_rejects_lengths_outside_the_path_or_pages(length: int) -> None:
    tree, _ = _tree(ps=2)
    _, handle = tree.insert_prefix([1, 2, 3, 4], np.arange(4))
    with pytest.raises(ValueError):
        tree.attach_snapshot(handle, length, 0)


def test_leaves_without_snapshot_are_evicted_first() -> None:
    tree, pool = _tree()
    _, old = tree.insert_prefix([1, 1], [0, 1])
    _snap(tree, old, 2)
    tree.insert_prefix([2, 2], [2, 3])  # newer, but bare
    assert sorted(tree.evict(2).tolist()) == [2, 3]
    assert tree.match_prefix([1, 1]).cached_len == 2
    assert sorted(tree.evict(2).tolist()) == [0, 1] and pool.num_used == 0  # its snapshot is freed
    tree.check_integrity()


def test_a_parent_left_bare_by_eviction_is_trimmed_next() -> None:
    tree, _ = _tree()
    tree.insert_prefix([5, 5, 6, 6], [0, 1, 2, 3])
    tree.insert_prefix([5, 5, 7, 7], [4, 5, 6, 7])  # [5, 5] becomes a bare internal node
    _, kept = tree.insert_prefix([1, 1], [8, 9])
    _snap(tree, kept, 2)
    assert sorted(tree.evict(6).tolist()) == [0, 1, 2, 3, 6, 7]  # [5, 5] keeps its first slots
    assert tree.match_prefix([1, 1]).cached_len == 2
    tree.check_integrity()


def test_evict_snapshots_keeps_kv_and_locked_snapshots() -> None:
    tree, pool = _tree()
    _, handle = tree.insert_prefix([1, 2, 3, 4], np.arange(4))
    _snap(tree, handle, 2)
    _snap(tree, handle, 4)
    _, other = tree.insert_prefix([9, 9], [4, 5])
    _snap(tree, other, 2)
    locked = tree.match_prefix([1, 2, 3, 4])
    tree.lock(locked)
    assert tree.num_evictable_snapshots == 1
    assert tree.evict_snapshots(3) == 1 and pool.num_used == 2
    assert tree.match_prefix([9, 9]).cached_len == 0 and tree.size_info.total_size == 6
    tree.check_integrity(locks=[locked])
    tree.unlock(locked)
    assert tree.evict_snapshots(1) == 1  # the least recently used: [1, 2] (the lower node was matched)
    assert tree.match_prefix([1, 2, 3, 4]).cached_len == 4 and tree.match_prefix([1, 2]).cached_len == 0
    tree.check_integrity()


def test_bare_leaf_trimmed_after_its_snapshot_is_evicted() -> None:
    tree, _ = _tree()
    _, a = tree.insert_prefix([1, 1], [0, 1])
    _snap(tree, a, 2)
    _, b = tree.insert_prefix([2, 2], [2, 3])
    _snap(tree, b, 2)
    tree.match_prefix([1, 1])  # [2, 2] is now the least recently used; evict [1, 1]'s snapshot
    node = a.node
    tree.evict_snapshots(2)
    tree.check_integrity()
    assert node.state_slot is None
    assert sorted(tree.evict(2).tolist()) in ([0, 1], [2, 3])


def test_reset_frees_every_snapshot_across_namespaces() -> None:
    tree, pool = _tree()
    _, handle = tree.insert_prefix([1], [0])
    _snap(tree, handle, 1)
    tree.namespace = "adapter"
    _, handle = tree.insert_prefix([1], [1])
    _snap(tree, handle, 1)
    assert tree.match_prefix([1, 2]).cached_len == 1 and pool.num_used == 2
    tree.check_integrity()
    tree.reset()
    assert pool.num_used == 0 and tree.snapshot_slots() == []
    tree.check_integrity()


def test_check_integrity_detects_a_broken_snapshot_index() -> None:
    tree, _ = _tree()
    _, handle = tree.insert_prefix([1, 2], [0, 1])
    _snap(tree, handle, 2)
    handle.node.state_slot = 5  # the index still says slot 0
    with pytest.raises(IntegrityError, match="snapshot index"):
        tree.check_integrity()


def test_check_integrity_detects_an_unqueued_bare_leaf() -> None:
    tree, _ = _tree()
    tree.insert_prefix([1, 2], [0, 1])
    tree._bare_heap.clear()
    with pytest.raises(IntegrityError, match="trimming heap"):
        tree.check_integrity()
