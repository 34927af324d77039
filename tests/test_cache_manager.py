"""CacheManager: pages are handed out once, freed once, and the request lifecycle keeps the books balanced."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix.memory.cache_manager import CacheManager, OutOfPagesError


def _start(manager: CacheManager, tokens: list[int]) -> int:
    handle = manager.match(tokens)
    manager.lock(handle)
    return manager.open_row(handle)


def _finish(manager: CacheManager, tokens: list[int]) -> None:
    """Runs one request to completion: all its tokens computed, then released."""
    row = _start(manager, tokens)
    manager.allocate([row], [len(tokens)])
    manager.cache_req(row, tokens, len(tokens), finished=True)


def test_allocation_under_pressure_evicts_exactly_enough():
    manager = CacheManager(num_pages=10, page_size=4)
    for first in range(10):
        _finish(manager, [first, 1, 2, 3])  # ten one-page leaves, all evictable
    assert manager.num_free_pages == 0 and manager.tree.size_info.evictable_size == 40
    row = _start(manager, [99, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    manager.allocate([row], [11])
    assert manager.evicted_tokens == 12
    assert manager.tree.size_info.total_size == 28
    manager.check_integrity()
    assert [manager.tree.match_prefix([f, 1, 2, 3]).cached_len for f in range(3)] == [0, 0, 0]  # LRU first
    manager.cache_req(row, [99] * 11, 0, finished=True)
    manager.check_integrity()


def test_locked_prefix_is_never_evicted():
    manager = CacheManager(num_pages=4, page_size=2)
    _finish(manager, [1, 2, 3, 4])
    row = _start(manager, [1, 2, 3, 4, 5])
    assert manager.row_cached_len(row) == 4
    other = _start(manager, [7, 7, 7, 7, 7])
    with pytest.raises(OutOfPagesError):
        manager.allocate([other], [6])  # 3 pages needed, 2 free, the 2 cached pages are locked
    manager.check_integrity()
    manager.allocate([other], [4])
    manager.cache_req(other, [7] * 5, 0, finished=True)
    manager.cache_req(row, [1, 2, 3, 4, 5], 4, finished=True)
    manager.check_integrity()


def test_duplicate_prefix_requests_free_their_duplicate_pages():
    manager = CacheManager(num_pages=16, page_size=2)
    tokens = list(range(10, 19))  # 9 tokens: 4 full pages + an unaligned tail
    rows = [_start(manager, tokens), _start(manager, tokens)]
    manager.allocate(rows, [9, 9])
    assert manager.num_free_pages == 16 - 10
    first_slots = manager.row_slots(rows[0])[:8].copy()
    manager.cache_req(rows[0], tokens, 9, finished=False)
    manager.cache_req(rows[1], tokens, 9, finished=False)  # its 4 full pages duplicate the tree's
    manager.check_integrity()
    assert manager.num_free_pages == 16 - 4 - 2  # tree pages + one tail page per row
    assert np.array_equal(manager.row_slots(rows[1])[:8], first_slots)  # row now reads the tree's slots
    for row in rows:
        manager.cache_req(row, tokens, 9, finished=True)
    manager.check_integrity()
    assert manager.num_free_pages == 16 - 4 and manager.num_rows == 0


def test_abort_and_finish_release_everything():
    manager = CacheManager(num_pages=32, page_size=4)
    rows = [_start(manager, list(range(i, i + 14))) for i in range(3)]
    manager.allocate(rows, [14, 14, 14])
    manager.cache_req(rows[0], list(range(0, 14)), 14, finished=True)  # finish
    manager.cache_req(rows[1], list(range(1, 15)), 0, finished=True)  # abort before anything was computed
    manager.cache_req(rows[2], list(range(2, 16)), 6, finished=True)  # abort mid-prefill
    manager.check_integrity()
    assert manager.num_rows == 0
    assert manager.tree.size_info.protected_size == 0
    assert manager.num_free_pages * 4 + manager.tree.size_info.total_size == 32 * 4
    assert manager.tree.size_info.total_size == 12 + 4


def test_lazy_free_region_defers_frees():
    manager = CacheManager(num_pages=8, page_size=1)
    row = _start(manager, [1, 2, 3])
    manager.allocate([row], [3])
    with manager.lazy_free_region():
        manager.cache_req(row, [1, 2, 3], 1, finished=True)
        assert manager.num_free_pages == 5
    assert manager.num_free_pages == 7
    manager.check_integrity()


def test_bad_calls_raise_and_change_nothing():
    manager = CacheManager(num_pages=8, page_size=2)
    with pytest.raises(ValueError):
        CacheManager(num_pages=0)
    handle = manager.match([1, 2, 3])
    with pytest.raises(ValueError, match="locked"):
        manager.open_row(handle)
    manager.lock(handle)
    row = manager.open_row(handle)
    manager.allocate([row], [3])
    with pytest.raises(ValueError):
        manager.cache_req(row, [1, 2, 3], 5, finished=True)
    manager.check_integrity()
    manager.cache_req(row, [1, 2, 3], 3, finished=True)
    with pytest.raises(RuntimeError):
        other = _start(manager, [4, 5])
        manager.reset()
    manager.cache_req(other, [4, 5], 0, finished=True)
    manager.reset()
    manager.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=12), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=25,
    ),
)
def test_random_lifecycles_never_hand_out_a_page_twice(page_size: int, ops):
    manager = CacheManager(num_pages=24, page_size=page_size)
    running: list[tuple[int, list[int], int]] = []
    for tokens, extra, finish_one in ops:
        handle = manager.match(tokens)
        need = manager.pages_for(handle.cached_len, len(tokens) + extra) * page_size
        if need <= manager.available_size:
            manager.lock(handle)
            if need > manager.available_size:
                manager.unlock(handle)
            else:
                row = manager.open_row(handle)
                manager.allocate([row], [len(tokens) + extra])
                computed = len(tokens) + extra
                manager.cache_req(row, tokens + [0] * extra, computed, finished=False)
                running.append((row, tokens + [0] * extra, computed))
        if finish_one and running:
            row, toks, computed = running.pop(0)
            manager.cache_req(row, toks, computed, finished=True)
        manager.check_integrity()
        owned = [manager.row_slots(r)[manager.row_cached_len(r) :] for r, _, _ in running]
        owned = np.concatenate(owned or [np.zeros(0, np.int64)])
        assert len(np.unique(owned)) == len(owned)
    for row, toks, computed in running:
        manager.cache_req(row, toks, computed, finished=True)
    manager.check_integrity()
    assert manager.num_rows == 0
