"""Host tier behind a CacheManager with state layers: snapshots leave with their evicted leaf and come back
with the K/V they end, so that a match the host completes restores exactly the state of its prefix."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_host_tier import _check_data, _write
from test_hybrid_cache_manager import SPEC, _state
from test_radix_snapshots import fake_state as _fake

from hf_radix.memory.cache_manager import CacheManager
from hf_radix.memory.host_tier import HostTier
from hf_radix.memory.kv_pool import KVPool, KVShape
from hf_radix.memory.state_pool import StatePool, StatePoolError, host_state_slots

pytestmark = pytest.mark.slow  # the memory layer's own logic: no transformers version changes it


def fake_state(prefix: tuple[int, ...]) -> float:
    """A state value per prefix, exact in the float32 states of SPEC."""
    return _fake(prefix) % 65521 + 1


def _two_tier(gpu_pages: int, host_tokens: int, page_size: int, state_slots: int = 4,
              host_state_slots: int | None = None) -> CacheManager:
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=2)
    pool = KVPool(shape, gpu_pages, page_size, torch.float32, "cpu")
    manager = CacheManager(gpu_pages, page_size, state_pool=StatePool(SPEC, state_slots))
    HostTier(pool, host_tokens, staging_pages=3, state_slots=host_state_slots).attach(manager)
    return manager


def _serve(manager: CacheManager, ids: list[int], keep_open: bool = False) -> int | None:
    """One request: checks the restored K/V and state, computes the rest (fingerprint K/V, a fake state),
    snapshots at floor((len-1)/page)*page and releases (or keeps the row open). Returns the open row."""
    handle = manager.match(ids)
    _check_data(manager, handle.matched_indices(), ids)
    manager.lock(handle)
    ps = manager.page_size
    if manager.pages_for(handle.cached_len, len(ids)) * ps > manager.available_size:
        manager.unlock(handle)
        return None
    try:
        row = manager.open_row(handle)
    except StatePoolError:
        manager.unlock(handle)
        return None
    cached = manager.row_cached_len(row)
    assert _state(manager, manager.row_state_slot(row)) == (fake_state(tuple(ids[:cached])) if cached else 0)
    manager.allocate([row], [len(ids)])
    _write(manager, manager.row_slots(row), ids, cached, len(ids))
    upto = (len(ids) - 1) // ps * ps
    if upto > cached:
        manager.state_slots.pool.tensors[(3, "recurrent")][manager.row_state_slot(row)] = fake_state(
            tuple(ids[:upto])
        )
        manager.cache_req(row, ids, upto, finished=False)
        with contextlib.suppress(StatePoolError):  # every state slot running or locked
            manager.snapshot_row(row)
    if keep_open:
        return row
    manager.cache_req(row, ids, manager.row_cached_len(row), finished=True)
    return None


def test_a_snapshot_round_trips_through_the_host_tier() -> None:
    manager = _two_tier(gpu_pages=8, host_tokens=32, page_size=2)
    a, b, c = ([k] * 8 + [1] for k in (10, 20, 30))
    for ids in (a, b, c):  # each evicts the one before it (K/V and snapshot) to the host tier
        _serve(manager, ids)
        manager.check_integrity()
    host = manager.host_tier
    assert host.tree.match_prefix(np.asarray(a)).cached_len == 8 and host.snapshots.host.pool.num_used >= 2
    assert manager.gpu_cached_len(a) == 0
    handle = manager.match(a)
    assert handle.cached_len == 8 and handle.restored_len == 8
    assert _state(manager, handle.state_slot) == fake_state(tuple(a[:8]))
    manager.check_integrity()
    _serve(manager, a)
    manager.check_integrity()


def test_snapshot_comes_back_onto_kv_the_gpu_kept() -> None:
    """The GPU keeps a's K/V but has evicted the snapshot at its end: only the state is copied back."""
    manager = _two_tier(gpu_pages=16, host_tokens=32, page_size=2)
    a = [5] * 8 + [1]
    _serve(manager, a)
    leaf = manager.match(a).node
    manager.host_tier._keep(leaf)  # as if evicted to the host, then
    manager.tree.evict_snapshots(1)  # the GPU dropped the snapshot to free its state slot
    assert manager.gpu_cached_len(a) == 0
    handle = manager.match(a)
    assert handle.cached_len == 8 and _state(manager, handle.state_slot) == fake_state(tuple(a[:8]))
    assert manager.host_tier.restored_tokens == 0  # no K/V copied
    manager.check_integrity()


def test_host_state_slots_are_sized_like_the_gpu_pool() -> None:
    """A quarter of the host K/V bytes, within the GPU default's [16, 1024], at most one per host page."""
    pool = StatePool(SPEC, 4)  # 32 bytes a slot (24 of state, padded to 16-byte pieces)
    assert pool.bytes_per_slot == 32
    assert host_state_slots(None, 100, 1 << 20) is None
    assert host_state_slots(pool, 1000, 4 * 32 * 100) == 100
    assert host_state_slots(pool, 1000, 0) == 16  # not capped by the GPU pool's 4 slots
    assert host_state_slots(pool, 8, 1 << 20) == 8
    assert host_state_slots(pool, 1 << 20, 1 << 30) == 1024


