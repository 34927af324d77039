"""Host-memory tier: evicted pages come back with identical outputs; LRU; integrity across both tiers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fresh_model, random_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_radix
from hf_radix import RadixBatchRunner, SamplingParams
from hf_radix.memory.cache_manager import CacheManager
from hf_radix.memory.host_tier import HostTier
from hf_radix.memory.kv_pool import KVPool, KVShape
from hf_radix.memory.radix_tree import IntegrityError

NEW = 4
GREEDY = SamplingParams(max_new_tokens=NEW)


def _conversations(count: int = 4, length: int = 22, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = random_ids(gen, 6)
    return [system + random_ids(gen, length) for _ in range(count)]


def _revisit(runner: RadixBatchRunner, prompts: list[list[int]]) -> list:
    """Each prompt alone, twice over: the second pass revisits prefixes the small pool evicted long ago."""
    outs = []
    for _ in range(2):
        for prompt in prompts:
            outs += runner.run([prompt], GREEDY)
            runner.check_integrity()
    return outs


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_pool_with_host_tier_matches_an_unbounded_pool(page_size: int):
    prompts = _conversations()
    options = dict(attn_backend="torch", page_size=page_size)
    unbounded = RadixBatchRunner(fresh_model("llama"), max_total_tokens=1024, **options)
    tiered = RadixBatchRunner(fresh_model("llama"), max_total_tokens=56, host_cache_tokens=1024, **options)
    reference, outs = _revisit(unbounded, prompts), _revisit(tiered, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert tiered.stats.hit_rate == unbounded.stats.hit_rate > 0.3
    assert [o.cached_tokens for o in outs] == [o.cached_tokens for o in reference]
    second = outs[len(prompts) :]
    assert sum(o.host_cached_tokens > 0 for o in second) >= len(second) - 1  # the last may be on the GPU
    assert tiered.stats.host_cached_tokens == sum(o.host_cached_tokens for o in outs)
    stats = hf_radix.cache_stats(tiered.model)
    assert stats["host_cached_tokens"] == tiered.stats.host_cached_tokens
    assert stats["gpu_cached_tokens"] == stats["cached_tokens"] - stats["host_cached_tokens"]
    assert stats["host_restored_tokens"] >= stats["host_cached_tokens"] and stats["evicted_tokens"] > 0

    bare = RadixBatchRunner(fresh_model("llama"), max_total_tokens=56, **options)
    assert [o.token_ids for o in _revisit(bare, prompts)] == [o.token_ids for o in reference]
    assert bare.stats.hit_rate < tiered.stats.hit_rate


def test_generate_and_scoring_reach_the_host_tier():
    prompts = _conversations(count=4)
    model = fresh_model("llama")
    hf_radix.configure(model, max_total_tokens=64, host_cache_tokens=512, attn_backend="torch")
    reference = fresh_model("llama")
    hf_radix.configure(reference, max_total_tokens=1024, attn_backend="torch")

    def generate(m, prompt):
        ids = torch.tensor([prompt])
        return m.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="radix")

    for prompt in prompts:
        generate(model, prompt)
    before = hf_radix.cache_stats(model)
    assert torch.equal(generate(model, prompts[0]), generate(reference, prompts[0]))
    after = hf_radix.cache_stats(model)
    assert after["cached_tokens"] - before["cached_tokens"] == len(prompts[0]) - 1
    host = after["host_cached_tokens"] - before["host_cached_tokens"]
    assert host >= len(prompts[0]) - 1 - 6  # all but the shared system prompt, which may be on the GPU

    pairs = [(p, [5, 6, 7]) for p in prompts]
    runner = RadixBatchRunner(model)
    expected = RadixBatchRunner(reference).loglikelihood(pairs)
    scores = runner.loglikelihood(pairs)  # batched differently from the reference (the pool is small)
    assert [g for _, g in scores] == [g for _, g in expected]
    assert [s for s, _ in scores] == pytest.approx([s for s, _ in expected], abs=1e-4)
    assert runner.stats.host_cached_tokens > 0
    runner.check_integrity()


def test_options_are_validated():
    model = fresh_model("llama")
    with pytest.raises(ValueError, match="not both"):
        RadixBatchRunner(model, max_total_tokens=64, host_cache_tokens=64, host_cache_gb=1.0)
    with pytest.raises(ValueError, match="host_cache_tokens"):
        RadixBatchRunner(model, max_total_tokens=64, page_size=4, host_cache_tokens=3)
    runner = RadixBatchRunner(model, max_total_tokens=64, host_cache_gb=1e-4)
    per_token = runner.engine.pool.shape.bytes_per_token(torch.float32)
    assert runner.engine.host_tier.num_pages == int(1e5) // per_token


# ------------------------------------------------------------------------- manager-level (no model)
def _two_tier(
    gpu_pages: int, host_tokens: int, page_size: int = 1, chunk_pages: int = 3, v_head_dim: int | None = None
) -> CacheManager:
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=2, v_head_dim=v_head_dim)
    pool = KVPool(shape, gpu_pages, page_size, torch.float32, "cpu")
    manager = CacheManager(gpu_pages, page_size)
    tier = HostTier(pool, host_tokens, staging_pages=chunk_pages)  # copies go in several chunks
    tier.attach(manager)
    return manager


def _fingerprints(ids) -> np.ndarray:
    """A value per position that depends on the whole prefix up to it (what real K/V do)."""
    out, h = np.empty(len(ids), np.float32), 0
    for i, t in enumerate(ids):
        h = (h * 131 + int(t) + 1) % 1_000_003
        out[i] = h
    return out


def _write(manager: CacheManager, slots: np.ndarray, ids, start: int, end: int) -> None:
    pool = manager.host_tier.pool
    values = torch.from_numpy(_fingerprints(ids)[start:end])
    for layer in range(pool.shape.num_layers):
        pool.k_cache(layer)[torch.from_numpy(slots[start:end])] = (values + layer)[:, None, None]
        pool.v_cache(layer)[torch.from_numpy(slots[start:end])] = (-values - layer)[:, None, None]


def _check_data(manager: CacheManager, slots: np.ndarray, ids) -> None:
    pool, n = manager.host_tier.pool, len(slots)
    expected = torch.from_numpy(_fingerprints(ids)[:n])
    for layer in range(pool.shape.num_layers):
        assert torch.equal(pool.k_cache(layer)[torch.from_numpy(slots)][:, 0, 0], expected + layer)
        assert torch.equal(pool.v_cache(layer)[torch.from_numpy(slots)][:, 0, 0], -expected - layer)


def _serve(manager: CacheManager, ids: list[int], keep_open: bool = False) -> tuple[int, int] | None:
    """One request's lifecycle with fingerprints as K/V; checks what the match returned. Returns its row."""
    handle = manager.match(ids)
    _check_data(manager, handle.matched_indices(), ids)
    manager.lock(handle)
    if manager.pages_for(handle.cached_len, len(ids)) * manager.page_size > manager.available_size:
        manager.unlock(handle)
        return None
    row = manager.open_row(handle)
    manager.allocate([row], [len(ids)])
    _write(manager, manager.row_slots(row), ids, handle.cached_len, len(ids))
    if keep_open:
        manager.cache_req(row, ids, len(ids), finished=False)
        return row, handle.restored_len
    manager.cache_req(row, ids, len(ids), finished=True)
    return None


