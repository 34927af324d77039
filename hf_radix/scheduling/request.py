"""A request's state inside the scheduler, and what the runner returns for it."""

from __future__ import annotations

import numbers
import operator
from dataclasses import InitVar, dataclass, field

import numpy as np

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


@dataclass(eq=False)  # compared by identity: the scheduler's list operations stay O(1) per element
class Req:
    """One prompt moving through match → lock → allocate → prefill (chunks) → decode → release.

    `num_computed` tokens have K/V in the pool; `token_ids[num_computed:]` are still to be computed.
    A scoring request (`score_from` set) wants the logits of positions `score_from .. len(token_ids) - 2`
    and generates nothing; its last token is never computed (`prompt_len` excludes it).
    `ids` holds the same tokens as an int64 array (what the tree, the page table and the metadata read);
    generated tokens go through `append` so both stay equal. `ids_array`, when given, is that array already
    (the same tokens as `token_ids`): the request copies from it, or keeps it when it has no room to grow.
    """

    index: int
    token_ids: list[int]
    params: SamplingParams
    score_from: int | None = None
    prompt_len: int = 0
    row: int | None = None
    num_computed: int = 0  # positions whose K/V a launched step computes
    launched: int = 0  # generated tokens whose sampling has been launched (known or still on the device)
    cached_tokens: int = 0
    host_cached_tokens: int = 0
    logprob: float = 0.0
    greedy_match: bool = True
    finish_reason: str | None = None
    error: str | None = None
    launch_limit: int = 0  # generated tokens to launch at most (set when the request starts decoding)
    ids_array: InitVar[np.ndarray | None] = None

    def __post_init__(self, ids_array: np.ndarray | None):
        n = len(self.token_ids)
        self.prompt_len = n - (self.score_from is not None)
        size = max(n, self.final_len)
        if ids_array is not None and len(ids_array) != n:
            raise ValueError(f"ids_array holds {len(ids_array)} tokens, token_ids {n}")
        keep = ids_array is not None and ids_array.dtype == np.int64 and ids_array.flags.c_contiguous
        if keep and size == n:
            self._ids = ids_array  # nothing will be appended (scoring): no copy
        else:
            self._ids = np.empty(size, dtype=np.int64)
            self._ids[:n] = self.token_ids if ids_array is None else ids_array
        self._match_ids: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray:
        """The tokens so far as an int64 array (a view; do not modify)."""
        return self._ids[: len(self.token_ids)]

    def append(self, token: int) -> None:
        """Adds a generated token."""
        self._ids[len(self.token_ids)] = token
        self.token_ids.append(token)

    def extend(self, tokens: np.ndarray) -> None:
        """Adds generated tokens (int64), oldest first."""
        n = len(self.token_ids)
        self._ids[n : n + len(tokens)] = tokens
        self.token_ids.extend(tokens.tolist())

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def prefilled(self) -> bool:
        return self.num_computed >= self.prompt_len

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
        first, last = max(start, self.score_from), min(end, len(self.token_ids) - 1)
        return np.arange(first - start, last - start, dtype=np.int64)


def prompt_items(prompts, call: str, noun: str = "prompts") -> list:
    """`prompts` as a list, refusing what reads as one prompt rather than a batch of them (TypeError): a
    string (it would run one prompt per character) or a flat sequence of numbers (one token-id prompt)."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError(
            f"{call}() takes a list of {noun}, got a single string (read as one {noun[:-1]} per "
            f"character); wrap it in a list: {call}([{noun[:-1]}])"
        )
    items = list(prompts)
    if items and all(_is_scalar(p) for p in items):
        raise TypeError(
            f"{call}() takes a list of {noun}, got a flat sequence of numbers (one {noun[:-1]} of token "
            f"ids?); wrap it in a list: {call}([token_ids])"
        )
    return items


def pair_items(pairs, call: str = "loglikelihood") -> list:
    """`pairs` as a list of (context, continuation) pairs, refusing (TypeError) one pair not wrapped in a
    list: a pair of strings, or a pair of token-id lists (which would unpack into pairs of numbers)."""
    one_pair = f"to score one pair, wrap it in a list: {call}([(context, continuation)])"
    if isinstance(pairs, (str, bytes)):
        raise TypeError(f"{call}() takes a list of (context, continuation) pairs, got a string; {one_pair}")
    items = list(pairs)
    for i, pair in enumerate(items):
        sized = hasattr(pair, "__len__") and not isinstance(pair, (str, bytes)) and not _is_scalar(pair)
        if not sized or len(pair) != 2:
            raise TypeError(
                f"{call}() takes a list of (context, continuation) pairs; item {i} is {_describe(pair)}, "
                f"not a pair; {one_pair}"
            )
    if items and all(_is_scalar(c) and _is_scalar(x) for c, x in items):
        raise TypeError(
            f"{call}() takes a list of (context, continuation) pairs, got pairs of numbers (one pair of "
            f"token-id lists?); {one_pair}"
        )
    return items


def _is_scalar(value) -> bool:
    return isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0


def token_id_array(tokens) -> np.ndarray:
    """One prompt's token ids (a list, an array or a tensor of integers) as a 1-D int64 array.

    Python ints and numpy / torch integer values are token ids; anything else raises a TypeError naming
    the first offender and its position: floats (even 5.0), bools, strings, nested sequences, a scalar or
    a 2-D array in place of the sequence. (A list mixing bools into ints converts as 0 / 1: telling them
    apart would cost a pass over every element.) The vocabulary range is the scheduler's check.
    """
    if isinstance(tokens, (str, bytes)) or getattr(tokens, "ndim", 1) == 0 or not hasattr(tokens, "__iter__"):
        raise TypeError(f"token ids must form a sequence of integers, got {_describe(tokens)}")
    if getattr(tokens, "ndim", 1) != 1:
        raise TypeError(f"token ids must form a 1-D sequence, got shape {tuple(tokens.shape)}")
    values = tokens.tolist() if hasattr(tokens, "tolist") and not isinstance(tokens, np.ndarray) else tokens
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):  # ragged or otherwise not an array of numbers
        array = None
    if array is not None and array.ndim == 1:
        if array.dtype.kind in "iu" and array.dtype != np.uint64:
            return array.astype(np.int64, copy=False)
        if not array.size:
            return np.empty(0, dtype=np.int64)
    if isinstance(values, np.ndarray):
        values = values.tolist()  # Python scalars in the messages
    ids = np.empty(len(values), dtype=np.int64)
    for i, t in enumerate(values):
        value = None if isinstance(t, (bool, np.bool_)) else _index(t)
        if value is None:
            raise TypeError(f"token ids must be integers, got {_describe(t)} at position {i}")
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"token ids must lie in the vocabulary, got {value} at position {i}")
        ids[i] = value
    return ids


def _index(value) -> int | None:
    """`value` as an int when it is an integer (Python, numpy, a one-element integer tensor), else None."""
    if getattr(value, "dtype", None) is not None and "bool" in str(value.dtype):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def token_id_list(value) -> list[int]:
    """An EOS-style setting (None, an id, a list or a tensor of ids) as a list of ids."""
    if value is None:
        return []
    if hasattr(value, "reshape"):
        return [int(t) for t in value.reshape(-1).tolist()]
    return [int(value)] if isinstance(value, int) else [int(t) for t in value]