def test_every_snapshot_on_evicted_paths_comes_back() -> None:
    """The runner's pattern: each prompt has a snapshot at its end and one at prompt + answer (a leaf
    below it). Six such paths go through a GPU pool that holds one, and a GPU state pool of 4 slots that
    drops snapshots alone; the host tier, with slots sized by `host_state_slots`, brings every one back."""
    ps, host_tokens = 2, 256
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=2)
    pool = KVPool(shape, 12, ps, torch.float32, "cpu")
    states = StatePool(SPEC, 4)
    manager = CacheManager(12, ps, state_pool=states)
    slots = host_state_slots(states, host_tokens // ps, host_tokens * shape.bytes_per_token(torch.float32))
    HostTier(pool, host_tokens, staging_pages=3, state_slots=slots).attach(manager)
    prompts = [[k] * 8 + [1] for k in range(10, 16)]
    answered = [p + [2, 3, 4, 5] for p in prompts]
    for prompt, full in zip(prompts, answered):
        _serve(manager, prompt)  # a snapshot at 8
        _serve(manager, full)  # and one at 12, below it
        manager.check_integrity()
    assert manager.gpu_cached_len(prompts[0]) == 0
    for ids, end in [(p, 8) for p in prompts[:2]] + [(a, 12) for a in answered[:2]]:
        handle = manager.match(ids)
        assert handle.cached_len == end and _state(manager, handle.state_slot) == fake_state(tuple(ids[:end]))
        manager.check_integrity()
    assert manager.host_tier.restored_tokens > 0


def test_a_snapshot_the_gpu_drops_alone_goes_to_the_host() -> None:
    """Short of state slots, the GPU drops a's snapshot and keeps its K/V: the host tier keeps the
    snapshot (and the K/V of its path), and a later match gets it back without copying K/V."""
    manager = _two_tier(gpu_pages=32, host_tokens=64, page_size=2, state_slots=2)
    a, b = [5] * 8 + [1], [6] * 8 + [1]
    _serve(manager, a)
    _serve(manager, b)  # its snapshot takes a's slot
    assert manager.gpu_cached_len(a) == 0 and manager.tree.match_kv(a).cached_len == 8
    handle = manager.match(a)
    assert handle.cached_len == 8 and _state(manager, handle.state_slot) == fake_state(tuple(a[:8]))
    assert manager.host_tier.restored_tokens == 0
    manager.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
@settings(max_examples=30, deadline=None)
@given(
    gpu_tokens=st.integers(12, 32),
    state_slots=st.integers(3, 5),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9)), max_size=25),
)
def test_a_roomy_host_tier_loses_no_snapshot_property(page_size, gpu_tokens, state_slots, ops) -> None:
    """Model check: with room for everything in the host tier, a prompt matches at least the deepest
    snapshot point any earlier request left on it, however the GPU tiers evicted K/V and snapshots."""
    manager = _two_tier(gpu_tokens // page_size, 1024, page_size, state_slots, host_state_slots=256)
    prompts = [[7, 7, 7, 7], [7, 7, 8, 8], [9] * 6, [1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 3, 3], [2, 1] * 4]
    seen: set[tuple[int, ...]] = set()  # prefixes that ended at a snapshot once
    for prompt, extra in ops:
        ids = prompts[prompt] + [extra] * (extra % 3 + 1)
        best = max((n for n in range(len(ids)) if tuple(ids[:n]) in seen), default=0)
        assert manager.match(ids).cached_len >= best
        _serve(manager, ids)
        manager.check_integrity()
        seen.add(tuple(ids[: manager.gpu_cached_len(ids)]))


@pytest.mark.parametrize("page_size", [1, 2])
@settings(max_examples=40, deadline=None)
@given(
    gpu_tokens=st.integers(12, 32),
    host_tokens=st.integers(4, 48),
    state_slots=st.integers(2, 5),
    host_state_slots=st.integers(1, 4),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 9), st.booleans()), max_size=25),
)
def test_two_tier_with_snapshots_property(page_size, gpu_tokens, host_tokens, state_slots, host_state_slots,
                                          ops) -> None:
    manager = _two_tier(gpu_tokens // page_size, max(host_tokens, page_size), page_size, state_slots,
                        host_state_slots)
    prompts = [[7, 7, 7, 7], [7, 7, 8, 8], [9] * 6, [1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 3, 3], [2, 1] * 4]
    open_rows: list[tuple[int, list[int]]] = []
    for prompt, extra, keep in ops:
        ids = prompts[prompt] + [extra] * (extra % 3 + 1)
        if keep and len(open_rows) < 2:
            row = _serve(manager, ids, keep_open=True)
            if row is not None:
                open_rows.append((row, ids))
        else:
            _serve(manager, ids)
        manager.check_integrity()
    for row, ids in open_rows:
        manager.cache_req(row, ids, manager.row_cached_len(row), finished=True)
    manager.check_integrity()
    assert manager.tree.size_info.protected_size == 0
