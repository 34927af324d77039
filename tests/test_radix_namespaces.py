"""Namespaces of the radix tree (one per adapter set): each is a tree of its own over one set of slots;
eviction takes the least recently used leaf of any namespace."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix.memory.radix_tree import IntegrityError, RadixPrefixCache

PS = 2
NUM_PAGES = 12


def _prefix_keys(ns: int, seq: list[int], length: int) -> list[tuple]:
    return [(ns, *seq[:j]) for j in range(PS, length + 1, PS)]


ops = st.lists(
    st.tuples(st.sampled_from(["insert", "match", "evict"]), st.integers(0, 2),
              st.lists(st.integers(0, 2), min_size=1, max_size=4)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_namespaces_against_a_reference(operations):
    """Every match returns exactly the slots its namespace inserted; nothing leaks between namespaces."""
    tree = RadixPrefixCache(page_size=PS)
    reference: dict[tuple, int] = {}  # (namespace, *prefix) -> slot of the page ending the prefix
    free = list(range(0, NUM_PAGES * PS, PS))
    for op, ns, pats in operations:
        tree.namespace = ns
        seq = [t for p in pats for t in (p,) * PS]
        if op == "evict":
            if tree.size_info.evictable_size:
                freed = tree.evict(PS)
                gone = {int(s) for s in freed[::PS]}
                reference = {k: v for k, v in reference.items() if v not in gone}
                free.extend(gone)
            continue
        keys = _prefix_keys(ns, seq, len(seq))
        known = 0
        while known < len(keys) and keys[known] in reference:
            known += 1
        handle = tree.match_prefix(seq)
        assert handle.cached_len == known * PS
        expected = [reference[k] + i for k in keys[:known] for i in range(PS)]
        np.testing.assert_array_equal(handle.matched_indices(), expected)
        if op == "insert" and len(keys) - known <= len(free):
            new = [free.pop() for _ in keys[known:]]
            slots = np.array(expected + [s + i for s in new for i in range(PS)], dtype=np.int64)
            assert tree.insert_prefix(seq, slots)[0] == known * PS
            reference.update(zip(keys[known:], new))
        tree.check_integrity()
        assert sorted(tree.slot_indices().tolist()) == sorted(
            v + i for v in reference.values() for i in range(PS))
    assert tree.size_info.total_size == len(reference) * PS


def test_namespaces_are_separate_trees_with_one_lru():
    tree = RadixPrefixCache()
    tree.insert_prefix([1, 2, 3], np.arange(0, 3))
    tree.namespace = ("adapter", "b")
    assert tree.match_prefix([1, 2, 3]).cached_len == 0
    _, handle = tree.insert_prefix([1, 2, 3], np.arange(3, 6))
    assert tree.namespace_of(handle.node) == ("adapter", "b")
    tree.lock(handle)
    tree.namespace = None
    assert tree.match_prefix([1, 2, 3, 4]).matched_indices().tolist() == [0, 1, 2]
    assert sorted(tree.evict(3).tolist()) == [0, 1, 2]  # the locked namespace keeps its prefix
    tree.unlock(handle)
    tree.check_integrity()
    assert tree.size_info.total_size == 3
    tree.reset()
    with pytest.raises(ValueError, match="stale"):
        handle.matched_indices()
    assert tree.namespace is None and tree.size_info.total_size == 0


def test_integrity_check_sees_a_broken_namespace_root():
    tree = RadixPrefixCache()
    tree.namespace = "b"
    tree.insert_prefix([1, 2], np.arange(0, 2))
    tree.namespace = "a"
    tree._roots["b"].ref_count = 1  # planted: a root holding a lock
    with pytest.raises(IntegrityError, match="root"):
        tree.check_integrity()
