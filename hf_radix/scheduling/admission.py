"""Admission: which requests run at all, and which prefill chunks join each step.

`screen` refuses bad input up front, so that a bad request fails alone with a message. `PrefillPlanner`
fills a step's token budget after the decode tokens: first the next chunks of the prefilling requests,
then waiting requests admitted in queue order while the KV pool has room for all that admitted requests
may still allocate (a prompt waits a step for a batch-mate that computes its prefix meanwhile).

Hybrid models (state layers; docs/hybrid.md) run prefill steps apart from decode steps, with chunks of
one length (`plan(..., uniform=True)`), admit a request only with a free state slot, and end chunks at the
request's snapshot points (`snapshot_points`): the branch points of prompts sharing prefixes, every
`state_snapshot_interval` tokens of a long prompt, and the last page boundary before the match end, where
the scheduler saves the row's state on the tree. The one exception to the single length: a scoring
request's last chunk, whose end state nothing reads, joins a step of a longer length as a row padded at
its end (`pads_end`; its logits are exact, its state is dropped), and a chunk at least twice that length
joins cut to it (`joins`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from ..memory.radix_tree import RadixPrefixCache
from ..vlm_text import placeholder_refusal
from .request import Req, RequestStatus
from .request_queues import RequestQueues
from .running_rows import StepItems

if TYPE_CHECKING:
    from ..engine import RadixEngine

MIN_SHARED_TO_DEFER = 16  # a prompt waits for a batch-mate computing at least this much of its prefix


def match_end(req: Req) -> int:
    """Tokens a later match of `req`'s prompt can cover: its match ids but the last."""
    return len(req.match_ids) - 1


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _branch_depths(keys: list[np.ndarray]) -> list[set[int]]:
    """Per key, every length at which it branches from another key: the distinct lengths of its longest
    common prefixes with each of the others (the depths of its path's branch nodes in their trie)."""
    order = sorted(range(len(keys)), key=lambda i: keys[i].tobytes())  # byte order: neighbours share most
    common = [common_prefix(keys[a], keys[b]) for a, b in zip(order, order[1:])]
    depths: list[set[int]] = [set() for _ in keys]
    # a key's common prefix with a farther key is the least of the neighbours' common prefixes between
    # them: a stack of those minima, kept increasing, sweeping each way
    for walk, shared in ((order[1:], common), (order[-2::-1], common[::-1])):
        stack: list[int] = []
        for i, length in zip(walk, shared):
            while stack and stack[-1] > length:
                stack.pop()
            if length > 0 and (not stack or stack[-1] < length):
                stack.append(length)
            depths[i].update(stack)
    return depths