def _host_len(manager: CacheManager, ids) -> int:
    return manager.host_tier.tree.match_prefix(np.asarray(ids)).cached_len


@pytest.mark.parametrize("v_head_dim", [None, 3])
def test_host_tier_eviction_is_lru(v_head_dim):
    manager = _two_tier(gpu_pages=8, host_tokens=16, v_head_dim=v_head_dim)
    a, b, c, d = ([k] * 8 for k in (10, 20, 30, 40))
    for ids in (a, b, c):  # each evicts the previous one to the host tier
        _serve(manager, ids)
    assert _host_len(manager, a) == 8 and _host_len(manager, b) == 8  # host: a, b (a older)
    _serve(manager, a)  # copies a back (and evicts c to host, pushing out b, the LRU)
    manager.check_integrity()
    assert _host_len(manager, b) == 0 and _host_len(manager, c) == 8
    _serve(manager, d)  # evicts a to host: already there, so nothing is pushed out
    assert _host_len(manager, a) == 8 and _host_len(manager, c) == 8
    _serve(manager, b + [1])  # b was dropped: recomputed
    assert manager.host_tier.restored_tokens == 7
    manager.check_integrity()


def test_a_locked_prefix_survives_host_round_trips():
    manager = _two_tier(gpu_pages=12, host_tokens=24, page_size=2)
    held = [3] * 6
    row, _ = _serve(manager, held, keep_open=True)
    for k in range(5, 12):
        _serve(manager, [k] * 6)
        manager.check_integrity()
        _check_data(manager, manager.row_slots(row)[:6], held)
    manager.cache_req(row, held, 6, finished=True)
    manager.check_integrity()


