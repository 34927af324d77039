"""Cache-aware order of pending prompts: prefix groups served by what the radix tree holds now.

Pending requests are kept in depth-first order of their prompts' trie (over the tokens a prefix match may
cover), so batch-mates share prefixes and a prefix one of them computes is reused by the next ones. The
trie is keyed by blocks of `BLOCK` tokens: each prompt is one row of int64 block hashes (the first
`KEY_BLOCKS` whole blocks, then one hash of the next, partial, block), all rows sorted at once by their
bytes; no Python object per token or block, so 50K prompts are ordered in a fraction of a second.
Prompts sharing their first block (a prompt shorter than a block: all of it) form a group; whenever the
current group is used up, the next group is chosen among the first `WINDOW` waiting ones by the cached
length of its head prompt in the tree (longest first, like SGLang's "lpm"), then by how many prompts
share it (heaviest first, like "dfs-weight"), then queue order. A group's cached length is matched once
and kept: serving other groups inserts prefixes it does not share (they differ in the first block), so
only an eviction makes the queue match again: the current group (it has been computing its prefix) and
the waiting ones that had a prefix cached (an eviction cannot give one to a group that had none). Matches
are thus about one per group plus a few per eviction seen, and the order keeps up with the tree at a
bounded cost: no re-sort, no pass over the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

BLOCK = 64
KEY_BLOCKS = 128  # prompts equal over this many blocks (8K tokens) and the next one keep queue order
WINDOW = 16

# odd multipliers: blocks differing in one token always hash apart (int64 products wrap around)
_BLOCK_WEIGHTS = np.random.default_rng(0).integers(0, 1 << 62, BLOCK, dtype=np.int64) * 2 + 1


class _Queued(Protocol):
    @property
    def match_ids(self) -> np.ndarray: ...


def trie_keys(prompts: Sequence[np.ndarray]) -> np.ndarray:
    """`[len(prompts), blocks + 1]` int64 sort keys: a hash per whole block, then one of the partial block
    (tokens + 1, so a trailing token 0 still counts), zeros after; sorting rows by bytes gives trie order.

    A prompt equal to the one before it (the choices of one question) copies its row instead."""
    lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    blocks = np.minimum(lengths // BLOCK, KEY_BLOCKS)
    keys = np.zeros((len(prompts), int(blocks.max(initial=0)) + 1), dtype=np.int64)
    sizes = lengths.tolist()
    for row, (ids, count) in enumerate(zip(prompts, blocks.tolist())):
        if row and sizes[row] == sizes[row - 1] and ids.tobytes() == prompts[row - 1].tobytes():  # a memcmp
            keys[row] = keys[row - 1]
            continue
        whole = count * BLOCK
        np.matmul(ids[:whole].reshape(count, BLOCK), _BLOCK_WEIGHTS, out=keys[row, :count])
        tail = ids[whole : whole + BLOCK] + 1
        keys[row, count] = np.matmul(tail, _BLOCK_WEIGHTS[: len(tail)])
    return keys


@dataclass
class _Group:
    """Pending requests sharing their first block, in trie order; its head's cached length once matched."""

    key: int | None
    reqs: deque = field(default_factory=deque)
    cached_len: int | None = None


class PrefixAwareQueue:
    """The scheduler's pending queue (`[0]`, `popleft`, `extendleft`, `clear`, `len`, iteration), in
    cache-aware order.

    `cached_len(ids)` is the length of `ids`' prefix in the tree now; `evictions()` any counter that
    changes when the tree evicts.
    """

    def __init__(
        self,
        reqs: Iterable[_Queued],
        cached_len: Callable[[np.ndarray], int],
        evictions: Callable[[], int],
    ):
        reqs = list(reqs)
        self._groups: deque[_Group] = deque()
        if reqs:
            keys = trie_keys([np.asarray(r.match_ids, dtype=np.int64) for r in reqs])
            order = np.argsort(keys.view(np.dtype((np.void, keys.shape[1] * 8))).ravel(), kind="stable")
            heads = keys[order, 0]
            bounds = np.flatnonzero(heads[1:] != heads[:-1]) + 1
            for start, end in zip([0, *bounds.tolist()], [*bounds.tolist(), len(reqs)]):
                members = deque(map(reqs.__getitem__, order[start:end].tolist()))
                self._groups.append(_Group(int(heads[start]), members))
        self._current = _Group(None)
        self._cached_len = cached_len
        self._evictions = evictions
        self._seen_evictions = evictions()
        self._size = len(reqs)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator:
        """Every pending request: the group being served, then the others (which are served in the order
        `_choose` picks them when they are reached)."""
        yield from self._current.reqs
        for group in self._groups:
            yield from group.reqs

    def __getitem__(self, index: int):
        if index != 0:
            raise IndexError("only the head of the pending queue can be read")
        if not self._current.reqs or self._evictions() != self._seen_evictions:
            self._choose()
        return self._current.reqs[0]

    def popleft(self):
        if not self._current.reqs or self._evictions() != self._seen_evictions:
            self._choose()
        self._size -= 1
        return self._current.reqs.popleft()

    def extendleft(self, reqs: Iterable[_Queued]) -> None:
        """Puts `reqs` back at the front (the last one given first, as `deque.extendleft`)."""
        reqs = list(reqs)
        self._current.reqs.extendleft(reqs)
        self._size += len(reqs)

    def clear(self) -> None:
        self._groups.clear()
        self._current = _Group(None)
        self._size = 0

    def _choose(self) -> None:
        """Picks the group to serve next when the current one is used up or the tree has evicted."""
        evictions = self._evictions()
        evicted = evictions != self._seen_evictions
        if self._current.reqs and not evicted:
            return
        self._seen_evictions = evictions
        if self._current.reqs:
            self._current.cached_len = None  # it has been computing its prefix: match it again
            self._groups.appendleft(self._current)
        if not self._groups:
            raise IndexError("the pending queue is empty")
        window = [self._groups[i] for i in range(min(WINDOW, len(self._groups)))]
        for group in window:
            # an eviction only shortens cached prefixes: a group with none cached keeps none
            if group.cached_len is None or evicted and group.cached_len:
                group.cached_len = self._cached_len(group.reqs[0].match_ids)
        scores = [(group.cached_len, len(group.reqs), -i) for i, group in enumerate(window)]
        best = scores.index(max(scores))
        self._current = window[best]
        del self._groups[best]