def snapshot_points(reqs: Iterable[Req], page_size: int, interval: int = 0) -> dict[int, tuple[int, ...]]:
    """Per request index, the prompt lengths after which a hybrid model's scheduler snapshots the state
    (page multiples > 0, increasing): every point where its prompt branches from another request's, every
    `interval` tokens (0: none), and the last page boundary a later match of the same prompt reaches."""
    reqs = list(reqs)
    branches = _branch_depths([r.match_ids[: match_end(r)] for r in reqs])
    points = {}
    for req, depths in zip(reqs, branches):
        end = match_end(req) // page_size * page_size
        periodic = range(interval, end, interval) if interval > 0 else ()
        lengths = {min(d, end) // page_size * page_size for d in (*depths, *periodic)} | {end}
        points[req.index] = tuple(sorted(p for p in lengths if p > 0))
    return points


def pads_end(req: Req, end: int) -> bool:
    """Whether `req`'s chunk ending at `end` may be padded at its end in a hybrid model's step: a scoring
    request's last chunk (its logits come before the padding; its end state is never read again)."""
    return req.score_from is not None and end == req.prompt_len


def joins(natural, width: int, padded):
    """Whether chunks of `natural` tokens (ints or an array) join a hybrid model's step of chunk length
    `width`: as they are, cut to `width` where what stays is at least as long (a cut that leaves a shorter
    rest would need a step of its own), or, when `padded` (`pads_end`), padded up to it."""
    return (natural == width) | (natural >= 2 * width) | padded & (natural < width)


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
    placeholders = placeholder_refusal(engine.model, ids)
    if placeholders is not None:
        return placeholders
    if req.final_len > engine.max_context:
        return (
            f"prompt ({req.prompt_len}) + max_new_tokens ({req.params.max_new_tokens}) exceeds the "
            f"model's context of {engine.max_context} tokens"
        )
    if engine.manager.pages_for(0, req.final_len) > engine.manager.num_pages:
        return f"prompt + max_new_tokens needs {req.final_len} tokens; the KV pool holds {engine.pool_tokens}"
    return None


# Hybrid steps: waiting requests a step's chunk length is chosen over and admission looks past.
UNIFORM_LOOKAHEAD = 1024


class PrefillPlanner:
    """Adds a step's prefill chunks under the token budget, admitting waiting requests."""

    def __init__(self, engine: RadixEngine, queues: RequestQueues, chunked_prefill_size: int,
                 max_running_requests: int):
        self.engine = engine
        self.manager = engine.manager
        self.queues = queues
        self.chunked_prefill_size = chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.snapshot_points: dict[int, tuple[int, ...]] = {}  # hybrid models: per request index

    def plan(self, items: StepItems, uniform: bool = False) -> None:
        """Appends prefill chunks to `items` (the running requests' decode tokens): the token budget counts
        both, and room is kept for what admitted requests will still decode. `uniform` (hybrid models):
        every chunk has one length (rows of one forward add the same number of tokens; a shorter last chunk
        of a scoring request is padded to it and costs it, a chunk twice as long is cut), the one that puts
        the most tokens in the step (`_preferred_width`), else the first request's; waiting requests that
        fit it are admitted past those that do not, which wait their turn."""
        queues = self.queues
        budget = self.chunked_prefill_size - len(items)
        if not queues.waiting and not queues.prefilling or budget <= 0:
            return
        preferred = self._preferred_width(budget) if uniform else None
        self._fill(items, budget, uniform, preferred)
        if preferred is not None and not items.prefill:  # none of that length could start now
            self._fill(items, budget, uniform, None)

    def _preferred_width(self, budget: int) -> int | None:
        """The chunk length that puts the most tokens (within `budget`, padding counted) in the step, over
        the prefilling requests and the first waiting ones, counted from what is cached now (an estimate: a
        step may admit fewer); chunks of other lengths join as `joins` says."""
        starts = [(req, req.computed_len) for req in self.queues.prefilling]
        starts += [(req, self._cached_len(req.match_ids))
                   for req in itertools.islice(self.queues.waiting, UNIFORM_LOOKAHEAD)]
        if not starts:
            return None
        ends = [self._chunk_end(req, start, budget) for req, start in starts]
        widths = np.array([end - start for end, (_, start) in zip(ends, starts)], dtype=np.int64)
        padded = np.array([pads_end(req, end) for end, (req, _) in zip(ends, starts)])
        best, most = None, -1
        for width in np.unique(widths).tolist():
            joining = np.flatnonzero(joins(widths, width, padded))[: budget // width]
            tokens = int(np.minimum(widths[joining], width).sum())
            if tokens > most:
                best, most = width, tokens
        return best

    def _cached_len(self, match_ids: np.ndarray) -> int:
        """What `manager.match` would find, on the GPU or in the host tier, copying nothing back."""
        manager = self.manager
        cached = manager.gpu_cached_len(match_ids)
        if manager.host_tier is not None:
            cached = max(cached, manager.host_tier.tree.match_prefix(match_ids[:-1]).cached_len)
        return cached

    def _fits(self, req: Req, start: int, budget: int, width: int | None) -> bool:
        """Whether `req`'s next chunk from `start` joins a uniform step of length `width` (None: any)."""
        if width is None:
            return True
        end = self._chunk_end(req, start, budget)
        padding_fits = end - start >= width or width <= budget  # a padded row costs the whole length
        return bool(joins(end - start, width, pads_end(req, end))) and padding_fits

    def _fill(self, items: StepItems, budget: int, uniform: bool, width: int | None) -> None:
        """`plan`'s chunks; `width`: the uniform step's chunk length (None: the first chunk's)."""
        queues, manager = self.queues, self.manager
        reserved = self._reserved_tokens([*queues.running, *queues.prefilling])
        in_batch = RadixPrefixCache(page_size=1)
        for req in queues.prefilling:
            if budget <= 0:
                break
            if uniform and not self._fits(req, req.computed_len, budget, width):
                continue
            size = self._add_chunk(items, in_batch, req, budget, width if uniform else None)
            width = width or size
            budget -= max(size, width) if uniform else size
        deferred: list[Req] = []
        ps = manager.page_size
        states = manager.state_slots
        other_widths = 0  # uniform: waiting requests passed over for their chunk length
        while queues.waiting and budget > 0 and queues.active() < self.max_running_requests:
            req = queues.waiting[0]
            handle = manager.match(req.match_ids)
            req.host_restored = max(req.host_restored, handle.restored_len)  # a deferral keeps the count
            shared = in_batch.match_prefix(req.match_ids[:-1]).cached_len
            # (hybrid: any page, since the batch-mate's chunk ends at its branch point, snapshotted)
            if shared - handle.cached_len >= max(1 if uniform else MIN_SHARED_TO_DEFER, ps):
                deferred.append(queues.waiting.popleft())  # a batch-mate computes this prefix this step
                continue
            if uniform and not self._fits(req, handle.cached_len, budget, width):
                other_widths += 1
                if other_widths > UNIFORM_LOOKAHEAD:
                    break
                deferred.append(queues.waiting.popleft())  # prefills in a step of its own chunk length
                continue
            need = manager.pages_for(handle.cached_len, req.final_len) * ps
            if need + reserved > manager.available_size:
                break
            manager.lock(handle)
            # locking made the matched prefix unevictable (and its snapshot: a state slot must be left)
            if need + reserved > manager.available_size or states is not None and states.available < 1:
                manager.unlock(handle)
                break
            queues.waiting.popleft()
            restored = min(req.host_restored, handle.cached_len)
            queues.admit(req, manager.open_row(handle), handle.cached_len, restored)
            self.engine.record_prompt(req.prompt_len, handle.cached_len, restored)
            size = self._add_chunk(items, in_batch, req, budget, width if uniform else None)
            width = width or size
            budget -= max(size, width) if uniform else size
            reserved += need
        queues.waiting.extendleft(reversed(deferred))

    def _reserved_tokens(self, reqs: Iterable[Req]) -> int:
        """Tokens that admitted requests may still allocate until they finish."""
        manager = self.manager
        ps = manager.page_size
        return sum(manager.pages_for(manager.row_len(r.row), r.final_len) * ps for r in reqs)

    def _chunk_end(self, req: Req, start: int, budget: int) -> int:
        """Where `req`'s chunk from `start` ends: at most `budget` tokens, at its next snapshot point."""
        end = min(req.prompt_len, start + budget)
        return next((p for p in self.snapshot_points.get(req.index, ()) if start < p < end), end)

    def _add_chunk(self, items: StepItems, in_batch: RadixPrefixCache, req: Req, budget: int,
                   width: int | None = None) -> int:
        """Adds `req`'s next chunk (at most `budget` tokens, ending at its next snapshot point; at most
        `width`, a uniform step's length), noted in the step's prefix tree; its size."""
        start = req.computed_len
        end = self._chunk_end(req, start, budget)
        if width is not None:
            end = min(end, start + width)
        items.prefill.append((req, start, end))
        offset = in_batch.size_info.total_size
        in_batch.insert_prefix(req.ids[:end], np.arange(offset, offset + end, dtype=np.int64))
        return end - start
