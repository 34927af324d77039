"""The request model: a request's status and lengths (runner and generate alike), and the runner's result."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

import numpy as np

from ..memory.radix_tree import IntegrityError
from .sampling import SamplingParams


@dataclass
class RequestOutput:
    """Result of one prompt, in input order."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, copied back from the host tier
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None


class RequestStatus(enum.Enum):
    """Where a request is in its life; the scheduler keeps one collection per live status."""

    WAITING = "waiting"  # queued: no row, nothing computed
    PREFILLING = "prefilling"  # holds a row; prompt chunks still to compute (`extend_len > 0`)
    DECODING = "decoding"  # prompt computed; one token launched a step
    DRAINING = "draining"  # every token (a scoring request: its last chunk) launched; results on the way
    FINISHED = "finished"  # released; `finish_reason` is "stop", "length" or "abort"
    FAILED = "failed"  # refused alone with a message (`finish_reason` "error"); never held a row


HOLDS_ROW = frozenset({RequestStatus.PREFILLING, RequestStatus.DECODING, RequestStatus.DRAINING})


@dataclass(eq=False)  # compared by identity: the scheduler's list operations stay O(1) per element
class Req:
    """One prompt moving through WAITING -> PREFILLING (chunks) -> DECODING -> DRAINING -> FINISHED.

    Its lengths: `cached_len` prompt tokens had K/V in the pool when it was admitted (the prefix cache;
    `host_cached_len` of them copied back from the host tier), `computed_len` positions have K/V in the
    pool or computed by a launched step, and `extend_len` prompt tokens are still to compute; `check`
    holds them to `host_cached_len <= cached_len <= computed_len` and to the status.
    A scoring request (`score_from` set) wants the logits of positions `score_from .. num_tokens - 2`
    and generates nothing; its last token is never computed (`prompt_len` excludes it).
    The tokens are one int64 array (`ids`, what the tree, the page table and the metadata read), which
    `append` / `extend` grow; an int64 array given as `tokens` is kept as is when nothing will be appended.
    """

    index: int
    tokens: InitVar[np.ndarray | Sequence[int]]
    params: SamplingParams
    score_from: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    row: int | None = None
    cached_len: int = 0
    host_cached_len: int = 0
    host_restored: int = 0  # the most tokens a match copied back from the host tier while it waited
    computed_len: int = 0
    launched: int = 0  # generated tokens whose sampling has been launched (known or still on the device)
    launch_limit: int = 0  # generated tokens to launch at most (set when the request starts decoding)
    logprob: float = 0.0
    greedy_match: bool = True
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self, tokens: np.ndarray | Sequence[int]):
        n = len(tokens)
        self.num_tokens = n
        self.prompt_len = n - (self.score_from is not None)
        size = max(n, self.final_len)
        keep = isinstance(tokens, np.ndarray) and tokens.dtype == np.int64 and tokens.flags.c_contiguous
        if keep and size == n:
            self._ids = tokens  # nothing will be appended (scoring): no copy
        else:
            self._ids = np.empty(size, dtype=np.int64)
            self._ids[:n] = tokens
        self._match_ids: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray:
        """The tokens so far as an int64 array (a view; do not modify)."""
        return self._ids[: self.num_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self.ids.tolist()

    def append(self, token: int) -> None:
        """Adds a generated token."""
        self.extend(np.array([token], dtype=np.int64))

    def extend(self, tokens: np.ndarray) -> None:
        """Adds generated tokens (int64), oldest first."""
        n, end = self.num_tokens, self.num_tokens + len(tokens)
        if end > len(self._ids):
            grown = np.empty(max(end, 2 * len(self._ids)), dtype=np.int64)
            grown[:n] = self._ids[:n]
            self._ids = grown
        self._ids[n:end] = tokens
        self.num_tokens = end

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self._ids[self.prompt_len : self.num_tokens].tolist()

    @property
    def extend_len(self) -> int:
        """Prompt tokens still to compute."""
        return max(self.prompt_len - self.computed_len, 0)

    @property
    def match_ids(self) -> np.ndarray:
        """Tokens the prefix match may cover (plus one): the first logits position is never cached."""
        if self._match_ids is None:
            end = self.prompt_len if self.score_from is None else self.score_from + 1
            self._match_ids = self._ids[:end]
        return self._match_ids

    @property
    def final_len(self) -> int:
        """Most tokens this request can hold in the pool."""
        return self.prompt_len + self.params.max_new_tokens

    def logits_offsets(self, start: int, end: int) -> np.ndarray:
        """Offsets within the chunk `[start, end)` whose logits this request needs."""
        if self.score_from is None:
            wanted = [end - start - 1] if end >= self.prompt_len else []
            return np.array(wanted, dtype=np.int64)
        first, last = max(start, self.score_from), min(end, self.num_tokens - 1)
        return np.arange(first - start, last - start, dtype=np.int64)

    def admit(self, row: int, cached_len: int, host_cached_len: int) -> None:
        """WAITING -> PREFILLING on `row`, whose first `cached_len` positions the prefix cache holds."""
        self.row, self.status = row, RequestStatus.PREFILLING
        self.computed_len = self.cached_len = cached_len
        self.host_cached_len = host_cached_len

    def fail(self, message: str) -> None:
        """Refuses the request alone (it holds no row): FAILED, with `message`."""
        self.status, self.finish_reason, self.error = RequestStatus.FAILED, "error", message

    def check(self) -> None:
        """Raises IntegrityError unless the lengths agree with each other and with the status (the
        scheduler checks at each status change; a running request's counters must be settled)."""
        status = self.status
        ok = 0 <= self.host_cached_len <= self.cached_len <= self.computed_len <= self.final_len
        if status is RequestStatus.WAITING:
            ok &= self.row is None and self.computed_len == 0 and self.finish_reason is None
        elif status in HOLDS_ROW:
            ok &= self.row is not None and self.finish_reason is None
        else:
            ok &= self.row is None and (self.finish_reason == "error") == (status is RequestStatus.FAILED)
        if status is RequestStatus.PREFILLING:
            ok &= self.extend_len > 0 and self.launched == 0
        elif status is RequestStatus.DECODING or status is RequestStatus.DRAINING and self.score_from is None:
            ok &= self.computed_len == self.prompt_len + self.launched - 1  # the last token: no K/V yet
            limit = self.launch_limit - (status is RequestStatus.DECODING)  # DECODING: more to launch
            ok &= self.launched <= limit
        if not ok:
            raise IntegrityError(
                f"request {self.index} is {status.name} with row={self.row} cached_len={self.cached_len} "
                f"host_cached_len={self.host_cached_len} computed_len={self.computed_len} "
                f"prompt_len={self.prompt_len} launched={self.launched}/{self.launch_limit}"
            )
