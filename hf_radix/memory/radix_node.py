"""The radix tree's parts: its nodes, the handles that matches return, its sizes and its error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["IntegrityError", "MatchHandle", "RadixNode", "SizeInfo", "as_int_array"]


class IntegrityError(RuntimeError):
    """Raised by `RadixPrefixCache.check_integrity` when the tree's bookkeeping is inconsistent."""


@dataclass(frozen=True)
class SizeInfo:
    """Token counts held by the tree, split by whether any lock protects them."""

    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class RadixNode:
    """One path-compressed segment: `key` token ids and the slot indices (`value`) holding their KV.

    `state_slot`: in a tree of a model with state layers, the `StatePool` slot holding the layers' state
    after the segment's last token (a snapshot), or None.
    """

    __slots__ = (
        "key", "value", "parent", "children", "ref_count", "last_access", "_queued_tick", "state_slot"
    )

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: RadixNode | None, ref_count: int,
                 last_access: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[Any, RadixNode] = {}
        self.ref_count = ref_count
        self.last_access = last_access
        self._queued_tick = -1  # last_access value for which an eviction-heap entry was pushed
        self.state_slot: int | None = None

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, ref_count={self.ref_count}, last_access={self.last_access})"


class PathSource(Protocol):
    """The tree a handle came from: the slot values along a node's path."""

    def path_values(self, node: RadixNode) -> list[np.ndarray]: ...


class MatchHandle:
    """Result of a match/insert: the matched length and the deepest node of the matched path."""

    __slots__ = ("cached_len", "node", "locked", "restored_len", "_cache")

    def __init__(self, cache: PathSource, cached_len: int, node: RadixNode) -> None:
        self._cache = cache
        self.cached_len = cached_len
        self.node = node
        self.locked = False
        self.restored_len = 0  # tokens of cached_len a host tier copied back for this match

    def matched_indices(self) -> np.ndarray:
        """Int64 slot indices of the matched prefix, in sequence order; ValueError if the node was evicted."""
        parts = self._cache.path_values(self.node)
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(parts[::-1])

    @property
    def state_slot(self) -> int | None:
        """The snapshot to restore the state layers from (the state after `cached_len` tokens), or None."""
        return self.node.state_slot

    def __repr__(self) -> str:
        return f"MatchHandle(cached_len={self.cached_len}, locked={self.locked})"


def as_int_array(x: Any, what: str) -> np.ndarray:
    """Converts a 1-D int sequence (list, ndarray, CPU torch tensor) to a contiguous int64 array."""
    if type(x) is np.ndarray and x.dtype == np.int64 and x.ndim == 1 and x.flags.c_contiguous:
        return x  # what the scheduler passes: no conversion, no checks to make
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)
