"""Tests for hf_radix.memory.radix_tree: stateful check against a naive per-page reference, plus unit
tests."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_radix.memory.radix_tree import IntegrityError, MatchHandle, RadixPrefixCache, SizeInfo

pytestmark = pytest.mark.slow  # no transformers version changes what this tests: run once

# ----------------------------------------------------------------------------- helpers


def snapshot(tree: RadixPrefixCache) -> tuple:
    """Everything observable in the tree: sizes, clock, (path, slots, ref_count, last_access) per node."""
    rows = []
    stack = [((), tree._root)]
    while stack:
        path, node = stack.pop()
        for child in node.children.values():
            cpath = path + tuple(child.key.tolist())
            rows.append((cpath, tuple(child.value.tolist()), child.ref_count, child.last_access))
            stack.append((cpath, child))
    return tree.size_info, tree._tick, sorted(rows)


def tree_slots(tree: RadixPrefixCache) -> list[int]:
    return sorted(s for row in snapshot(tree)[2] for s in row[1])


def page_slots(starts: list[int], ps: int) -> np.ndarray:
    if not starts:
        return np.empty(0, dtype=np.int64)
    return (np.asarray(starts, dtype=np.int64)[:, None] + np.arange(ps)).ravel()


class PageModel:
    """Naive reference: one entry per cached page, keyed by the whole token prefix that ends with it.

    Each page carries its slot-page start and the tick of its last match/insert. Pages of one tree node
    always share a tick, and unreferenced leaf pages have distinct ticks, so "evict the oldest unlocked
    leaf page, one page at a time" reproduces the tree's node-by-node LRU eviction exactly.
    """

    def __init__(self, ps: int) -> None:
        self.ps = ps
        self.pages: dict[tuple, list[int]] = {}  # prefix -> [slot page start, tick]
        self.locks: Counter[tuple] = Counter()
        self.tick = 0

    def match_len(self, seq: list[int]) -> int:
        k = 0
        while k + self.ps <= len(seq) and tuple(seq[: k + self.ps]) in self.pages:
            k += self.ps
        return k

    def _prefixes(self, seq: list[int] | tuple, k: int) -> list[tuple]:
        return [tuple(seq[:j]) for j in range(self.ps, k + 1, self.ps)]

    def touch(self, seq: list[int], k: int) -> None:
        self.tick += 1
        for p in self._prefixes(seq, k):
            self.pages[p][1] = self.tick

    def insert(self, seq: list[int], slots: np.ndarray) -> None:
        self.tick += 1
        for i, p in enumerate(self._prefixes(seq, len(seq))):
            self.pages.setdefault(p, [int(slots[i * self.ps]), 0])[1] = self.tick

    def slots(self, seq: list[int] | tuple, k: int) -> np.ndarray:
        return page_slots([self.pages[p][0] for p in self._prefixes(seq, k)], self.ps)

    def lock(self, prefix: tuple, delta: int) -> None:
        for p in self._prefixes(prefix, len(prefix)):
            self.locks[p] += delta
            assert self.locks[p] >= 0

    def evict_one(self) -> tuple[tuple, int, int]:
        """Removes the oldest unlocked leaf page; returns (prefix, slot page start, tick)."""
        parents = {p[: -self.ps] for p in self.pages}
        leaves = [p for p in self.pages if p not in parents and not self.locks[p]]
        assert leaves, "model has nothing left to evict"
        ticks = sorted(self.pages[p][1] for p in leaves)
        assert len(ticks) < 2 or ticks[0] < ticks[1], "unreferenced leaf ticks must be distinct"
        victim = min(leaves, key=lambda p: self.pages[p][1])
        start, tick = self.pages.pop(victim)
        return victim, start, tick

    def sizes(self) -> SizeInfo:
        protected = sum(1 for p in self.pages if self.locks[p]) * self.ps
        return SizeInfo(len(self.pages) * self.ps - protected, protected)


# ----------------------------------------------------------------------------- stateful test

MAX_PAGES = 5  # pages per generated sequence
NUM_PAGES = 24  # KV pool capacity in pages
MAX_LOCKED = 6
MAX_HANDLES = 12

page_lists = st.lists(st.integers(0, 3), max_size=MAX_PAGES)


class RadixMachine(RuleBasedStateMachine):
    """Drives the tree and the PageModel through the same request lifecycle and compares them."""

    PAGE_SIZE = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.ps = self.PAGE_SIZE
        self.tree = RadixPrefixCache(page_size=ps)
        self.model = PageModel(ps)
        self.free: list[int] = list(range(0, NUM_PAGES * ps, ps))  # free slot pages (their start slots)
        # Four page patterns; for ps > 1 patterns 0, 2 and 3 share their first token(s) (mid-page mismatch).
        if ps == 1:
            self.patterns = [[0], [1], [2], [3]]
        else:
            self.patterns = [[0] * ps, [1] * ps, [0] * (ps - 1) + [1], [0] * (ps // 2) + [2] * (ps - ps // 2)]
        self.handles: list[dict] = []  # {"h", "prefix", "stale"}
        self.requests: list[dict] = []  # matched+locked, slots allocated, waiting for insert

    # -- helpers

    def tokens(self, pats: list[int]) -> list[int]:
        return [t for p in pats for t in self.patterns[p]]

    def locked(self) -> list[dict]:
        return [e for e in self.handles if e["h"].locked]

    def unlocked(self) -> list[dict]:
        return [e for e in self.handles if not e["h"].locked]

    def track(self, h: MatchHandle, prefix: tuple, lock: bool) -> None:
        if lock and len(self.locked()) < MAX_LOCKED:
            self.tree.lock(h)
            self.model.lock(prefix, +1)
        self.handles.append({"h": h, "prefix": prefix, "stale": False})
        if len(self.handles) > MAX_HANDLES and self.unlocked():
            self.handles.remove(self.unlocked()[0])

    def do_evict(self, n: int) -> None:
        out = self.tree.evict(n)
        assert out.dtype == np.int64
        assert n <= len(out) < n + MAX_PAGES * self.ps, "evict frees whole nodes, at most one node too many"
        assert len(out) % self.ps == 0
        removed = [self.model.evict_one() for _ in range(len(out) // self.ps)]
        expected = page_slots([start for _, start, _ in removed], self.ps)
        np.testing.assert_array_equal(np.sort(out), np.sort(expected))  # exactly the LRU pages
        # It stops after the first node that reaches n; the last node's pages share one tick.
        if removed:
            before_last = sum(1 for *_, tick in removed if tick != removed[-1][2]) * self.ps
            assert before_last < n, "evicted another node after already freeing enough"
        gone = {prefix for prefix, _, _ in removed}
        for e in self.handles:
            if e["prefix"] in gone:
                assert not e["h"].locked
                e["stale"] = True
        self.free.extend(start for _, start, _ in removed)

    def alloc(self, npages: int) -> list[int] | None:
        short = npages - len(self.free)
        if short > 0:
            if short * self.ps > self.tree.size_info.evictable_size:
                return None
            self.do_evict(short * self.ps)
        taken = self.free[len(self.free) - npages:]
        del self.free[len(self.free) - npages:]
        return taken

    def check_match(self, seq: list[int]) -> MatchHandle:
        before = self.tree.size_info
        h = self.tree.match_prefix(seq)
        k = self.model.match_len(seq)
        assert h.cached_len == k and not h.locked
        assert self.tree.size_info == before
        self.model.touch(seq, k)
        np.testing.assert_array_equal(h.matched_indices(), self.model.slots(seq, k))
        return h

    # -- rules

    @rule(pats=page_lists, lock=st.booleans())
    def insert_fresh(self, pats: list[int], lock: bool) -> None:
        seq = self.tokens(pats)
        pages = self.alloc(len(seq) // self.ps)
        if pages is None:
            return
        slots = page_slots(pages, self.ps)
        expected = self.model.match_len(seq)
        already, h = self.tree.insert_prefix(seq, slots)
        assert already == expected
        assert h.cached_len == len(seq) and not h.locked
        self.model.insert(seq, slots)
        self.free.extend(pages[: already // self.ps])  # duplicates of what the tree already had
        np.testing.assert_array_equal(h.matched_indices(), self.model.slots(seq, len(seq)))
        self.track(h, tuple(seq), lock)

    @rule(pats=page_lists, tail=st.integers(0, 15), lock=st.booleans())
    def match(self, pats: list[int], tail: int, lock: bool) -> None:
        seq = self.tokens(pats) + self.patterns[0][: tail % self.ps]  # a partial page is never matched
        h = self.check_match(seq)
        self.track(h, tuple(seq[: h.cached_len]), lock)

    @rule(pats=page_lists)
    def begin_request(self, pats: list[int]) -> None:
        seq = self.tokens(pats)
        h = self.check_match(seq)
        prefix = tuple(seq[: h.cached_len])
        self.tree.lock(h)
        self.model.lock(prefix, +1)
        pages = self.alloc((len(seq) - h.cached_len) // self.ps)
        if pages is None:
            self.tree.unlock(h)
            self.model.lock(prefix, -1)
            return
        self.requests.append({"seq": seq, "h": h, "prefix": prefix, "pages": pages,
                              "matched": h.matched_indices()})

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 100), keep=st.booleans())
    def finish_request(self, i: int, keep: bool) -> None:
        req = self.requests.pop(i % len(self.requests))
        seq, h = req["seq"], req["h"]
        full = np.concatenate([req["matched"], page_slots(req["pages"], self.ps)])
        expected = self.model.match_len(seq)
        already, h2 = self.tree.insert_prefix(seq, full)
        assert already == expected >= h.cached_len
        self.model.insert(seq, full)
        self.tree.unlock(h)
        self.model.lock(req["prefix"], -1)
        # Another request may have cached [cached_len:already] meanwhile: those slots are duplicates.
        self.free.extend(req["pages"][: (already - h.cached_len) // self.ps])
        np.testing.assert_array_equal(h2.matched_indices(), self.model.slots(seq, len(seq)))
        self.track(h2, tuple(seq), keep)

    @precondition(lambda self: self.locked())
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        e = self.locked()[i % len(self.locked())]
        self.tree.unlock(e["h"])
        self.model.lock(e["prefix"], -1)
        assert not e["h"].locked

    @precondition(lambda self: self.unlocked())
    @rule(i=st.integers(0, 100))
    def relock(self, i: int) -> None:
        e = self.unlocked()[i % len(self.unlocked())]
        if e["stale"] or len(self.locked()) >= MAX_LOCKED:
            if e["stale"]:
                snap = snapshot(self.tree)
                with pytest.raises(ValueError):
                    self.tree.lock(e["h"])
                with pytest.raises(ValueError):
                    e["h"].matched_indices()
                assert snapshot(self.tree) == snap and not e["h"].locked
            return
        self.tree.lock(e["h"])
        self.model.lock(e["prefix"], +1)
        expected = self.model.slots(e["prefix"], len(e["prefix"]))
        np.testing.assert_array_equal(e["h"].matched_indices(), expected)

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 100))
    def misuse_lock_state(self, i: int) -> None:
        e = self.handles[i % len(self.handles)]
        snap = snapshot(self.tree)
        was_locked = e["h"].locked
        with pytest.raises(ValueError):
            (self.tree.lock if was_locked else self.tree.unlock)(e["h"])
        assert e["h"].locked == was_locked and snapshot(self.tree) == snap

    @precondition(lambda self: self.tree.size_info.evictable_size)
    @rule(n=st.integers(0, 10_000))
    def evict(self, n: int) -> None:
        self.do_evict(1 + n % self.tree.size_info.evictable_size)

    @rule(negative=st.booleans())
    def evict_invalid(self, negative: bool) -> None:
        snap = snapshot(self.tree)
        with pytest.raises(ValueError):
            self.tree.evict(-1 if negative else self.tree.size_info.evictable_size + 1)
        assert snapshot(self.tree) == snap

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll:
            return
        old = list(self.handles)
        self.tree.reset()
        for e in old:
            with pytest.raises(ValueError):
                (self.tree.unlock if e["h"].locked else self.tree.lock)(e["h"])
        self.model = PageModel(self.ps)
        self.handles.clear()
        self.requests.clear()
        self.free = list(range(0, NUM_PAGES * self.ps, self.ps))
        assert self.tree.size_info == SizeInfo(0, 0)

    # -- invariants

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        info = self.tree.size_info
        assert info == self.model.sizes()
        pending = sum(len(r["pages"]) for r in self.requests)
        assert len(self.free) + info.total_size // self.ps + pending == NUM_PAGES, "slot leak"
        assert len(set(self.free)) == len(self.free)
        model_slots = np.sort(page_slots([v[0] for v in self.model.pages.values()], self.ps)).tolist()
        assert tree_slots(self.tree) == model_slots  # first insert's slots win, nothing else is kept


def _machine(ps: int, base: type[RuleBasedStateMachine] = RadixMachine) -> type[RuleBasedStateMachine]:
    """`base` with page size `ps` and the settings of these stateful tests."""
    cls = type(f"{base.__name__}PS{ps}", (base,), {"PAGE_SIZE": ps})
    cls.TestCase.settings = settings(
        max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return cls


TestRadixPS1 = _machine(1).TestCase
TestRadixPS2 = _machine(2).TestCase
TestRadixPS4 = _machine(4).TestCase
TestRadixPS16 = _machine(16).TestCase


# ----------------------------------------------------------------------------- unit tests


def arange(a: int, b: int) -> np.ndarray:
    return np.arange(a, b, dtype=np.int64)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_bad_page_size(bad: object) -> None:
    with pytest.raises(ValueError):
        RadixPrefixCache(page_size=bad)  # type: ignore[arg-type]


def test_empty_match_and_root_lock() -> None:
    tree = RadixPrefixCache()
    h = tree.match_prefix([])
    assert h.cached_len == 0 and h.node is tree._root and not h.locked
    assert h.matched_indices().dtype == np.int64 and len(h.matched_indices()) == 0
    tree.lock(h)
    assert h.locked and tree.size_info == SizeInfo(0, 0)
    tree.unlock(h)
    assert not h.locked
    tree.check_integrity()


def test_insert_returns_already_present_length() -> None:
    tree = RadixPrefixCache()
    assert tree.insert_prefix([1, 2, 3, 4], arange(0, 4))[0] == 0
    already, h = tree.insert_prefix([1, 2, 3, 4, 5, 6], arange(10, 16))
    assert already == 4 and h.cached_len == 6
    np.testing.assert_array_equal(h.matched_indices(), [0, 1, 2, 3, 14, 15])  # first insert's slots win
    already, h = tree.insert_prefix([1, 2, 7, 8], arange(20, 24))
    assert already == 2
    np.testing.assert_array_equal(h.matched_indices(), [0, 1, 22, 23])
    assert tree.insert_prefix([1, 2, 3], arange(30, 33))[0] == 3  # fully present, ends inside a node
    assert tree.insert_prefix([], arange(0, 0))[0] == 0
    assert tree.size_info == SizeInfo(8, 0)
    tree.check_integrity()


def test_split_on_match_keeps_ref_count_and_gets_fresh_time() -> None:
    tree = RadixPrefixCache()
    _, h = tree.insert_prefix([1, 2, 3, 4], arange(0, 4))
    tree.lock(h)
    old_node, old_time = h.node, h.node.last_access
    before = tree.size_info
    m = tree.match_prefix([1, 2, 9])
    assert m.cached_len == 2 and tree.size_info == before == SizeInfo(0, 4)
    head = m.node
    assert head.key.tolist() == [1, 2] and head.value.tolist() == [0, 1]
    assert head.ref_count == 1 and head.last_access > old_time
    assert old_node.key.tolist() == [3, 4] and old_node.parent is head and old_node.last_access == old_time
    assert h.node is old_node and h.matched_indices().tolist() == [0, 1, 2, 3]
    tree.check_integrity()
    tree.unlock(h)
    assert tree.size_info == SizeInfo(4, 0) and head.ref_count == 0
    tree.check_integrity()


def test_full_node_hit_refreshes_time() -> None:
    tree = RadixPrefixCache()
    _, a = tree.insert_prefix([1, 2], arange(0, 2))
    _, b = tree.insert_prefix([3, 4], arange(2, 4))
    t = a.node.last_access
    assert tree.match_prefix([1, 2, 5]).cached_len == 2
    assert a.node.last_access > b.node.last_access > t


def test_page_size_match_rounds_down() -> None:
    tree = RadixPrefixCache(page_size=4)
    tree.insert_prefix(list(range(8)), arange(8, 16))
    assert tree.match_prefix(list(range(7))).cached_len == 4
    assert tree.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).cached_len == 4
    assert tree.match_prefix([0, 1, 2, 99]).cached_len == 0
    h = tree.match_prefix(list(range(10)))
    assert h.cached_len == 8 and h.matched_indices().tolist() == list(range(8, 16))
    already, h = tree.insert_prefix([0, 1, 2, 3, 4, 5, 9, 9], arange(0, 8))
    assert already == 4 and h.matched_indices().tolist() == [8, 9, 10, 11, 4, 5, 6, 7]
    tree.check_integrity()


def test_lru_eviction_order_and_parent_becomes_candidate() -> None:
    tree = RadixPrefixCache()
    tree.insert_prefix([1, 2], arange(0, 2))
    tree.insert_prefix([3, 4], arange(2, 4))
    tree.insert_prefix([5, 6], arange(4, 6))
    tree.match_prefix([1, 2])
    assert tree.evict(1).tolist() == [2, 3]  # whole node, LRU
    assert tree.evict(2).tolist() == [4, 5]
    assert tree.evict(0).tolist() == [] and tree.evict(0).dtype == np.int64
    assert tree.evict(2).tolist() == [0, 1]
    assert tree.size_info == SizeInfo(0, 0)

    tree.insert_prefix([1, 2, 3, 4], arange(0, 4))
    tree.insert_prefix([1, 2, 5, 6], arange(4, 8))  # splits: [1,2] -> {[3,4] (older), [5,6]}
    assert tree.evict(3).tolist() == [2, 3, 6, 7]
    assert tree.size_info == SizeInfo(2, 0)
    assert tree.evict(2).tolist() == [0, 1]  # the parent became an evictable leaf
    tree.check_integrity()


def test_locked_paths_survive_eviction() -> None:
    tree = RadixPrefixCache()
    _, a = tree.insert_prefix([1, 2, 3], arange(0, 3))
    _, b = tree.insert_prefix([1, 2, 4], arange(3, 6))
    tree.lock(a)
    assert tree.size_info == SizeInfo(1, 3)
    assert tree.evict(1).tolist() == [5]
    with pytest.raises(ValueError):
        tree.evict(1)
    with pytest.raises(ValueError):  # b's node is gone: its handle is stale
        tree.lock(b)
    with pytest.raises(ValueError):
        b.matched_indices()
    assert tree.match_prefix([1, 2, 3]).cached_len == 3
    tree.unlock(a)
    assert tree.evict(3).tolist() == [2, 0, 1]
    tree.check_integrity()


def test_two_locks_on_one_path() -> None:
    tree = RadixPrefixCache()
    _, a = tree.insert_prefix([1, 2, 3], arange(0, 3))
    b = tree.match_prefix([1, 2])  # splits the node a sits on
    tree.lock(a)
    tree.lock(b)
    assert b.node.ref_count == 2 and a.node.ref_count == 1
    tree.unlock(a)
    assert tree.size_info == SizeInfo(1, 2)
    tree.unlock(b)
    assert tree.size_info == SizeInfo(3, 0)
    tree.check_integrity()


def test_accepts_numpy_and_torch_inputs() -> None:
    torch = pytest.importorskip("torch")
    tree = RadixPrefixCache(page_size=2)
    already, h = tree.insert_prefix(torch.tensor([5, 6, 7, 8]), torch.tensor([2, 3, 0, 1], dtype=torch.int32))
    assert already == 0 and h.matched_indices().dtype == np.int64
    m = tree.match_prefix(np.array([5, 6, 7, 8, 9], dtype=np.int32))
    assert m.cached_len == 4 and m.matched_indices().tolist() == [2, 3, 0, 1]
    assert tree.match_prefix(torch.tensor([5, 6, 1])).cached_len == 2
    tree.check_integrity()


def _populated(ps: int) -> tuple[RadixPrefixCache, MatchHandle, MatchHandle]:
    tree = RadixPrefixCache(page_size=ps)
    _, locked = tree.insert_prefix(list(range(4 * ps)), arange(0, 4 * ps))
    _, free = tree.insert_prefix(list(range(2 * ps)) + [99] * ps, arange(8 * ps, 11 * ps))
    tree.lock(locked)
    return tree, locked, free


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("negative evict", lambda t, lk, fr: t.evict(-1)),
        ("evict beyond evictable", lambda t, lk, fr: t.evict(t.size_info.evictable_size + 1)),
        ("non-int evict", lambda t, lk, fr: t.evict(1.0)),
        ("length mismatch", lambda t, lk, fr: t.insert_prefix([1, 2, 3, 4], arange(8, 10))),
        ("misaligned length", lambda t, lk, fr: t.insert_prefix([1, 2, 3], arange(8, 11))),
        ("page not starting aligned", lambda t, lk, fr: t.insert_prefix([7, 7, 7, 7], arange(9, 13))),
        ("page not consecutive", lambda t, lk, fr: t.insert_prefix([7, 7, 7, 7], np.array([8, 9, 11, 10]))),
        ("2-d tokens", lambda t, lk, fr: t.insert_prefix([[7, 7], [7, 7]], arange(8, 12))),
        ("float tokens", lambda t, lk, fr: t.match_prefix([1.5, 2.0])),
        ("double lock", lambda t, lk, fr: t.lock(lk)),
        ("unlock unlocked", lambda t, lk, fr: t.unlock(fr)),
        ("foreign handle", lambda t, lk, fr: t.lock(RadixPrefixCache(2).match_prefix([1, 2]))),
    ],
)
def test_bad_input_raises_and_leaves_tree_unchanged(name: str, op) -> None:
    tree, locked, free = _populated(2)
    snap = snapshot(tree)
    with pytest.raises(ValueError):
        op(tree, locked, free)
    assert snapshot(tree) == snap, name
    assert locked.locked and not free.locked
    tree.check_integrity()


def test_reset() -> None:
    tree, locked, free = _populated(1)
    tree.reset()
    assert tree.size_info == SizeInfo(0, 0) and tree.match_prefix([0, 1]).cached_len == 0
    with pytest.raises(ValueError):
        tree.unlock(locked)
    with pytest.raises(ValueError):
        tree.lock(free)
    tree.check_integrity()
    tree.insert_prefix([0, 1], arange(0, 2))
    assert tree.size_info == SizeInfo(2, 0)


def _leaf(tree: RadixPrefixCache, *path: int):
    node = tree._root
    for tok in path:
        node = node.children[tok]
    return node


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda t: setattr(_leaf(t, 1, 3), "ref_count", 2),  # child referenced more than its parent
        lambda t: setattr(_leaf(t, 1, 5), "ref_count", 1),  # a lock that no path to the root explains
        lambda t: setattr(_leaf(t, 1, 3), "value", np.array([0, 1], dtype=np.int64)),  # duplicated slots
        lambda t: setattr(_leaf(t, 1, 3), "value", np.array([9], dtype=np.int64)),  # key/value length differ
        lambda t: setattr(_leaf(t, 1, 3), "parent", t._root),  # wrong parent pointer
        lambda t: _leaf(t, 1).children.update({7: _leaf(t, 1).children.pop(3)}),  # filed under a wrong key
        lambda t: setattr(t, "_evictable", t._evictable + 1),  # size counter drift
        lambda t: setattr(t, "_num_nodes", 99),
        lambda t: setattr(_leaf(t, 1, 3), "last_access", 10**9),  # child newer than its parent
        lambda t: t._heap.clear(),  # evictable leaves no longer reachable by evict
    ],
)
def test_check_integrity_detects_corruption(corrupt) -> None:
    tree = RadixPrefixCache()
    _, h = tree.insert_prefix([1, 2, 3, 4], arange(0, 4))
    tree.insert_prefix([1, 2, 5], arange(4, 7))
    tree.lock(h)
    tree.check_integrity()
    corrupt(tree)
    with pytest.raises(IntegrityError):
        tree.check_integrity()


def test_check_integrity_detects_misaligned_pages() -> None:
    tree = RadixPrefixCache(page_size=2)
    _, h = tree.insert_prefix([1, 2, 3, 4], arange(0, 4))
    tree.check_integrity()
    h.node.value = np.array([1, 2, 3, 4], dtype=np.int64)
    with pytest.raises(IntegrityError):
        tree.check_integrity()
    h.node.value = arange(0, 4)
    h.node.key = h.node.key[:3]
    h.node.value = h.node.value[:3]
    with pytest.raises(IntegrityError):
        tree.check_integrity()


def test_eviction_heap_stays_bounded() -> None:
    tree = RadixPrefixCache()
    tree.insert_prefix([1, 2], arange(0, 2))
    tree.insert_prefix([3], arange(2, 3))
    for _ in range(5000):  # each hit re-queues the leaf under its new access time
        tree.match_prefix([1, 2])
    assert len(tree._heap) <= 2 * 2 + 1024 + 1
    tree.check_integrity()
    assert tree.evict(1).tolist() == [2]
    assert tree.evict(1).tolist() == [0, 1]


def test_heap_compaction_during_evict() -> None:
    tree = RadixPrefixCache()
    for n in range(1, 6):  # chain [1] -> [2] -> ... -> [5] holding slots 0..4
        tree.insert_prefix(list(range(1, n + 1)), arange(0, n))
    tree.insert_prefix([9], arange(5, 6))
    while len(tree._heap) < 2 * 6 + 1024:  # stale entries pile up to just below the compaction threshold
        tree.match_prefix([9])
    # Re-queuing parents compacts the heap mid-eviction; the chain must still go before the newer [9].
    assert tree.evict(5).tolist() == [4, 3, 2, 1, 0]
    assert len(tree._heap) < 10
    tree.check_integrity()
    assert tree.evict(1).tolist() == [5]
