"""Cache-aware routing of prompts over data-parallel replicas (the sgl-model-gateway `cache_aware` idea).

The router keeps, per replica, an approximate radix tree of the token ids it has sent there: the prefixes
that replica holds, or will compute in the current call. A prompt goes to the replica whose tree matches
most of it when that match is a large enough share of the prompt, else to the replica with the least
work. Work is counted in tokens: the uncached part of the prompt plus the tokens it may generate. Since
a call is a whole batch, balance is judged against the call's fair share (its work with every shared
prefix computed once, over the replicas): a replica that would pass `balance_rel_threshold` times its
share plus `balance_abs_threshold` tokens gets no more prompts, so a prefix too hot for one replica
spills to the least-loaded one. Trees are LRU-trimmed to each replica's pool size, as the replica's own
cache would be.

Routing is a pure function of the router's state and its inputs (no clocks, no randomness), so every
rank of a data-parallel group computes the same assignment from the same prompts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from ..memory.radix_tree import RadixPrefixCache


class CacheAwareRouter:
    """Assigns each prompt to one of `num_replicas` replicas, by shared prefix and balanced by tokens.

    `capacity_tokens[r]` bounds replica r's approximate tree (its KV pool size; None: unbounded).
    `cache_threshold` is the share of a prompt a replica must already hold to attract it; a replica stops
    attracting prompts once its work in the call would pass `balance_rel_threshold * fair_share +
    balance_abs_threshold` tokens.
    """

    def __init__(
        self,
        num_replicas: int,
        capacity_tokens: Sequence[int | None] | None = None,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 2048,
        balance_rel_threshold: float = 1.1,
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        capacity = list(capacity_tokens) if capacity_tokens is not None else [None] * num_replicas
        if len(capacity) != num_replicas:
            raise ValueError(f"got {len(capacity)} capacities for {num_replicas} replicas")
        self.num_replicas = num_replicas
        self.capacity_tokens = capacity
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trees = [RadixPrefixCache(page_size=1) for _ in range(num_replicas)]
        self._slots = itertools.count()  # the trees need distinct values; they index nothing

    def reset(self) -> None:
        """Forgets every prefix (call when the replicas' caches are reset)."""
        for tree in self.trees:
            tree.reset()

    def route(
        self, token_lists: Sequence[Sequence[int]], new_tokens: Sequence[int] | None = None
    ) -> list[int]:
        """The replica of each prompt, in input order; `new_tokens[i]`: tokens prompt i may generate."""
        extra = [0] * len(token_lists) if new_tokens is None else list(new_tokens)
        if len(extra) != len(token_lists):
            raise ValueError(f"got {len(extra)} new-token counts for {len(token_lists)} prompts")
        prompts = [np.asarray(ids, dtype=np.int64) for ids in token_lists]
        limit = self.balance_rel_threshold * _work(prompts, extra) / self.num_replicas
        limit += self.balance_abs_threshold
        load = [0] * self.num_replicas
        out = []
        for ids, new in zip(prompts, extra):
            matched = [tree.match_prefix(ids).cached_len for tree in self.trees]
            cost = [len(ids) - m + new for m in matched]
            least_loaded = min(range(self.num_replicas), key=lambda r: (load[r], self._size(r), r))
            best = min(range(self.num_replicas), key=lambda r: (-matched[r], load[r], r))
            attracts = matched[best] > 0 and matched[best] >= self.cache_threshold * len(ids)
            replica = best if attracts and load[best] + cost[best] <= limit else least_loaded
            load[replica] += cost[replica]
            self._insert(replica, ids)
            out.append(replica)
        return out

    def _size(self, replica: int) -> int:
        return self.trees[replica].size_info.total_size

    def _insert(self, replica: int, ids: np.ndarray) -> None:
        if not len(ids):
            return
        tree = self.trees[replica]
        tree.insert_prefix(ids, np.fromiter(itertools.islice(self._slots, len(ids)), np.int64, len(ids)))
        capacity = self.capacity_tokens[replica]
        excess = tree.size_info.total_size - capacity if capacity is not None else 0
        if excess > 0:
            tree.evict(excess)


def _work(prompts: list[np.ndarray], new_tokens: list[int]) -> int:
    """Tokens one replica would compute for the whole call: each shared prefix once, plus generation."""
    seen = RadixPrefixCache(page_size=1)
    total = sum(new_tokens)
    for ids in prompts:
        if len(ids):
            cached, _ = seen.insert_prefix(ids, np.zeros(len(ids), dtype=np.int64))
            total += len(ids) - cached
    return total
