"""CacheManager with a StatePool: running state slots, snapshots on the tree, and their integrity check."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix.hybrid_layers import StateKindSpec, StateLayerSpec
from hf_radix.memory.cache_manager import CacheManager, OutOfPagesError
from hf_radix.memory.radix_tree import IntegrityError
from hf_radix.memory.state_pool import StatePool, StatePoolError

pytestmark = pytest.mark.slow  # the memory layer's own logic: no transformers version changes it

SPEC = [StateLayerSpec(3, (StateKindSpec("conv", (2, 2), torch.float32),
                           StateKindSpec("recurrent", (2,), torch.float32)))]


def _manager(slots: int = 6, pages: int = 16, page_size: int = 2) -> CacheManager:
    return CacheManager(num_pages=pages, page_size=page_size, state_pool=StatePool(SPEC, slots))


def _start(manager: CacheManager, tokens: list[int]) -> int:
    handle = manager.match(tokens)
    manager.lock(handle)
    return manager.open_row(handle)


def _state(manager: CacheManager, slot: int) -> float:
    return float(manager.state_slots.pool.tensors[(3, "recurrent")][slot, 0])


def _run(manager: CacheManager, row: int, tokens: list[int], upto: int, value: float) -> None:
    """A forward up to `upto` tokens (its state: `value`), inserted and snapshotted there."""
    manager.allocate([row], [len(tokens)])
    pool = manager.state_slots.pool
    pool.tensors[(3, "recurrent")][manager.row_state_slot(row)] = value
    manager.cache_req(row, tokens, upto, finished=False)
    manager.snapshot_row(row)


def test_plain_manager_has_no_state_slots() -> None:
    manager = CacheManager(num_pages=4, page_size=1)
    row = _start(manager, [1, 2, 3])
    assert manager.state_slots is None and manager.row_state_slot(row) is None
    assert not manager.tree.needs_snapshots


def test_miss_zeroes_a_running_slot_and_a_hit_copies_the_snapshot() -> None:
    manager = _manager()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    row = _start(manager, prompt)
    slot = manager.row_state_slot(row)
    assert manager.row_cached_len(row) == 0 and _state(manager, slot) == 0.0
    _run(manager, row, prompt, 6, 42.0)  # floor((len-1)/page)*page
    snapshot = manager.row_handle(row).state_slot
    assert snapshot is not None and snapshot != slot and _state(manager, snapshot) == 42.0
    assert not manager.snapshot_row(row)  # already there
    manager.check_integrity()
    manager.cache_req(row, prompt, 7, finished=True)
    manager.check_integrity()
    assert manager.state_slots.pool.num_used == 1  # only the snapshot

    again = _start(manager, prompt + [8, 9])
    assert manager.row_cached_len(again) == 6
    running = manager.row_state_slot(again)
    assert running != snapshot and _state(manager, running) == 42.0  # restored: a copy
    manager.state_slots.pool.tensors[(3, "recurrent")][running] = 7.0
    assert _state(manager, snapshot) == 42.0  # the snapshot is untouched by the running row
    manager.check_integrity()
    manager.cache_req(again, prompt + [8, 9], 6, finished=True)
    manager.check_integrity()


def test_match_backs_off_to_the_snapshot_before_the_kv_match() -> None:
    manager = _manager()
    prompt = list(range(10, 20))
    row = _start(manager, prompt)
    manager.allocate([row], [10])
    pool = manager.state_slots.pool
    pool.tensors[(3, "recurrent")][manager.row_state_slot(row)] = 4.0
    manager.cache_req(row, prompt, 4, finished=False)
    manager.snapshot_row(row)
    manager.cache_req(row, prompt, 10, finished=True)  # K/V of all 10 tokens, a snapshot at 4
    assert manager.gpu_cached_len(prompt + [1]) == 4
    manager.check_integrity()


def test_out_of_state_slots_evicts_unlocked_snapshots_then_refuses() -> None:
    manager = _manager(slots=3)
    for first in (1, 2):
        row = _start(manager, [first, 0, 0])
        _run(manager, row, [first, 0, 0], 2, float(first))
        manager.cache_req(row, [first, 0, 0], 3, finished=True)
    assert manager.state_slots.available == 3 and manager.state_slots.pool.num_free == 1
    hit = _start(manager, [1, 0, 0])  # the free slot; [1, 0]'s snapshot is now locked
    assert manager.row_cached_len(hit) == 2 and _state(manager, manager.row_state_slot(hit)) == 1.0
    assert manager.state_slots.available == 1
    _start(manager, [5, 5, 5])  # takes the slot of [2, 0]'s snapshot (unlocked)
    assert manager.gpu_cached_len([2, 0, 0]) == 0 and manager.state_slots.available == 0
    handle = manager.match([6, 6, 6])
    manager.lock(handle)
    with pytest.raises(StatePoolError):
        manager.open_row(handle)
    manager.unlock(handle)
    assert manager.num_rows == 2
    manager.check_integrity()


def test_page_eviction_frees_snapshot_slots() -> None:
    manager = _manager(slots=8, pages=4, page_size=2)
    row = _start(manager, [1, 1, 1, 1, 9])
    _run(manager, row, [1, 1, 1, 1, 9], 4, 1.0)
    manager.cache_req(row, [1, 1, 1, 1, 9], 5, finished=True)
    assert manager.state_slots.pool.num_used == 1
    row = _start(manager, [2] * 9)  # needs all 4 pages: evicts [1, 1, 1, 1] and its snapshot
    manager.allocate([row], [8])
    assert manager.state_slots.pool.num_used == 1  # the new row's running slot only
    manager.check_integrity()
    manager.cache_req(row, [2] * 9, 8, finished=True)
    manager.check_integrity()


def _decode(manager: CacheManager, row: int, upto: int) -> None:
    """Decode steps up to `upto` tokens (state after n tokens: n), a held copy at every page boundary."""
    for n in range(manager.row_len(row) + 1, upto + 1):
        manager.allocate([row], [n])
        manager.state_slots.pool.tensors[(3, "recurrent")][manager.row_state_slot(row)] = float(n)
        if n % manager.page_size == 0:
            manager.hold_snapshot(row, n)


def test_a_held_copy_is_attached_when_released_at_the_last_page_boundary() -> None:
    manager = _manager()
    prompt = [1, 2, 3, 4, 5]
    row = _start(manager, prompt + [0] * 6)
    manager.allocate([row], [5])
    manager.cache_req(row, prompt, 4, finished=False)
    _decode(manager, row, 11)  # held copies at 6, 8, 10: one slot, overwritten
    assert manager.state_slots.pool.num_used == 2
    manager.check_integrity()
    manager.cache_req(row, prompt + [0] * 6, 11, finished=True)  # the tree gets 10 tokens: attached there
    manager.check_integrity()
    handle = manager.match(prompt + [0] * 6 + [7, 7])
    assert handle.cached_len == 10 and _state(manager, handle.state_slot) == 10.0
    assert manager.state_slots.pool.num_used == 1


def test_a_held_copy_past_an_abort_is_freed() -> None:
    manager = _manager()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    row = _start(manager, tokens)
    _decode(manager, row, 6)
    manager.cache_req(row, tokens, 4, finished=False)  # the held copy (at 6) waits
    manager.check_integrity()
    manager.cache_req(row, tokens, 5, finished=True)  # aborted before 6 was cached
    manager.check_integrity()
    assert manager.state_slots.pool.num_used == 0 and manager.gpu_cached_len(tokens) == 0


def test_hold_snapshot_needs_a_page_multiple() -> None:
    manager = _manager()
    row = _start(manager, [1, 2, 3])
    with pytest.raises(ValueError):
        manager.hold_snapshot(row, 3)


def _held_slot_leaked(manager: CacheManager, row: int) -> None:
    manager.hold_snapshot(row, 4)
    manager._rows[row].held = None


def _double_held(manager: CacheManager, row: int) -> None:
    manager.state_slots.pool.free([manager._rows[row].state_slot])
    manager._rows[row].state_slot = manager.row_handle(row).state_slot


def _leaked(manager: CacheManager, row: int) -> None:
    manager.state_slots.pool.alloc(1)


def _snapshot_on_freed_slot(manager: CacheManager, row: int) -> None:
    manager.state_slots.pool.free([manager.row_handle(row).state_slot])


def _running_slot_freed(manager: CacheManager, row: int) -> None:
    manager.state_slots.pool.free([manager.row_state_slot(row)])


def _free_and_used(manager: CacheManager, row: int) -> None:
    manager.state_slots.pool._free.append(manager.row_state_slot(row))


def _snapshot_index_lost(manager: CacheManager, row: int) -> None:
    manager.tree._snapshots.clear()


@pytest.mark.parametrize(
    "corrupt",
    [
        _double_held, _leaked, _snapshot_on_freed_slot, _running_slot_freed, _free_and_used,
        _snapshot_index_lost, _held_slot_leaked,
    ],
)
def test_check_integrity_detects_broken_state_slots(corrupt: Callable[[CacheManager, int], None]) -> None:
    manager = _manager()
    prompt = [1, 2, 3, 4, 5]
    row = _start(manager, prompt)
    _run(manager, row, prompt, 4, 3.0)
    manager.check_integrity()
    corrupt(manager, row)
    with pytest.raises(IntegrityError):
        manager.check_integrity()


def test_reset_frees_the_snapshots() -> None:
    manager = _manager()
    row = _start(manager, [1, 2, 3])
    _run(manager, row, [1, 2, 3], 2, 1.0)
    manager.cache_req(row, [1, 2, 3], 3, finished=True)
    manager.reset()
    assert manager.state_slots.pool.num_used == 0
    manager.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=9), st.booleans()), max_size=12))
def test_random_lifecycles_keep_state_slots_balanced(requests: list[tuple[list[int], bool]]) -> None:
    """Requests run one after another (some keep running); every hit restores the state of its prefix."""
    manager = _manager(slots=5, pages=12, page_size=2)
    running: list[tuple[int, list[int]]] = []
    for tokens, keep in requests:
        handle = manager.match(tokens)
        manager.lock(handle)
        try:
            row = manager.open_row(handle)
        except StatePoolError:
            manager.unlock(handle)
            continue
        cached = manager.row_cached_len(row)
        expect = float(hash(tuple(tokens[:cached])) % 1000) if cached else 0.0
        assert _state(manager, manager.row_state_slot(row)) == expect
        upto = (len(tokens) - 1) // 2 * 2
        try:
            manager.allocate([row], [len(tokens)])
        except OutOfPagesError:
            manager.cache_req(row, tokens, cached, finished=True)
            continue
        if upto > cached:
            manager.state_slots.pool.tensors[(3, "recurrent")][manager.row_state_slot(row)] = float(
                hash(tuple(tokens[:upto])) % 1000
            )
            manager.cache_req(row, tokens, upto, finished=False)
            with contextlib.suppress(StatePoolError):  # every slot running or locked
                manager.snapshot_row(row)
        manager.check_integrity()
        if keep:
            running.append((row, tokens))
        else:
            manager.cache_req(row, tokens, upto if upto > cached else cached, finished=True)
        manager.check_integrity()
    for row, tokens in running:
        manager.cache_req(row, tokens, manager.row_cached_len(row), finished=True)
    manager.check_integrity()
    assert manager.state_slots.pool.num_used == len(manager.tree.snapshot_slots())
    assert np.all(manager.tree.slot_indices() >= 0)
