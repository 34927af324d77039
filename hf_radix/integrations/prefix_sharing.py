"""Rows of one generate call whose prompts share a prefix the cache does not hold: computed once.

Before the call's first step, the rows are taken in the byte order of their prompts, where each row shares
the most with its neighbours. Neighbours sharing at least `MIN_SHARED` page-aligned tokens (and a page)
past what they hold form a run; the run's leader, the row whose shared prefixes save the others most,
computes the longest of them on its own and puts it in the tree (`leader_targets`). Every other row whose
match then grows re-opens on the tree (`reopen_followers`) and computes only the rest; rows that share more
among themselves than with their leader get it in the next round.

Each round is one more forward (or a few, with `prefill_chunk_size`), so a round runs only when it saves
at least `MIN_SAVED` tokens. Hybrid models compute the leaders through their snapshot points, and a branch
point is one: followers re-open on the leader's state snapshot there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..scheduling.admission import common_prefix
from .prompt_dedup import reopen_row

if TYPE_CHECKING:
    from .generate_rows import GenerateRows

MIN_SHARED = 16  # tokens a follower must reuse (and at least a page)
MIN_SAVED = 256  # tokens a round must save in all for its extra forward


@dataclass
class SharingRound:
    """A round's leaders (batch row -> the prompt length it computes first) and its followers (batch row ->
    the prompt tokens it re-opens on after the leaders); both empty when the round does not pay."""

    targets: dict[int, int] = field(default_factory=dict)
    followers: dict[int, int] = field(default_factory=dict)


def leader_targets(prompts: dict[int, np.ndarray], computed: dict[int, int], page_size: int) -> SharingRound:
    """The sharing round of the rows `prompts` (computed up to `computed`); empty when it would save fewer
    than `MIN_SAVED` tokens.

    Rows next to each other in byte order that share at least `MIN_SHARED` tokens (and a page) past what
    they hold form a run; its leader is the row whose prefixes shared with the others save the most, and
    computes the longest of them, short of its own last token (its logits come with generate's own step).
    """
    order = sorted(prompts, key=lambda b: prompts[b].tobytes())  # byte order: neighbours share most
    least = max(MIN_SHARED, page_size)
    shared = [min(common_prefix(prompts[a], prompts[b]), len(prompts[a]) - 1, len(prompts[b]) - 1)
              // page_size * page_size for a, b in zip(order, order[1:])]
    runs, start = [], 0  # (rows, what neighbours share) of each run
    for k in range(len(order)):
        if k + 1 == len(order) or shared[k] - max(computed[order[k]], computed[order[k + 1]]) < least:
            runs.append((order[start : k + 1], shared[start:k]))
            start = k + 1
    plan, saved = SharingRound(), 0
    for rows, between in runs:
        held = np.array([computed[b] for b in rows])
        between = np.asarray(between, dtype=np.int64)
        best, reuse = (0, 0, 0, None), None  # tokens saved, leader position, target, the followers' mask
        for i in range(len(rows)):
            with_leader = _shared_with(between, i)
            gains = np.where(with_leader - held >= least, with_leader - held, 0)
            gains[i] = 0
            if gains.sum() > best[0]:
                best, reuse = (int(gains.sum()), i, int(with_leader[gains > 0].max()), gains > 0), with_leader
        if best[0] and best[2] > computed[rows[best[1]]]:
            plan.targets[rows[best[1]]] = best[2]
            plan.followers.update((rows[k], int(reuse[k])) for k in np.flatnonzero(best[3]))
            saved += best[0]
    return plan if saved >= MIN_SAVED else SharingRound()


def _shared_with(between: np.ndarray, i: int) -> np.ndarray:
    """Per row of a run, what it shares with row `i` (`between`: what neighbours share): the least of the
    neighbours' shares between the two (byte order)."""
    out = np.zeros(len(between) + 1, dtype=np.int64)
    out[i + 1:] = np.minimum.accumulate(between[i:])
    out[:i] = np.minimum.accumulate(between[:i][::-1])[::-1]
    return out


def call_targets(rows: GenerateRows) -> SharingRound:
    """`leader_targets` of a generate call's computing rows (none for prompts given as embeddings)."""
    if rows.opaque:
        return SharingRound()
    computing = rows.compute_rows()
    return leader_targets({b: rows.tokens.row(b) for b in computing},
                          {b: rows.reqs[b].computed_len for b in computing}, rows.engine.manager.page_size)


def reopen_followers(rows: GenerateRows, leaders: dict[int, int]) -> None:
    """After `leaders` computed up to their targets: each puts that prefix in the tree, and every other
    row that has computed nothing yet and now matches more re-opens on the tree's match."""
    engine = rows.engine
    manager = engine.manager
    for b, end in leaders.items():
        manager.cache_req(rows.reqs[b].row, rows.tokens.row(b), end, finished=False)
    for b in rows.compute_rows():
        req, prompt = rows.reqs[b], rows.tokens.row(b)
        fresh = b not in leaders and req.computed_len == req.cached_len  # computed nothing yet
        if not fresh or manager.gpu_cached_len(prompt) <= req.cached_len:
            continue
        handle = reopen_row(manager, req, prompt, prompt)
        engine.stats.cached_tokens += handle.cached_len - req.cached_len
        engine.stats.host_cached_tokens += handle.restored_len
        req.host_cached_len += handle.restored_len
        req.computed_len = req.cached_len = handle.cached_len
        req.check()
