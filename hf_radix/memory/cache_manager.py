"""Free pages, per-request page-table rows, and the radix tree bookkeeping that ties them together."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .page_table import PageTable
from .radix_tree import IntegrityError, MatchHandle, RadixPrefixCache


class LowerTier(Protocol):
    """A cache behind the GPU tree that a match may extend (the host tier, `host_tier.HostTier`)."""

    tree: RadixPrefixCache

    def extend_match(self, ids: np.ndarray, handle: MatchHandle) -> MatchHandle: ...

    def reset(self) -> None: ...

    def check_integrity(self) -> None: ...


class OutOfPagesError(RuntimeError):
    """Raised when an allocation cannot be satisfied even after evicting everything evictable."""


@dataclass
class _Row:
    """A running request's page-table row: the lock on its cached prefix (the tree node it reads)."""

    handle: MatchHandle


class CacheManager:
    """Owns the free-page list, the request table and the prefix tree; enforces the request lifecycle.

    Lifecycle per request: `match` → `lock` → `open_row` → `allocate` (evicts on shortfall) → forward →
    `cache_req(finished=False)` after prefill → … → `cache_req(finished=True)` (finish or abort alike).
    A row's slots live in the page table (`table`, host and device), written once when allocated; the
    slots a row owns are those past `handle.cached_len`; the prefix before that belongs to the tree.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int = 1,
        *,
        device: torch.device | str = "cpu",
        scratch_slot: int | None = None,
        row_tokens: int | None = None,
    ):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.tree = RadixPrefixCache(page_size)
        self.page_size = page_size
        self.num_pages = num_pages
        scratch = num_pages * page_size if scratch_slot is None else scratch_slot
        # a row never outgrows the pool; the table starts as wide as `row_tokens` (the model's context)
        width = None if row_tokens is None else -(-row_tokens // page_size) * page_size
        self.table = PageTable(num_pages * page_size, device, scratch, width)
        self._free = np.arange(num_pages, dtype=np.int64) * page_size  # first slot of each free page
        self._rows: dict[int, _Row] = {}
        # per table row: positions with a slot (a multiple of the page size); -1 for a row not open
        self._allocated = np.full(self.table.capacity, -1, dtype=np.int64)
        self._lazy_frees: list[np.ndarray] | None = None
        self.evicted_tokens = 0
        self.lock_version = 0  # bumped whenever a row's lock changes (opened, moved, closed)
        self.host_tier: LowerTier | None = None  # set by HostTier.attach: keeps evicted pages in host memory

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def available_size(self) -> int:
        """Tokens that can be allocated now: free pages plus what eviction could reclaim."""
        return len(self._free) * self.page_size + self.tree.size_info.evictable_size

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def pages_for(self, start: int, end: int) -> int:
        """Pages a row needs to grow its allocation from `start` to `end` tokens (page-aligned start)."""
        return max(0, -(-end // self.page_size) - -(-start // self.page_size))

    # -- matching and locking ------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int] | np.ndarray) -> MatchHandle:
        """Longest cached prefix of `token_ids[:-1]`: the last token is always recomputed for its logits.

        With a host tier, a longer prefix held there is copied back into fresh pages first (asynchronously).
        """
        ids = np.asarray(token_ids)[: max(len(token_ids) - 1, 0)]
        handle = self.tree.match_prefix(ids)
        if self.host_tier is not None:
            handle = self.host_tier.extend_match(ids, handle)
        return handle

    def gpu_cached_len(self, token_ids: Sequence[int] | np.ndarray) -> int:
        """What `match` would find on the GPU alone: an estimate for ordering, copying nothing back."""
        return self.tree.match_prefix(np.asarray(token_ids)[: max(len(token_ids) - 1, 0)]).cached_len

    def lock(self, handle: MatchHandle) -> None:
        self.tree.lock(handle)

    def unlock(self, handle: MatchHandle) -> None:
        self.tree.unlock(handle)

    # -- request rows --------------------------------------------------------------------------------
    def open_row(self, handle: MatchHandle) -> int:
        """Creates a page-table row for a request whose locked `handle` covers its cached prefix."""
        if not handle.locked:
            raise ValueError("open_row needs a locked handle; lock it first so the prefix cannot be evicted")
        row = self.table.open()
        if row >= len(self._allocated):
            self._allocated = np.concatenate(
                [self._allocated, np.full(self.table.capacity - len(self._allocated), -1, dtype=np.int64)]
            )
        self._rows[row] = _Row(handle)
        self.lock_version += 1
        self._allocated[row] = handle.cached_len
        self.table.write_row(row, 0, handle.matched_indices())
        return row

    def reserve_rows(self, rows: int) -> None:
        """Sizes the page table for `rows` running requests now (a warm-up), not during a run."""
        self.table.reserve(rows)
        grow = self.table.capacity - len(self._allocated)
        if grow > 0:
            self._allocated = np.concatenate([self._allocated, np.full(grow, -1, dtype=np.int64)])

    def row_slots(self, row: int) -> np.ndarray:
        """Slot indices of the row's allocated positions (a view of the host table; do not modify)."""
        return self.table.host[row, : self.row_len(row)]

    def row_len(self, row: int) -> int:
        """Positions of the row with a slot."""
        if row not in self._rows:
            raise KeyError(f"page-table row {row} is not open")
        return int(self._allocated[row])

    def row_handle(self, row: int) -> MatchHandle:
        """The lock on the row's cached prefix: its tree node and length."""
        return self._rows[row].handle

    def row_cached_len(self, row: int) -> int:
        """Length of the row's prefix held (and locked) in the tree."""
        return self._rows[row].handle.cached_len

    def allocate(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """Grows each row's allocation to cover `lengths[i]` tokens, evicting from the tree once if needed.

        Only the new slots are written (host and device page table); nothing is re-concatenated.
        """
        if len(rows) == 0:
            return
        rows = np.asarray(rows, dtype=np.int64)
        current = self._allocated[rows]  # page-aligned
        if current.min() < 0:
            raise KeyError(f"page-table row {int(rows[np.argmin(current)])} is not open")
        ps = self.page_size
        lengths = np.asarray(lengths, dtype=np.int64)
        target = lengths if ps == 1 else -(-lengths // ps) * ps
        counts = target - current
        grow = counts > 0
        if not grow.all():
            rows, current, counts, target = rows[grow], current[grow], counts[grow], target[grow]
            if len(rows) == 0:
                return
        widest = int(target.max())
        if widest > self.table.max_width:
            raise ValueError(
                f"a request needs {widest} positions; the page table holds {self.table.max_width} "
                "(the KV pool)"
            )
        total = int(counts.sum()) // ps
        pages = self._take_pages(total)
        if ps == 1 and len(rows) == total:  # one new slot per row (a decode step)
            self.table.write(rows, current, pages, widest)
        elif len(rows) == 1:  # one row (a prompt): its positions in order
            slots = pages if ps == 1 else (pages[:, None] + np.arange(ps, dtype=np.int64)).reshape(-1)
            positions = np.arange(current[0], target[0], dtype=np.int64)
            self.table.write(np.full(len(slots), rows[0], dtype=np.int64), positions, slots, widest)
        else:
            slots = (pages[:, None] + np.arange(ps, dtype=np.int64)).reshape(-1)
            starts = np.repeat(np.cumsum(counts) - counts, counts)
            positions = np.arange(len(slots), dtype=np.int64) - starts + np.repeat(current, counts)
            self.table.write(np.repeat(rows, counts), positions, slots, widest)
        self._allocated[rows] = target

    def cache_req(
        self, row: int, token_ids: Sequence[int] | np.ndarray, num_computed: int, *, finished: bool
    ) -> int:
        """Inserts the row's first `num_computed` tokens into the tree and moves the lock to the new node.

        Frees the pages the tree already held (duplicates computed concurrently) exactly once; when
        `finished` (finish, abort or error alike: the one exit of a request), also frees the unaligned tail
        and every other page the row owns, and closes the row. Returns the length now held by the tree.
        """
        state = self._rows[row]
        allocated = int(self._allocated[row])
        if not state.handle.cached_len <= num_computed <= min(allocated, len(token_ids)):
            raise ValueError(
                f"num_computed={num_computed} must lie between the cached prefix ({state.handle.cached_len}) "
                f"and the row's tokens/allocation ({min(allocated, len(token_ids))})"
            )
        slots = self.row_slots(row)
        aligned = num_computed - num_computed % self.page_size
        old = state.handle
        if aligned == old.cached_len:  # the tree holds all of it already (the row's locked prefix)
            present, new = aligned, MatchHandle(self.tree, aligned, old.node)
        else:
            keys = np.asarray(token_ids[:aligned])
            present, new = self.tree.insert_prefix(keys, slots[:aligned].astype(np.int64))
        self.tree.unlock(old)
        self.lock_version += 1
        self._release(slots[old.cached_len : present])
        if finished:
            self._release(slots[aligned:])
            del self._rows[row]
            self._allocated[row] = -1
            self.table.close(row)
        else:
            self.tree.lock(new)
            state.handle = new
            if present > old.cached_len:  # the row now reads the tree's copy of what it duplicated
                self.table.write_row(row, old.cached_len, new.matched_indices()[old.cached_len : present])
        return new.cached_len

    # -- pages ---------------------------------------------------------------------------------------
    def _take_pages(self, count: int) -> np.ndarray:
        if count > len(self._free):
            shortfall = (count - len(self._free)) * self.page_size
            if shortfall > self.tree.size_info.evictable_size:
                raise OutOfPagesError(
                    f"need {count} pages, {len(self._free)} free and "
                    f"{self.tree.size_info.evictable_size // self.page_size} evictable"
                )
            evicted = self.tree.evict(shortfall)
            self.evicted_tokens += len(evicted)
            self._free = np.concatenate([self._free, evicted[:: self.page_size]])
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def _release(self, slots: np.ndarray) -> None:
        """Returns the pages starting in `slots` (page-aligned, whole pages) to the free list."""
        if len(slots) == 0:
            return
        firsts = slots[:: self.page_size].astype(np.int64)
        if self._lazy_frees is not None:
            self._lazy_frees.append(firsts)
        else:
            self._free = np.concatenate([self._free, firsts])

    @contextlib.contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """Batches frees made inside the block into one update of the free list at exit."""
        if self._lazy_frees is not None:
            yield
            return
        self._lazy_frees = []
        try:
            yield
        finally:
            pending, self._lazy_frees = self._lazy_frees, None
            if pending:
                self._free = np.concatenate([self._free, *pending])

    # -- tier hooks (cache_io, host_tier): pages handed to the tree outside a request ---------------
    def take_pages(self, count: int) -> np.ndarray:
        """First slots of `count` pages taken off the free list, evicting LRU prefixes on shortfall."""
        return self._take_pages(count)

    def release_pages(self, slots: np.ndarray) -> None:
        """Returns whole pages (given by all their slots, page-aligned) to the free list."""
        self._release(np.asarray(slots, dtype=np.int64))

    # -- maintenance ---------------------------------------------------------------------------------
    def set_namespace(self, namespace) -> None:
        """Matches and inserts of both tiers from now on use `namespace`'s tree (an adapter set's)."""
        self.tree.namespace = namespace
        if self.host_tier is not None:
            self.host_tier.tree.namespace = namespace

    def reset(self) -> None:
        """Drops the whole prefix cache (both tiers); only allowed when no request holds a row."""
        if self._rows:
            raise RuntimeError(f"cannot reset the cache while {len(self._rows)} requests are running")
        self.tree.reset()
        if self.host_tier is not None:
            self.host_tier.reset()
        self._free = np.arange(self.num_pages, dtype=np.int64) * self.page_size

    def check_integrity(self) -> None:
        """Raises IntegrityError unless the pages, the rows and the tree agree exactly.

        Every managed page (0..num_pages-1, never the scratch page past them) is in exactly one place:
        free, held by the tree, or owned by a running request; each tree node's ref count equals the
        number of live rows whose locked prefix covers it; each row's cached prefix matches the tree.
        """
        if self.host_tier is not None:
            self.host_tier.check_integrity()
        if self._lazy_frees is not None:
            raise IntegrityError("check_integrity called inside a lazy_free_region")
        for state in self._rows.values():
            if not state.handle.locked:
                raise IntegrityError("a running request's prefix is not locked")
        if set(np.flatnonzero(self._allocated >= 0).tolist()) != set(self._rows):
            raise IntegrityError("the allocated lengths name other rows than the open ones")
        self.tree.check_integrity(locks=[state.handle for state in self._rows.values()])
        ps = self.page_size
        limit = self.num_pages * ps  # the scratch page (first slot `limit`) is never managed
        rows = {row: self.row_slots(row).astype(np.int64) for row in self._rows}
        owned = [rows[row][state.handle.cached_len :] for row, state in self._rows.items()]
        tree_slots = self.tree.slot_indices()
        for what, slots in (("free", self._free), ("cached", tree_slots), *(("owned", s) for s in owned)):
            bad = slots[(slots < 0) | (slots >= limit)]
            if len(bad):
                raise IntegrityError(
                    f"a {what} page index is out of range: slot {int(bad[0])} not in [0, {limit})"
                    + (" (the scratch page)" if int(bad[0]) // ps == self.num_pages else "")
                )
        firsts = np.concatenate([self._free, *(s[::ps] for s in owned), tree_slots[::ps]])
        if ps > 1 and np.any(firsts % ps):
            raise IntegrityError("a free, owned or cached page does not start at a page boundary")
        if len(np.unique(firsts)) != len(firsts):
            raise IntegrityError("a page is in two places at once (free, cached or owned by a request)")
        if len(firsts) != self.num_pages:
            missing = np.setdiff1d(np.arange(self.num_pages) * ps, firsts)
            raise IntegrityError(
                f"page leak: free {len(self._free)} + tree {len(tree_slots[::ps])} + running "
                f"{sum(len(s[::ps]) for s in owned)} != total {self.num_pages}; first missing page "
                f"{int(missing[0]) // ps if len(missing) else '?'}"
            )
        for row, state in self._rows.items():
            if not np.array_equal(rows[row][: state.handle.cached_len], state.handle.matched_indices()):
                raise IntegrityError("a running request's page-table row disagrees with the tree")
        self._check_page_table()

    def _check_page_table(self) -> None:
        """The device page table equals the host one on every running row; the padding row is intact."""
        problem = self.table.check({row: int(self._allocated[row]) for row in self._rows})
        if problem is not None:
            raise IntegrityError(problem)
