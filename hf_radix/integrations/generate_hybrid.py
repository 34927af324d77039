"""The steps of a generate call on a hybrid model (state layers; docs/hybrid.md, sections 4 and 6).

Every row of a hybrid forward must add the same number of tokens, so the prompts of a call (their parts
not cached) run as forwards of rows with equal lengths, each row ending its forwards at its snapshot
points (where the state is saved on the tree: the points where it branches from another prompt of the
call, every `state_snapshot_interval` tokens, and the last page boundary a later match of the same prompt
reaches), as the runner's. Decode steps (one token a row) run
as one forward. After each step a row whose length is a page multiple holds a copy of its state there,
attached when the call caches its answer, so a follow-up call that starts with prompt + answer hits it;
a row stops holding past the end of its answer (its first EOS).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..scheduling.admission import snapshot_points
from ..scheduling.step_completion import snapshot_at
from .generate_rows import GenerateRows

RowsForward = Callable[[dict[int, int]], torch.Tensor]  # rows -> their ends: one forward, last-token logits


class HybridSteps:
    """The hybrid side of one generate call: prompts in forwards of equal-length rows, held snapshots."""

    def __init__(self, rows: GenerateRows, eos_token_ids: np.ndarray):
        self.rows = rows
        self.eos_token_ids = eos_token_ids
        self.manager = rows.engine.manager
        self._points: dict[int, tuple[int, ...]] | None = None  # per batch row, from the first forward
        self._cuts: dict[int, int] = {}  # batch row -> the length of its answer up to its first EOS

    def run(self, ends: dict[int, int], forward: RowsForward) -> torch.Tensor:
        """Computes each row `b` of `ends` from its computed length to `ends[b]`, in forwards of rows adding
        equal numbers of tokens that end at the rows' snapshot points; returns the logits of each row's
        last token, in the order of `ends`."""
        if self._points is None:
            reqs = [] if self.rows.opaque else [self.rows.reqs[b] for b in self.rows.compute_rows()]
            interval = self.rows.engine.options.state_snapshot_interval
            self._points = snapshot_points(reqs, self.manager.page_size, interval)
        reqs = self.rows.reqs
        last: dict[int, torch.Tensor] = {}
        while pending := [b for b in ends if reqs[b].computed_len < ends[b]]:
            stops = {b: self._next_stop(b, ends[b]) for b in pending}
            groups: dict[int, dict[int, int]] = {}
            for b, stop in stops.items():
                groups.setdefault(stop - reqs[b].computed_len, {})[b] = stop
            for group in groups.values():
                logits = forward(group)
                for i, (b, stop) in enumerate(group.items()):
                    last[b] = logits[i]
                    reqs[b].computed_len = stop
                    if stop in self._points.get(b, ()):
                        self._snapshot(b, stop)
        return torch.stack([last[b] for b in ends])

    def _next_stop(self, b: int, end: int) -> int:
        start = self.rows.reqs[b].computed_len
        return next((p for p in self._points.get(b, ()) if start < p < end), end)

    def _snapshot(self, b: int, end: int) -> None:
        """Saves row `b`'s state after its first `end` prompt tokens (its forward just ended there) on
        the tree, where a state slot is free or evictable."""
        row = self.rows.reqs[b].row
        self.manager.cache_req(row, self.rows.tokens.row(b), end, finished=False)
        snapshot_at(self.manager, row, end)

    def hold_page_ends(self) -> None:
        """After a step: each row whose length is a page multiple, within its answer, keeps a copy of its
        state there (one held slot a row, overwritten at the next one; with pages of one token only at the
        end of the answer, the rest is held at release)."""
        manager, rows = self.manager, self.rows
        page = manager.page_size
        for b in rows.compute_rows():
            req = rows.reqs[b]
            length = req.computed_len
            answered = length > req.prompt_len and rows.tokens.row(b)[length - 1] in self.eos_token_ids
            if answered and b not in self._cuts:
                self._cuts[b] = length
            cut = self._cuts.get(b)
            if length % page or (cut is not None and length > cut) or (page == 1 and length != cut):
                continue
            if not manager.state_slots.available:
                return
            manager.hold_snapshot(req.row, length)
