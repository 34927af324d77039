"""A generate call's rows as requests: opened on the call's first step, computed step by step, cached and
released by `finish`.

Each batch row is a `Req` (the runner's request model): its page-table row, status and lengths. Generate
hands every row one new token a step, so the tokens the call adds are kept for all rows in one array
(`RowTokens`, one vectorized write a step) and appended to the rows' requests when the call finishes.
The lifecycle: PREFILLING from the first step's match to its end, then DECODING (DRAINING when the call
adds a single token), then FINISHED ("stop" at the first EOS, else "length").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..paged_attention.forward_batch import StepRows
from ..scheduling.request import Req, RequestStatus
from ..scheduling.row_tokens import RowTokens
from ..scheduling.sampling import SamplingParams
from ..scheduling.step_completion import hold_end_snapshot
from .prompt_dedup import DuplicatePrompts

if TYPE_CHECKING:
    from ..engine import RadixEngine

OPAQUE_TOKEN = -1  # placeholder id of a prompt position given as `inputs_embeds`: never matched, never cached
ALLOCATE_AHEAD = 16  # tokens of room a row gets past what a step needs: one page-table write per 16 steps


class GenerateRows:
    """The rows of one generate call: `reqs[b]` is batch row `b`'s request, `tokens.row(b)` its tokens."""

    def __init__(self, engine: RadixEngine):
        self.engine = engine
        self.reqs: list[Req] = []
        self.tokens = RowTokens([])  # real (unpadded) tokens of each batch row
        self.opaque = False  # prompts given as inputs_embeds: nothing of the rows is matched or cached
        self.duplicates = DuplicatePrompts()
        self.max_new = 0  # tokens the call may still add to each row after its prompt

    def __len__(self) -> int:
        return len(self.reqs)

    def open(self, ids: np.ndarray | None, lens: list[int], max_new: int) -> None:
        """Matches and locks each row's cached prefix: row `b`'s prompt is the last `lens[b]` of `ids[b]`
        (None: prompts given as embeddings, opaque)."""
        manager = self.engine.manager
        self.opaque, self.max_new = ids is None, max(max_new, 0)
        params = SamplingParams(max_new_tokens=self.max_new)
        states = manager.state_slots
        if states is not None and len(lens) > states.available:  # a hybrid model: a state slot a row
            raise ValueError(
                f"this generate call has {len(lens)} rows but only {states.available} of the "
                f"{states.pool.num_slots} state slots are free or evictable; call "
                "hf_radix.configure(model, state_slots=...) before first use, or lower the batch size"
            )
        prompts = []
        for b, n in enumerate(lens):
            prompt = np.full(n, OPAQUE_TOKEN, dtype=np.int64) if ids is None else ids[b, ids.shape[1] - n :]
            req = Req(b, prompt, params)
            handle = manager.match(prompt[:0] if ids is None else prompt)
            manager.lock(handle)
            follower = ids is not None and self.duplicates.add(b, prompt)
            restored = 0 if follower else handle.restored_len
            req.admit(manager.open_row(handle), handle.cached_len, restored)
            self.reqs.append(req)
            req.check()
            prompts.append(prompt)
            self.engine.record_prompt(n, n if follower else handle.cached_len, restored)
        self.tokens = RowTokens(prompts)

    def check_capacity(self, sharing: dict[int, int]) -> None:
        """Fails early, with advice, when the call's worst case cannot fit in the pool; `sharing`: rows that
        re-open on a prefix another row of the call computes first, and its length (`prefix_sharing`)."""
        manager = self.engine.manager
        ps = manager.page_size
        need = 0
        for b, req in enumerate(self.reqs):
            n = req.prompt_len
            start = n - n % ps if b in self.duplicates.followers else manager.row_cached_len(req.row)
            start = max(start, sharing.get(b, 0))
            need += manager.pages_for(start, n + self.max_new) * ps
        available = manager.available_size
        if need > available:
            raise ValueError(
                f"this generate call may need {need} KV-cache slots (each row's prompt + max_new_tokens), "
                f"but only {available} of the pool's {self.engine.pool_tokens} are free or evictable; "
                "call hf_radix.configure(model, max_total_tokens=... or mem_fraction=...) before first use, "
                "or lower max_new_tokens or the batch size"
            )

    def logits_rows(self) -> torch.Tensor | None:
        return self.duplicates.logits_rows(len(self.reqs), self.engine.device)

    def compute_rows(self) -> list[int]:
        """The rows a forward computes (on the first step, followers wait for their leaders)."""
        followers = self.duplicates.followers
        return [b for b in range(len(self.reqs)) if b not in followers]

    def step(self) -> StepRows:
        """This step in page-table terms: every computing row from what is in the pool to its end."""
        reqs = [self.reqs[b] for b in self.compute_rows()]
        return StepRows.of(
            [r.row for r in reqs],
            [r.computed_len for r in reqs],
            [self.tokens.row(r.index)[r.computed_len :] for r in reqs],
        )

    def decode_step(self) -> StepRows:
        """The next decode step's rows (one token each; ids read on the device)."""
        reqs = [self.reqs[b] for b in self.compute_rows()]
        return StepRows(
            rows=np.asarray([r.row for r in reqs], dtype=np.int64),
            prefix_lens=np.asarray([r.computed_len for r in reqs], dtype=np.int64),
            new_lens=np.ones(len(reqs), dtype=np.int64), input_ids=np.zeros(len(reqs), dtype=np.int64),
        )

    def allocate(self, step: StepRows, steps: int) -> None:
        """Slots for every position `step` computes; a row that needs more gets room for up to
        `ALLOCATE_AHEAD` more tokens (never past what the call can still add after `steps` forwards), so
        that most decode steps write nothing to the page table. `release` frees what no token used."""
        if self.allocated(step):
            return
        ahead = min(ALLOCATE_AHEAD, max(self.max_new - 1 - steps, 0))  # the last token: no forward
        ends = step.prefix_lens + step.new_lens
        self.engine.manager.allocate(step.rows.tolist(), [end + ahead for end in ends.tolist()])

    def allocated(self, step: StepRows) -> bool:
        """Whether every row of `step` has slots for all the positions it computes."""
        manager = self.engine.manager
        ends = (step.prefix_lens + step.new_lens).tolist()
        return all(manager.row_len(row) >= end for row, end in zip(step.rows.tolist(), ends))

    def computed(self) -> None:
        """After a forward: every computing row has K/V for all its tokens."""
        lens = self.tokens.lens.tolist()
        for b in self.compute_rows():
            self.reqs[b].computed_len = lens[b]

    def cache_prompts(self) -> None:
        """After the first step: each row's prompt goes into the tree and the row's lock moves there.

        Rows whose prompts share a prefix then read the tree's one copy of it (pages the prefill computed
        twice are freed; decode reads a shared prefix once per group, as for prefixes cached before the
        call), and rows with a duplicated prompt reuse the K/V their first copy computed.
        """
        manager = self.engine.manager
        followers = self.duplicates.followers
        for b, req in enumerate(self.reqs):
            if not self.opaque and b not in followers:
                manager.cache_req(req.row, self.tokens.row(b), req.computed_len, finished=False)
        self.duplicates.reopen(self.engine, self.reqs, [self.tokens.row(b) for b in range(len(self.reqs))])
        status = RequestStatus.DECODING if self.max_new > 1 else RequestStatus.DRAINING
        for req in self.reqs:
            req.status, req.launched, req.launch_limit = status, 1, max(self.max_new, 1)
            req.check()

    def release(self, last: list[int] | None, eos_token_ids: np.ndarray, failed: bool = False) -> int:
        """Caches every row's prompt and answer (up to its first EOS), releases its lock, FINISHED; returns
        the tokens generated. `last`: each row's last sampled token, which no forward saw; `failed`: the
        call raised, so a hybrid model's rows keep no state at their ends (as the runner on an abort)."""
        manager = self.engine.manager
        generated = 0
        with manager.lazy_free_region():
            for b, req in enumerate(self.reqs):
                added = self.tokens.row(b)[req.prompt_len :]
                req.extend(added if last is None else np.append(added, last[b]))
                keep, reason = req.num_tokens, "length"
                ends = np.flatnonzero(np.isin(req.ids[req.prompt_len :], eos_token_ids))
                if len(ends):
                    keep, reason = req.prompt_len + int(ends[0]) + 1, "stop"
                generated += keep - req.prompt_len
                if req.row is not None:
                    computed = 0 if self.opaque else min(req.computed_len, keep)
                    if manager.state_slots is not None and computed and not failed:  # a later turn's hit
                        hold_end_snapshot(manager, req, computed)
                    row, req.row = req.row, None
                    manager.cache_req(row, req.ids, computed, finished=True)
                req.status, req.finish_reason = RequestStatus.FINISHED, reason
        return generated