_PREFIXES = [[7] * 5, [8, 9] * 3, [1, 2, 3]]
_TAILS = [[10, 11, 12, 13] * 2, [11] * 8, [12, 13, 10] * 3, [13, 12, 11, 10, 9, 8, 7, 6]]


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    gpu_tokens=st.integers(14, 40),
    host_tokens=st.integers(4, 80),
    ops=st.lists(
        st.tuples(
            st.integers(0, 2),  # op: 0 serve and finish, 1 serve and keep open, 2 finish an open one
            st.integers(0, len(_PREFIXES)),  # shared prefix (or none)
            st.integers(0, len(_TAILS) - 1),  # own tokens: few enough that requests revisit old prompts
            st.integers(1, 8),
        ),
        max_size=30,
    ),
)
def test_two_tier_property(page_size, gpu_tokens, host_tokens, ops):
    _run_ops(_two_tier(gpu_tokens // page_size, max(host_tokens, page_size), page_size), ops)


@pytest.mark.parametrize("page_size", [1, 2])
def test_two_tier_long_random_walk(page_size: int):
    rng = np.random.default_rng(page_size)
    ops = [
        (int(rng.choice(3, p=[0.6, 0.25, 0.15])), int(rng.integers(0, 4)), int(rng.integers(0, 4)),
         int(rng.integers(1, 9)))
        for _ in range(300)
    ]
    manager = _two_tier(24 // page_size, 40, page_size)
    _run_ops(manager, ops)
    tier = manager.host_tier
    assert tier.restored_tokens > 50 and tier.evicted_tokens > 0 and manager.evicted_tokens > 0


def _run_ops(manager: CacheManager, ops) -> None:
    """Serves `ops` (see the property test), checking both tiers and every held row after each."""
    page_size = manager.page_size
    open_rows: list[tuple[int, list[int]]] = []
    for op, prefix, tail, length in ops:
        ids = (_PREFIXES[prefix] if prefix < len(_PREFIXES) else []) + _TAILS[tail][:length]
        if op == 2:
            if open_rows:
                row, row_ids = open_rows.pop(0)
                manager.cache_req(row, row_ids, len(row_ids), finished=True)
        elif len(ids) > 1:
            opened = _serve(manager, ids, keep_open=op == 1)
            if opened is not None:
                open_rows.append((opened[0], ids))
        manager.check_integrity()
        for row, row_ids in open_rows:  # a locked prefix is never lost: its K/V stay where the row says
            _check_data(manager, manager.row_slots(row)[: len(row_ids)], row_ids)
        for _, row_ids in open_rows:
            handle = manager.match(row_ids + [0])
            assert handle.cached_len >= len(row_ids) - len(row_ids) % page_size
            _check_data(manager, handle.matched_indices(), row_ids)
    for row, row_ids in open_rows:
        manager.cache_req(row, row_ids, len(row_ids), finished=True)
    manager.check_integrity()
    assert manager.tree.size_info.protected_size == 0


def _populated_two_tier() -> CacheManager:
    manager = _two_tier(gpu_pages=3, host_tokens=16, page_size=2)
    for k in (10, 20, 30):
        _serve(manager, [k] * 6)  # each evicts the one before it to the host tier
    manager.check_integrity()
    assert manager.host_tier.tree.size_info.total_size == 12
    return manager


def _plant_double(tier: HostTier) -> None:
    tier._free[0] = tier.tree.slot_indices()[0]


def _plant_lock(tier: HostTier) -> None:
    tier.tree.lock(tier.tree.match_prefix(np.array([10] * 4)))


def _plant_stale_lru(tier: HostTier) -> None:
    tier.tree._heap.clear()  # the LRU order no longer knows an evictable leaf


def _plant_out_of_range(tier: HostTier) -> None:
    leaf = next(n for n in tier.tree.nodes() if not n.children)
    leaf.value = leaf.value + tier.num_pages * tier.page_size


@pytest.mark.parametrize(
    "plant,message",
    [
        (_plant_double, "free and held"),
        (lambda tier: setattr(tier, "_free", tier._free[1:]), "host page leak"),
        (_plant_lock, "locked between calls"),
        (_plant_stale_lru, "eviction heap"),
        (_plant_out_of_range, "out of range"),
    ],
    ids=["free-and-held", "leak", "lock", "lru", "range"],
)
def test_integrity_catches_a_broken_host_tier(plant, message):
    manager = _populated_two_tier()
    plant(manager.host_tier)
    with pytest.raises(IntegrityError, match=message):
        manager.check_integrity()  # the manager's check covers the host tier


def test_a_tier_built_under_inference_mode_serves_outside_it():
    prompts = _conversations(count=3)
    with torch.inference_mode():
        runner = RadixBatchRunner(fresh_model("llama"), max_total_tokens=56, host_cache_tokens=256,
                                  attn_backend="torch")
    outs = _revisit(runner, prompts)
    assert runner.engine.host_tier.restored_tokens > 0 and all(o.error is None for o in outs)
