"""After a step's GPU work: reading its sampled tokens and scores, finishing requests and releasing them.

A launched step's results are copied to the host without a wait (`LaunchedStep`); completing it waits for
that step alone. Sampled tokens reach their requests lazily: a steady decode batch appends nothing until
some request may finish with a step's tokens, then every buffered step is appended in one go. Every
admitted request leaves through `StepCompleter.release`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..memory.cache_manager import CacheManager
from .request import Req, RequestStatus
from .sampling import Sampler
from .stop_strings import StopStringDetector


@dataclass
class LaunchedStep:
    """A step whose results are still on the device: sampled tokens and scores, copied back without a wait."""

    sampled: list[Req]
    tokens: torch.Tensor | None  # host copy of the sampled tokens (pinned on CUDA)
    last: list[int]  # the positions in `sampled` of requests whose last token this step samples
    scored: list[tuple[Req, int, bool]]  # scoring requests, how many scores are theirs, whether the last
    scores: tuple[torch.Tensor, torch.Tensor] | None  # host copies: log-probs, greedy matches
    done: torch.cuda.Event | None
    decode: bool  # every item is a running request's decode token


class StepCompleter:
    """Reads completed steps into their requests, tells which requests finish, and releases requests."""

    def __init__(
        self,
        manager: CacheManager,
        sampler: Sampler,
        eos_token_ids: frozenset[int],
        stop_strings: StopStringDetector | None,
        max_context: int,
    ):
        self.manager = manager
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.stop_strings = stop_strings
        self.max_context = max_context
        self._stop_ids = np.empty(0, dtype=np.int64)  # every token that may stop a request of the run
        self._stop_strings = False  # whether a request of the run has stop strings
        # sampled tokens not yet appended to their requests: (the step's sampled requests, its tokens)
        self._unread: list[tuple[list[Req], np.ndarray]] = []
        self._bar = None

    def start(self, reqs: Sequence[Req], bar) -> None:
        """Prepares a run of the admitted `reqs`; `bar` counts released requests."""
        eos = self.eos_token_ids if any(not r.params.ignore_eos for r in reqs) else ()
        self._stop_ids = np.fromiter(set(eos).union(*(r.params.stop_token_ids for r in reqs)), dtype=np.int64)
        self._stop_strings = self.stop_strings is not None and any(r.params.stop for r in reqs)
        self._bar = bar

    def end(self) -> None:
        """Ends a run: every request left through `release`, so tokens still unread are past their ends."""
        self._unread.clear()

    @staticmethod
    def wait(launched: LaunchedStep) -> float:
        """Waits for the step's results (that step only); returns the seconds waited."""
        if launched.done is None:
            return 0.0
        waiting = time.perf_counter()
        launched.done.synchronize()
        return time.perf_counter() - waiting

    @staticmethod
    def read_scores(launched: LaunchedStep) -> list[Req]:
        """Adds the step's scores to their requests; returns the requests whose last scores these are."""
        logp, greedy = launched.scores[0].numpy(), launched.scores[1].numpy()
        offset = 0
        complete: list[Req] = []
        for req, n, last in launched.scored:
            req.logprob += float(logp[offset : offset + n].sum())
            req.greedy_match &= bool(greedy[offset : offset + n].all())
            offset += n
            if last:
                complete.append(req)
        return complete

    def read_tokens(self, launched: LaunchedStep) -> list[tuple[Req, str]]:
        """Buffers the step's sampled tokens; returns the requests they finish, with the reasons, in order.

        When some request may finish, every buffered token is appended first.
        """
        sampled, tokens = launched.sampled, launched.tokens.numpy().copy()
        self._unread.append((sampled, tokens))
        candidates = self._finish_candidates(launched, tokens)
        if candidates:
            self.flush()
        finished: list[tuple[Req, str]] = []
        for i in candidates:
            req = sampled[i]
            if req.finish_reason is not None:  # stopped at an earlier step; computed once more (overlap)
                continue
            reason = self._finish_reason(req, int(tokens[i]))
            if reason is not None:
                finished.append((req, reason))
        return finished

    def flush(self) -> None:
        """Appends the unread tokens to their requests: one `extend` a request for each run of steps that
        sampled the same requests. A request that stopped drops the tokens computed past its end."""
        unread, self._unread = self._unread, []
        start = 0
        while start < len(unread):
            reqs, end = unread[start][0], start + 1
            while end < len(unread) and unread[end][0] is reqs:
                end += 1
            block = np.stack([tokens for _, tokens in unread[start:end]], axis=1)  # [requests, steps]
            for req, tokens in zip(reqs, block):
                if req.finish_reason is None:
                    req.extend(tokens)
            start = end

    def _finish_candidates(self, launched: LaunchedStep, tokens: np.ndarray) -> list[int]:
        """Positions among the sampled requests that may finish with this step's tokens, in order: a token
        that stops some request of the run, a last token, or any token of a request with stop strings."""
        found = set(launched.last)
        if len(self._stop_ids):
            found.update((tokens[:, None] == self._stop_ids).any(axis=1).nonzero()[0].tolist())
        if self._stop_strings:
            found.update(i for i, req in enumerate(launched.sampled) if req.params.stop)
        return sorted(found)

    def _finish_reason(self, req: Req, token: int) -> str | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        detector = self.stop_strings
        if params.stop and detector is not None and detector.found(req.index, req.generated, params.stop):
            return "stop"
        if req.num_generated >= params.max_new_tokens or req.num_tokens >= self.max_context:
            return "length"
        return None

    def refuse(self, req: Req, message: str) -> None:
        """Fails a waiting request alone (it holds no row) and counts it as done."""
        req.fail(message)
        self._bar.update(1)

    def release(self, req: Req, reason: str) -> None:
        """The single exit of an admitted request: cache what is reusable, free the rest, unlock; FINISHED.

        A generated request's last token has no K/V of its own (or only from a step past its end).
        """
        if self._unread:
            self.flush()
        if req.row is not None:
            known = req.num_tokens - (1 if req.num_generated else 0)
            cached = min(req.computed_len, known)
            if self.manager.state_slots is not None and reason != "abort":
                hold_end_snapshot(self.manager, req, cached)
            self.manager.cache_req(req.row, req.ids, cached, finished=True)
            req.row = None
        self.sampler.drop(req.index)
        if self.stop_strings is not None:
            self.stop_strings.drop(req.index)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self._bar.update(1)


def snapshot_at(manager: CacheManager, row: int, end: int) -> None:
    """A hybrid model's row whose forward just ended after `end` prompt tokens, inserted by `cache_req`:
    saves its state there as a snapshot on the tree, where a state slot is free or evictable."""
    if manager.row_cached_len(row) == end and manager.state_slots.available:
        manager.snapshot_row(row)


def hold_end_snapshot(manager: CacheManager, req: Req, cached: int) -> None:
    """A hybrid model's row at release: keeps its state as the snapshot at the end of what it caches
    (prompt and answer: a follow-up turn hits it) when its forwards ended exactly there, at a page multiple,
    and a state slot is free or evictable; the release's `cache_req` attaches it."""
    if (
        req.computed_len == cached > manager.row_cached_len(req.row)
        and cached % manager.page_size == 0
        and manager.state_slots.available
    ):
        manager.hold_snapshot(req.row, cached)
