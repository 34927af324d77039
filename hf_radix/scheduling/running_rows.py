"""The scheduler's running requests as arrays, so that a decode step costs O(1) Python work.

While the list of running requests (in order) is unchanged, each step reuses the same rows, parameters
and device copy of the rows, and only moves every position by one. The requests' own counters
(`computed_len`, `launched`) lag `pending` steps behind until `settle` writes them back: the scheduler
settles before the list changes or a request leaves it, then builds new arrays for the new list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..paged_attention.forward_batch import StepRows
from .request import Req
from .sampling import SamplingParams

Item = tuple[Req, int, int]  # a request and the positions [start, end) a step computes for it


class RunningRows:
    """The running requests, in order, with their rows and next positions as arrays."""

    def __init__(self, reqs: list[Req]):
        n = len(reqs)
        self.reqs = reqs  # never modified: a changed list gets new arrays
        self.rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=n)
        self.rows.setflags(write=False)  # the same rows every step (`DecodePlanner.share` relies on it)
        self.starts = np.fromiter((r.computed_len for r in reqs), dtype=np.int64, count=n)
        self.params: list[SamplingParams] = [r.params for r in reqs]
        self.uids = tuple(r.index for r in reqs)
        self.steps_left = min((r.launch_limit - r.launched for r in reqs), default=0)  # to a last token
        self.pending = 0  # steps launched since the requests' counters were written
        self.rows_device: torch.Tensor | None = None  # `rows` on the device, uploaded once
        self.order = np.arange(n, dtype=np.int64)  # each request's logits row
        self._ones = np.ones(n, dtype=np.int64)
        self._zeros = np.zeros(n, dtype=np.int64)

    def items(self) -> StepItems:
        """A step's items, starting with each request's decode token: positions `[start, start + 1)`."""
        return StepItems(self.reqs, self.starts)

    def step(self) -> StepRows:
        """The decode tokens in page-table terms; their ids are read on the device (the last step sampled
        them)."""
        return StepRows(rows=self.rows, prefix_lens=self.starts, new_lens=self._ones, input_ids=self._zeros,
                        from_table=self.order)

    def advance(self) -> None:
        """Every request's decode token is launched."""
        self.starts = self.starts + 1  # a new array: steps already built keep theirs
        self.pending += 1
        self.steps_left -= 1

    def settle(self) -> None:
        """Writes the pending steps into the requests' counters."""
        if self.pending:
            for req in self.reqs:
                req.computed_len += self.pending
                req.launched += self.pending
            self.pending = 0


class StepItems(Sequence[Item]):
    """A step's items: the running requests' decode tokens, then its prefill chunks (`prefill`). The decode
    items are made only when read one by one: a steady decode step reads how many there are."""

    def __init__(self, reqs: list[Req], starts: np.ndarray):
        self._reqs = reqs
        self._starts = starts  # never modified (`RunningRows.advance` makes a new array)
        self.prefill: list[Item] = []

    def __len__(self) -> int:
        return len(self._reqs) + len(self.prefill)

    def __iter__(self) -> Iterator[Item]:
        yield from zip(self._reqs, self._starts.tolist(), (self._starts + 1).tolist())
        yield from self.prefill

    def __getitem__(self, index: int | slice) -> Item | list[Item]:
        return list(self)[index]
