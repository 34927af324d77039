"""The cache-aware pending queue: prefix families stay together, cached and heavy groups go first."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_radix.memory.radix_tree import RadixPrefixCache
from hf_radix.scheduling.schedule_policy import BLOCK, WINDOW, PrefixAwareQueue, trie_keys


@dataclass(eq=False)
class _Req:
    ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.ids

    @property
    def match_ids(self) -> np.ndarray:
        return np.asarray(self.ids, dtype=np.int64)


def _prefix(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 1000, n).tolist()


def _drain(queue: PrefixAwareQueue) -> list[_Req]:
    return [queue.popleft() for _ in range(len(queue))]


def _tree_with(*prompts: list[int]) -> RadixPrefixCache:
    tree = RadixPrefixCache(page_size=1)
    for p in prompts:
        tree.insert_prefix(p, np.arange(len(p)))
    return tree


def test_prefix_families_are_served_together_heaviest_first():
    families = {seed: _prefix(seed, 2 * BLOCK + 5) for seed in range(3)}
    sizes = {0: 2, 1: 5, 2: 3}
    reqs = [
        _Req(families[f] + [i, 7]) for i in range(5) for f in families if i < sizes[f]
    ]  # families interleaved in input order
    served = _drain(PrefixAwareQueue(reqs, lambda ids: 0, lambda: 0))
    family_of = [next(f for f, p in families.items() if r.ids[: len(p)] == p) for r in served]
    assert family_of == [1] * 5 + [2] * 3 + [0] * 2
    assert sorted(map(id, served)) == sorted(map(id, reqs))


def test_a_group_cached_in_the_tree_goes_first_and_eviction_reevaluates():
    cold, warm = _prefix(10, 3 * BLOCK), _prefix(11, 3 * BLOCK)
    reqs = [_Req(cold + [i]) for i in range(4)] + [_Req(warm + [i]) for i in range(2)]
    tree = _tree_with(warm)
    evictions = [0]
    queue = PrefixAwareQueue(reqs, lambda ids: tree.match_prefix(ids).cached_len, lambda: evictions[0])
    assert queue[0].ids[: len(warm)] == warm  # cached now beats heavier
    queue.popleft()
    tree = _tree_with(cold)  # the tree changed: warm's prefix was evicted, cold's got computed
    evictions[0] += 1
    assert queue[0].ids[: len(cold)] == cold
    rest = _drain(queue)
    assert [r.ids[: len(cold)] == cold for r in rest] == [True] * 4 + [False]


def test_groups_beyond_the_window_wait_their_turn():
    groups = [_prefix(100 + g, BLOCK) for g in range(WINDOW + 4)]
    reqs = [_Req(p + [1]) for p in groups]
    last = _drain(PrefixAwareQueue(reqs, lambda ids: 0, lambda: 0))[-1]  # last in trie order
    tree = _tree_with(last.ids)
    queue = PrefixAwareQueue(reqs, lambda ids: tree.match_prefix(ids).cached_len, lambda: 0)
    order = _drain(queue)
    assert order.index(last) == 4  # visible once it enters the window, then first
    assert len(order) == len(reqs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3 * BLOCK)), min_size=1, max_size=30), st.data())
def test_queue_behaves_like_a_deque_of_every_request_once(shapes, data):
    reqs = [_Req(_prefix(f, BLOCK + 3)[: n % (BLOCK + 3) + 1] + [n]) for f, n in shapes]
    queue = PrefixAwareQueue(reqs, lambda ids: int(ids[0]) % 3, lambda: 0)
    served, held = [], deque()
    while queue:
        assert len(queue) == len(reqs) - len(served) - len(held)
        head = queue[0]
        assert queue.popleft() is head
        if data.draw(st.booleans()) and len(held) < 3:
            held.append(head)
        else:
            served.append(head)
        if held and data.draw(st.booleans()):
            queue.extendleft(reversed(held))
            front = list(held)
            held.clear()
            assert [queue.popleft() for _ in front] == front
            served.extend(front)
    queue.extendleft(reversed(held))
    served.extend(_drain(queue))
    assert sorted(map(id, served)) == sorted(map(id, reqs))
    queue.extendleft([reqs[0]])
    queue.clear()
    assert not queue and len(queue) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, BLOCK + 5)), min_size=1,
                max_size=40))
def test_trie_keys_keep_every_shared_block_prefix_together(shapes):
    """Sorted by key bytes, the prompts sharing any whole-block prefix are contiguous; equal prompts are equal
    keys (and keep input order); prompts differing anywhere in their first blocks or tail get other keys."""
    prompts = [
        np.array(_prefix(a, BLOCK) + _prefix(10 + b, BLOCK)[: (b * 29) % BLOCK + 1] + list(range(n)))
        for a, b, n in shapes
    ]
    keys = trie_keys(prompts)
    order = np.argsort(keys.view(np.dtype((np.void, keys.shape[1] * 8))).ravel(), kind="stable").tolist()
    for blocks in (1, 2):
        size = blocks * BLOCK
        prefixes = [prompts[i][:size].tobytes() for i in order if len(prompts[i]) >= size]
        runs = [p for j, p in enumerate(prefixes) if j == 0 or p != prefixes[j - 1]]
        assert len(runs) == len(set(runs))  # each prefix forms one run
    for i in range(len(prompts)):
        for j in range(len(prompts)):
            same = np.array_equal(prompts[i], prompts[j])
            assert np.array_equal(keys[i], keys[j]) == same
            if same and i < j:
                assert order.index(i) < order.index(j)


def test_equal_prompts_are_served_in_queue_order():
    context = _prefix(3, 3 * BLOCK + 7)
    other = _Req(_prefix(4, 2 * BLOCK))
    reqs = [_Req(context) for _ in range(4)] + [other] + [_Req(context) for _ in range(2)]
    served = _drain(PrefixAwareQueue(reqs, lambda ids: 0, lambda: 0))
    assert served == [*reqs[:4], *reqs[5:], other]  # the heavier group first, each in input order


def test_an_eviction_matches_again_only_the_current_group_and_those_with_a_cached_prefix():
    warm, cold, current = _prefix(20, 2 * BLOCK), _prefix(21, 2 * BLOCK), _prefix(22, 2 * BLOCK)
    reqs = [_Req(current + [i]) for i in range(5)] + [_Req(warm + [1]), _Req(cold + [1])]
    tree = _tree_with(current, warm)
    matched, evictions = [], [0]

    def cached_len(ids):
        matched.append(bytes(np.asarray(ids[:BLOCK], dtype=np.int64)))
        return tree.match_prefix(ids).cached_len

    queue = PrefixAwareQueue(reqs, cached_len, lambda: evictions[0])
    assert queue.popleft() is reqs[0]  # cached as long as warm, and heavier
    assert len(matched) == 3
    matched.clear()
    evictions[0] += 1
    assert queue.popleft() is reqs[1]
    key = {bytes(np.asarray(p[:BLOCK], dtype=np.int64)): name for p, name in
           ((warm, "warm"), (cold, "cold"), (current, "current"))}
    assert sorted(key[m] for m in matched) == ["current", "warm"]  # cold had nothing to lose
    rest = _drain(queue)
    assert rest == reqs[2:5] + reqs[5:]
