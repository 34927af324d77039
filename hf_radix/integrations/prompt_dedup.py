"""Rows of a generate call whose prompt equals an earlier row's: the first step computes it once.

Such a row (a follower) opens on its own cached prefix but computes nothing on the first step: it reads
its leader's logits (`logits_rows`), and once the leader's prompt is in the tree the follower re-opens on
it and copies the unaligned tail of the leader's K/V (`reopen`). Prompts given as `inputs_embeds` are
never deduplicated (their ids are placeholders).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..scheduling.request import Req

if TYPE_CHECKING:
    from ..engine import RadixEngine
    from ..memory.cache_manager import CacheManager
    from ..memory.radix_tree import MatchHandle


def reopen_row(manager: CacheManager, req: Req, prompt: np.ndarray, key: np.ndarray) -> MatchHandle:
    """Closes `req`'s row (caching what it computed of `prompt`) and opens a new one on the tree's longest
    match of `key`, locked; returns that match."""
    row, req.row = req.row, None
    manager.cache_req(row, prompt, req.computed_len, finished=True)
    handle = manager.match(key)
    manager.lock(handle)
    req.row = manager.open_row(handle)
    return handle


class DuplicatePrompts:
    """The first step's followers (batch row -> its leader, an earlier row with the same prompt)."""

    def __init__(self) -> None:
        self.followers: dict[int, int] = {}
        self._first_row_of: dict[bytes, int] = {}

    def add(self, b: int, prompt: np.ndarray) -> bool:
        """Notes batch row `b`'s prompt; whether an earlier row has the same one (`b` then follows it)."""
        leader = self._first_row_of.setdefault(prompt.tobytes(), b)
        if leader != b:
            self.followers[b] = leader
        return leader != b

    def logits_rows(self, size: int, device: torch.device) -> torch.Tensor | None:
        """The packed logits row of each batch row when followers read their leaders' (None: identity)."""
        if not self.followers:
            return None
        leaders = [b for b in range(size) if b not in self.followers]
        position = {b: i for i, b in enumerate(leaders)}
        return torch.tensor([position[self.followers.get(b, b)] for b in range(size)], device=device)

    def reopen(self, engine: RadixEngine, reqs: list[Req], tokens: list[np.ndarray]) -> None:
        """After the first step (the leaders' prompts are in the tree): each follower re-opens on its
        leader's cached prompt and copies the unaligned tail; then there are no followers."""
        manager = engine.manager
        for b, leader in self.followers.items():
            req, prompt = reqs[b], tokens[b]
            handle = reopen_row(manager, req, prompt, np.append(prompt, 0))
            manager.allocate([req.row], [len(prompt)])
            end = len(prompt)
            src = manager.row_slots(reqs[leader].row)[handle.cached_len : end].astype(np.int64)
            dst = manager.row_slots(req.row)[handle.cached_len : end].astype(np.int64)
            engine.pool.copy_slots(src, dst)
            if manager.state_slots is not None:  # a hybrid model: the leader's state after the prompt
                leader_state = manager.row_state_slot(reqs[leader].row)
                manager.state_slots.pool.copy_slot(leader_state, manager.row_state_slot(req.row))
            req.computed_len = req.cached_len = end
            manager.cache_req(req.row, prompt, end, finished=False)
        self.followers.clear()
        self._first_row_of.clear()
