"""Admission: which requests run at all, and which prefill chunks join each step.

`screen` refuses bad input up front, so that a bad request fails alone with a message. `PrefillPlanner`
fills a step's token budget after the decode tokens: first the next chunks of the prefilling requests,
then waiting requests admitted in queue order while the KV pool has room for all that admitted requests
may still allocate (a prompt waits a step for a batch-mate that computes its prefix meanwhile).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from ..memory.radix_tree import RadixPrefixCache
from .request import Req, RequestStatus
from .request_queues import RequestQueues
from .running_rows import StepItems

if TYPE_CHECKING:
    from ..engine import RadixEngine

MIN_SHARED_TO_DEFER = 16  # a prompt waits for a batch-mate computing at least this much of its prefix


def screen(req: Req, engine: RadixEngine) -> bool:
    """Whether `req` runs; if not, it is FAILED with its message, or FINISHED (nothing to generate)."""
    if req.status is RequestStatus.FAILED:  # the runner could not convert its tokens
        return False
    message = _refusal(req, engine)
    if message is not None:
        req.fail(message)
        return False
    if req.score_from is None and req.params.max_new_tokens == 0:
        req.status, req.finish_reason = RequestStatus.FINISHED, "length"
        return False
    return True


def _refusal(req: Req, engine: RadixEngine) -> str | None:
    ids = req.ids
    if not len(ids):
        return "empty prompt"
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= engine.vocab_size:
        return f"token ids must lie in [0, {engine.vocab_size}), got {low}..{high}"
    if req.final_len > engine.max_context:
        return (
            f"prompt ({req.prompt_len}) + max_new_tokens ({req.params.max_new_tokens}) exceeds the "
            f"model's context of {engine.max_context} tokens"
        )
    if engine.manager.pages_for(0, req.final_len) > engine.manager.num_pages:
        return f"prompt + max_new_tokens needs {req.final_len} tokens; the KV pool holds {engine.pool_tokens}"
    return None


class PrefillPlanner:
    """Adds a step's prefill chunks under the token budget, admitting waiting requests."""

    def __init__(self, engine: RadixEngine, queues: RequestQueues, chunked_prefill_size: int,
                 max_running_requests: int):
        self.engine = engine
        self.manager = engine.manager
        self.queues = queues
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests

    def plan(self, items: StepItems) -> None:
        """Appends prefill chunks to `items` (the running requests' decode tokens): the token budget counts
        both, and room is kept for what admitted requests will still decode."""
        queues, manager = self.queues, self.manager
        budget = self.chunked_prefill_size - len(items)
        if not queues.waiting and not queues.prefilling or budget <= 0:
            return
        reserved = self._reserved_tokens([*queues.running, *queues.prefilling])
        in_batch = RadixPrefixCache(page_size=1)
        for req in queues.prefilling:
            if budget <= 0:
                break
            budget -= self._add_chunk(items, in_batch, req, budget)
        deferred: list[Req] = []
        ps = manager.page_size
        while queues.waiting and budget > 0 and queues.active() < self.max_running_requests:
            req = queues.waiting[0]
            handle = manager.match(req.match_ids)
            shared = in_batch.match_prefix(req.match_ids[:-1]).cached_len
            if shared - handle.cached_len >= max(MIN_SHARED_TO_DEFER, ps):
                deferred.append(queues.waiting.popleft())  # a batch-mate computes this prefix this step
                continue
            need = manager.pages_for(handle.cached_len, req.final_len) * ps
            if need + reserved > manager.available_size:
                break
            manager.lock(handle)
            if need + reserved > manager.available_size:  # locking made the matched prefix unevictable
                manager.unlock(handle)
                break
            queues.waiting.popleft()
            queues.admit(req, manager.open_row(handle), handle.cached_len, handle.restored_len)
            self.engine.record_prompt(req.prompt_len, handle.cached_len, handle.restored_len)
            budget -= self._add_chunk(items, in_batch, req, budget)
            reserved += need
        queues.waiting.extendleft(reversed(deferred))

    def _reserved_tokens(self, reqs: Iterable[Req]) -> int:
        """Tokens that admitted requests may still allocate until they finish."""
        manager = self.manager
        ps = manager.page_size
        return sum(manager.pages_for(manager.row_len(r.row), r.final_len) * ps for r in reqs)

    @staticmethod
    def _add_chunk(items: StepItems, in_batch: RadixPrefixCache, req: Req, budget: int) -> int:
        """Adds `req`'s next chunk (at most `budget` tokens), noted in the step's prefix tree; its size."""
        start = req.computed_len
        end = min(req.prompt_len, start + budget)
        items.prefill.append((req, start, end))
        offset = in_batch.size_info.total_size
        in_batch.insert_prefix(req.ids[:end], np.arange(offset, offset + end, dtype=np.int64))
        return end - start
