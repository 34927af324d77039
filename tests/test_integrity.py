"""`check_integrity` is exact: every broken state planted here is caught, and healthy states pass."""

from __future__ import annotations

import numpy as np
import pytest

from hf_radix import IntegrityError
from hf_radix.memory.cache_manager import CacheManager

PS = 2


def _manager_with_a_running_row() -> tuple[CacheManager, int, list[int]]:
    """8 pages of 2: one finished request cached, one running request on the same prefix."""
    manager = CacheManager(num_pages=8, page_size=PS)
    tokens = [5, 6, 7, 8, 9]
    for ids in (tokens, [*tokens, 10, 11]):
        handle = manager.match(ids)
        manager.lock(handle)
        row = manager.open_row(handle)
        manager.allocate([row], [len(ids)])
        if ids is tokens:
            manager.cache_req(row, ids, len(ids), finished=True)
    manager.cache_req(row, [*tokens, 10, 11], 6, finished=False)
    manager.check_integrity()
    return manager, row, [*tokens, 10, 11]


def test_a_leaked_lock_fails():
    manager, _, tokens = _manager_with_a_running_row()
    manager.lock(manager.match(tokens))  # a lock no row holds
    with pytest.raises(IntegrityError, match="live locks"):
        manager.check_integrity()


def test_a_lock_released_behind_a_rows_back_fails():
    manager, row, _ = _manager_with_a_running_row()
    handle = manager._rows[row].handle
    manager.tree.unlock(handle)
    handle.locked = True  # the row still believes it holds its prefix
    with pytest.raises(IntegrityError, match="live locks"):
        manager.check_integrity()


def test_free_list_holding_the_scratch_page_instead_of_page_0_fails():
    manager = CacheManager(num_pages=4, page_size=PS)
    manager.check_integrity()
    manager._free = np.array([1, 2, 3, 4], dtype=np.int64) * PS  # page 4 is the scratch page, page 0 lost
    with pytest.raises(IntegrityError, match="scratch page"):
        manager.check_integrity()


@pytest.mark.parametrize("slot", [-PS, 40 * PS])
def test_a_page_index_out_of_range_fails(slot: int):
    manager, _, _ = _manager_with_a_running_row()
    manager._free = np.concatenate([manager._free[1:], [slot]])
    with pytest.raises(IntegrityError, match="out of range"):
        manager.check_integrity()


def test_an_owned_slot_out_of_range_fails():
    manager, row, _ = _manager_with_a_running_row()
    manager.table.host[row, manager.row_len(row) - 1] = 99 * PS
    with pytest.raises(IntegrityError, match="out of range"):
        manager.check_integrity()


def test_a_lost_page_fails_and_names_it():
    manager, _, _ = _manager_with_a_running_row()
    lost = int(manager._free[0])
    manager._free = manager._free[1:]
    with pytest.raises(IntegrityError, match=f"first missing page {lost // PS}"):
        manager.check_integrity()


def test_a_page_in_two_places_fails():
    manager, row, _ = _manager_with_a_running_row()
    manager._free = np.concatenate([manager._free[:-1], manager.row_slots(row)[-PS:-PS + 1].astype(np.int64)])
    with pytest.raises(IntegrityError, match="two places"):
        manager.check_integrity()


def test_a_row_disagreeing_with_the_tree_fails():
    manager, row, _ = _manager_with_a_running_row()
    slots = manager.table.host[row]
    slots[0], slots[1] = slots[1], slots[0]
    with pytest.raises(IntegrityError, match="disagrees"):
        manager.check_integrity()
