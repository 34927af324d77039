"""The per-call side of `generate(..., cache_implementation="radix")`: the Cache one call runs with.

`RadixGenerateCache` is a `RadixCache` (generate receives it as its `past_key_values`) that also keeps
the call's rows: it turns each padded step of generate into the rows of a step for the model-runner core.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..cache_utils import RadixCache
from ..errors import OWN_CACHE_MESSAGE
from ..forward.forward_context import current_forward, model_attention, radix_forward
from ..forward.model_runner import ModelRunner
from ..paged_attention.forward_batch import ForwardBatch, StepRows
from ..scheduling.row_tokens import RowTokens, host_inputs

if TYPE_CHECKING:
    from ..engine import RadixEngine


OPAQUE_TOKEN = -1  # placeholder id of a prompt position given as `inputs_embeds`: never matched, never cached
ALLOCATE_AHEAD = 16  # tokens of room a row gets past what a step needs: one page-table write per 16 steps


class RadixGenerateCache(RadixCache):
    """The cache `generate(..., cache_implementation="radix")` runs with: one per call.

    During the call the model's `forward` goes through `RadixGenerateCache.forward`: each padded `(B, S)`
    step of generate becomes a packed batch of only the tokens not yet in the pool (each row reuses its
    own cached prefix; padding never enters the pool), and the packed logits come back as `(B, 1, vocab)`.
    Rows with identical prompts are computed once. `finish` inserts prompts and answers into the tree
    and releases every lock.
    """

    def __init__(
        self,
        engine: RadixEngine,
        eos_token_ids: Sequence[int] = (),
        *,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        prefill_chunk_size: int | None = None,
        num_return_sequences: int = 1,
        logits_to_keep: bool = True,
    ):
        super().__init__(engine)
        self.eos_token_ids = np.unique(np.asarray(eos_token_ids, dtype=np.int64))  # what ends an answer
        self.max_new_tokens = max_new_tokens
        self.max_length = max_length
        self.prefill_chunk_size = prefill_chunk_size
        self.num_return_sequences = num_return_sequences
        self.supports_logits_to_keep = logits_to_keep
        self.rows: list[int | None] = []  # page-table row of each batch row; None once released
        self.tokens = RowTokens([])  # real (unpadded) tokens of each batch row
        self.computed: list[int] = []  # tokens of each row with K/V in the pool
        self.prompt_lens: list[int] = []
        self.opaque: list[bool] = []  # prompt given as inputs_embeds: nothing of the row is matched or cached
        self.seen = 0  # padded length generate has handed us so far
        self.steps = 0  # generate's forwards done (each is followed by one sampled token per row)
        self.finished = False
        self._followers: dict[int, int] = {}  # batch row -> earlier row with the same prompt (first step)
        self._embeds: list[torch.Tensor] | None = None  # unpadded prompt embeddings per row (first step only)
        self._logits_rows: torch.Tensor | None = None  # packed logits row of each batch row; None: identity
        self._max_new = 0  # tokens the call may still add to each row after its prompt (set by _open_rows)
        self.model_runner: ModelRunner | None = engine.model_runner  # graph or eager per step; None: finished
        # the step run ahead: (prompt ids, its logits or None, the stream computing them)
        self._ahead: tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Stream | None] | None = None
        self._started: float | None = None  # when the call began under the engine's lock (prefill_ahead)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.finished:  # a finished call's cache handed to a plain forward: fail before any layer
            raise ValueError(OWN_CACHE_MESSAGE)
        return self.seen

    # -- the model's forward during the call ------------------------------------------------------------
    def forward(self, model: torch.nn.Module, inner: Callable, args: tuple, kwargs: dict):
        """Generate's model call: runs only the tokens not in the pool yet, returns `(B, 1, vocab)` logits.

        Decode steps replay a captured CUDA graph when one is available; other calls made to the model
        during the call (a runner's, classifier-free guidance's own pass) run untouched.
        """
        if current_forward() is not None:
            return inner(*args, **kwargs)  # our own prefill chunk, or a runner's forward inside generate
        if kwargs.get(self.engine.cache_kwarg) is not self:
            # Not generate's step (classifier-free guidance's unconditional pass with its own cache, or a
            # plain call from another thread): it runs with the model's own attention.
            with model_attention():
                return inner(*args, **kwargs)
        self._take_step(model, args, kwargs)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            _wait_for(ahead[2])
        if ahead is not None and ahead[1] is not None:
            logits = ahead[1]
        elif self._embeds is not None:  # the prompt as embeddings: no graph (they take ids)
            step, embeds = self._make_step(None, logits=True)
            eager = functools.partial(self._eager, embeds=embeds, inner=inner, kwargs=kwargs)
            logits = self.model_runner.forward(step, eager, graphs=False)
        else:
            step = self._step()
            self._allocate(step)
            eager = functools.partial(self._eager, embeds=None, inner=inner, kwargs=kwargs)
            # A graph's output buffer is returned as is: generate copies the logits it reads before the
            # next forward (`outputs.logits[:, -1].to(copy=True, ...)`), so no replay can overwrite them.
            logits = self.model_runner.forward(step, eager)
        output = CausalLMOutputWithPast(logits=logits, **{self.engine.cache_kwarg: self})
        if self._logits_rows is not None:
            logits = logits[self._logits_rows]
        output.logits = logits[:, None, :]
        for b in range(len(self.rows)):
            if b not in self._followers:
                self.computed[b] = self.tokens.length(b)
        if self.steps == 0:
            self._embeds = None
            self._cache_prompts()
        self.steps += 1
        self._prepare_next()
        return output

    def _take_step(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Reads the new tokens of generate's padded step (opening the rows on the first one)."""
        if self.finished:
            raise RuntimeError("this generate(cache_implementation='radix') call has already finished")
        if args:
            raise TypeError("cache_implementation='radix' expects the model called with keyword arguments")
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise ValueError("cache_implementation='radix' cannot return attentions or hidden states")
        input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        step = embeds if embeds is not None else input_ids
        if step is None:
            raise ValueError("cache_implementation='radix' needs input_ids or inputs_embeds")
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() != 2:
            raise ValueError("cache_implementation='radix' needs a 2D attention_mask (batch, length)")
        width = step.shape[1]
        total = mask.shape[1] if mask is not None else self.seen + width
        fresh = total - self.seen
        if not 0 < fresh <= width:
            raise RuntimeError(f"generate passed {width} positions for {fresh} new ones; radix cannot follow")
        if self._ahead is not None:
            self._check_same_prompt(input_ids)
        elif not self.rows:
            self._open_rows(input_ids, embeds, mask, fresh)
        elif embeds is not None:
            raise ValueError("cache_implementation='radix' takes inputs_embeds for the prompt only")
        else:
            self.tokens.append(input_ids[:, width - fresh:].cpu().numpy())
        self.seen = total
        if self.steps == 0 and self.prefill_chunk_size:
            self._prefill_in_chunks(model)

    def prefill_ahead(self, call: dict) -> None:
        """Opens the rows and starts the first step (a captured graph) before generate's own set-up.

        Generate spends milliseconds preparing before its first model call, while the first step is
        already known from the prompt ids and their attention mask: the GPU computes it meanwhile, and
        generate's first call returns these logits. Other calls wait for generate's first step. The step
        runs on a stream of its own, so that generate's set-up, whose host syncs wait for the default
        stream, need not wait for it.
        """
        self._started = time.perf_counter()  # called once per call, first, under the engine's lock
        ids = call.get("inputs") if call.get("inputs") is not None else call.get("input_ids")
        mask = call.get("attention_mask")
        if (
            not self.model_runner.has_graphs
            or self.prefill_chunk_size
            or self.num_return_sequences != 1
            or not isinstance(ids, torch.Tensor)
            or ids.dim() != 2
            or ids.is_floating_point()
            or not isinstance(mask, torch.Tensor)
            or mask.shape != ids.shape
            or ids.device != self.engine.device
        ):
            return
        self._open_rows(ids, None, mask, ids.shape[1])
        step = self._step()
        logits = None
        stream = self.engine.side_stream("prefill_ahead")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        if self.model_runner.graph_fits(step):
            with torch.cuda.stream(stream):
                self._allocate(step)
                logits = self.model_runner.forward(step)  # the graph's output buffer, read after `stream`
        self._ahead = (ids, logits, stream)

    def _check_same_prompt(self, input_ids: torch.Tensor | None) -> None:
        """Generate's first step must be the prompt the step run ahead computed."""
        ahead = self._ahead[0]
        if input_ids is None or input_ids.shape != ahead.shape or (
            input_ids.data_ptr() != ahead.data_ptr() and not torch.equal(input_ids, ahead)
        ):
            raise RuntimeError("generate's first step is not the prompt it was given; radix cannot follow")

    def _step(self) -> StepRows:
        """This step in page-table terms: every computing row from what is in the pool to its end."""
        rows = self._compute_rows()
        return StepRows.of(
            [self.rows[b] for b in rows],
            [self.computed[b] for b in rows],
            [self.tokens.row(b)[self.computed[b] :] for b in rows],
        )

    def _allocate(self, step: StepRows) -> None:
        """Slots for every position `step` computes; a row that needs more gets room for up to
        `ALLOCATE_AHEAD` more tokens (never past what the call can still add), so that most decode steps
        write nothing to the page table. `finish` frees what no token used."""
        if self._allocated(step):
            return
        ahead = min(ALLOCATE_AHEAD, max(self._max_new - 1 - self.steps, 0))  # the last token: no forward
        ends = step.prefix_lens + step.new_lens
        self.engine.manager.allocate(step.rows.tolist(), [end + ahead for end in ends.tolist()])

    def _allocated(self, step: StepRows) -> bool:
        """Whether every row of `step` has slots for all the positions it computes."""
        manager = self.engine.manager
        ends = (step.prefix_lens + step.new_lens).tolist()
        return all(manager.row_len(row) >= end for row, end in zip(step.rows.tolist(), ends))

    def _prepare_next(self) -> None:
        """Loads the next decode step's inputs while the GPU computes this one (see `ModelRunner.prepare`),
        where it may come (the call can still add a token) and its slots are allocated already."""
        if self.model_runner is None or not self.model_runner.has_graphs or self.steps >= self._max_new:
            return
        rows = self._compute_rows()
        step = StepRows(
            rows=np.asarray([self.rows[b] for b in rows], dtype=np.int64),
            prefix_lens=np.asarray([self.computed[b] for b in rows], dtype=np.int64),
            new_lens=np.ones(len(rows), dtype=np.int64), input_ids=np.zeros(len(rows), dtype=np.int64),
        )
        if self._allocated(step):
            self.model_runner.prepare(step)

    def _eager(
        self, batch: ForwardBatch, embeds: torch.Tensor | None, inner: Callable, kwargs: dict
    ) -> torch.Tensor:
        """Generate's own model call on a packed batch (the step no graph runs, a prefill chunk); its packed
        logits."""
        call = {key: value for key, value in kwargs.items() if key != "cache_position"}
        self.batch = batch
        try:
            call.update(self._model_inputs(batch, embeds))
            call["attention_mask"] = None
            with radix_forward(self):
                logits = inner(**call).logits[0]
        finally:
            self.batch = None
        if not self.supports_logits_to_keep:
            logits = logits[batch.logits_indices]
        return logits

    # -- per-call bookkeeping --------------------------------------------------------------------------
    def _open_rows(
        self,
        input_ids: torch.Tensor | None,
        embeds: torch.Tensor | None,
        mask: torch.Tensor | None,
        fresh: int,
    ) -> None:
        """Matches and locks each row's cached prefix (the first forward of the call)."""
        step = embeds if embeds is not None else input_ids
        size, width = step.shape[0], step.shape[1]
        ids, mask = host_inputs(None if embeds is not None else input_ids[:, width - fresh:], mask, fresh)
        if mask is None:
            lens = [fresh] * size
        else:
            counts = mask.sum(1)
            left_padded = np.arange(fresh)[None, :] >= (fresh - counts)[:, None]
            if not np.array_equal(mask, left_padded):
                raise ValueError(
                    "cache_implementation='radix' needs left padding (tokenizer padding_side='left') and no "
                    "holes in the attention_mask"
                )
            lens = counts.tolist()
        if min(lens) == 0:
            raise ValueError(f"row {lens.index(0)} of the batch is empty (all padding)")
        manager = self.engine.manager
        first_row_of: dict[bytes, int] = {}
        prompts = []
        for b, n in enumerate(lens):
            tokens = np.full(n, OPAQUE_TOKEN, dtype=np.int64) if ids is None else ids[b, fresh - n:]
            handle = manager.match(tokens[:0] if ids is None else tokens)
            manager.lock(handle)
            self.rows.append(manager.open_row(handle))
            prompts.append(tokens)
            self.computed.append(handle.cached_len)
            self.prompt_lens.append(n)
            self.opaque.append(ids is None)
            leader = b if ids is None else first_row_of.setdefault(tokens.tobytes(), b)
            if leader != b:
                self._followers[b] = leader
            self.engine.record_prompt(
                n, n if leader != b else handle.cached_len, 0 if leader != b else handle.restored_len
            )
        self.tokens = RowTokens(prompts)
        if embeds is not None:
            self._embeds = [embeds[b, width - n:] for b, n in enumerate(lens)]
        if self._followers:
            leaders = [b for b in range(size) if b not in self._followers]
            position = {b: i for i, b in enumerate(leaders)}
            gather = [position[self._followers.get(b, b)] for b in range(size)]
            self._logits_rows = torch.tensor(gather, device=self.engine.device)
        self._check_capacity(width)

    def _check_capacity(self, padded_len: int) -> None:
        """Fails early, with advice, when the call's worst case cannot fit in the pool."""
        manager = self.engine.manager
        ps = manager.page_size
        if self.max_new_tokens is not None:
            max_new = self.max_new_tokens
        else:
            max_new = (self.max_length or padded_len) - padded_len
        self._max_new = max(max_new, 0)
        need = 0
        for b, row in enumerate(self.rows):
            n = self.prompt_lens[b]
            start = n - n % ps if b in self._followers else manager.row_cached_len(row)
            need += manager.pages_for(start, n + max(max_new, 0)) * ps
        available = manager.available_size
        if need > available:
            raise ValueError(
                f"this generate call may need {need} KV-cache slots (each row's prompt + max_new_tokens), "
                f"but only {available} of the pool's {self.engine.pool_tokens} are free or evictable; "
                "call hf_radix.configure(model, max_total_tokens=... or mem_fraction=...) before first use, "
                "or lower max_new_tokens or the batch size"
            )

    def _compute_rows(self) -> list[int]:
        return [b for b in range(len(self.rows)) if b not in self._followers]

    def _make_step(
        self, ends: dict[int, int] | None, logits: bool
    ) -> tuple[StepRows, torch.Tensor | None]:
        """Rows `b` from `computed[b]` to `ends[b]` (default: every computing row to its end), their slots
        allocated, and their packed embeddings (a prompt given as `inputs_embeds`)."""
        if ends is None:
            ends = {b: self.tokens.length(b) for b in self._compute_rows()}
        rows = list(ends)
        manager = self.engine.manager
        manager.allocate([self.rows[b] for b in rows], [ends[b] for b in rows])
        step = StepRows.of(
            [self.rows[b] for b in rows],
            [self.computed[b] for b in rows],
            [self.tokens.row(b)[self.computed[b]:ends[b]] for b in rows],
            None if logits else [np.zeros(0, dtype=np.int64)] * len(rows),
        )
        packed = None
        if self._embeds is not None:
            packed = torch.cat([self._embeds[b][self.computed[b]:ends[b]] for b in rows])[None]
        return step, packed

    def _model_inputs(self, batch: ForwardBatch, embeds: torch.Tensor | None) -> dict:
        inputs = {
            "input_ids": batch.input_ids[None] if embeds is None else None,
            "inputs_embeds": embeds,
            "position_ids": batch.positions[None],
            self.engine.cache_kwarg: self,
        }
        if self.supports_logits_to_keep:
            inputs["logits_to_keep"] = batch.logits_indices
        return inputs

    def _prefill_in_chunks(self, module: torch.nn.Module) -> None:
        """Computes the prompts in forwards of <= `prefill_chunk_size` tokens; generate's own is the last."""
        budget = self.prefill_chunk_size
        rows = self._compute_rows()
        while sum(self.tokens.length(b) - self.computed[b] for b in rows) > budget:
            ends, left = {}, budget
            for b in rows:
                take = min(self.tokens.length(b) - self.computed[b] - 1, left)  # each row's last token stays
                if take > 0:
                    ends[b] = self.computed[b] + take
                    left -= take
                if left == 0:
                    break
            if not ends:
                return
            step, embeds = self._make_step(ends, logits=False)
            chunk = functools.partial(self._eager, embeds=embeds, inner=module,
                                      kwargs={"use_cache": True, "return_dict": True})
            self.model_runner.forward(step, chunk, graphs=False)
            for b, end in ends.items():
                self.computed[b] = end

    def _cache_prompts(self) -> None:
        """After the first step: each row's prompt goes into the tree and the row's lock moves there.

        Rows whose prompts share a prefix then read the tree's one copy of it (pages the prefill computed
        twice are freed; decode reads a shared prefix once per group, as for prefixes cached before the
        call), and rows with a duplicated prompt reuse the K/V their first copy computed.
        """
        manager = self.engine.manager
        for b, row in enumerate(self.rows):
            if row is not None and not self.opaque[b] and b not in self._followers:
                manager.cache_req(row, self.tokens.row(b), self.computed[b], finished=False)
        for b, leader in self._followers.items():
            # Re-open the row on the prefix its leader just cached, then copy the unaligned tail.
            tokens, row = self.tokens.row(b), self.rows[b]
            self.rows[b] = None
            manager.cache_req(row, tokens, self.computed[b], finished=True)
            handle = manager.match(np.append(tokens, 0))
            manager.lock(handle)
            self.rows[b] = manager.open_row(handle)
            self.computed[b] = handle.cached_len
            manager.allocate([self.rows[b]], [len(tokens)])
            src = manager.row_slots(self.rows[leader])[handle.cached_len:len(tokens)].astype(np.int64)
            dst = manager.row_slots(self.rows[b])[handle.cached_len:len(tokens)].astype(np.int64)
            self.engine.pool.copy_slots(src, dst)
            self.computed[b] = len(tokens)
            manager.cache_req(self.rows[b], tokens, len(tokens), finished=False)
        self._followers.clear()
        self._logits_rows = None

    def finish(self, sequences: torch.Tensor | None = None) -> None:
        """Caches every row's prompt and answer (up to its first EOS) and releases all locks.

        `sequences` (generate's output) supplies each row's last sampled token, which no forward saw.
        """
        if self.finished:
            return
        self.finished = True
        self.model_runner = None  # a returned cache must not keep the engine's graphs alive
        if self._ahead is not None:  # generate failed before its first step: its slots are freed below
            _wait_for(self._ahead[2])
        last = None
        size = len(self.rows)
        if self.steps and sequences is not None and sequences.dim() == 2 and sequences.shape[0] == size:
            last = sequences[:, -1].tolist()
        manager = self.engine.manager
        generated = 0
        with manager.lazy_free_region():
            for b, row in enumerate(self.rows):
                tokens = self.tokens.row(b) if last is None else np.append(self.tokens.row(b), last[b])
                keep = len(tokens)
                if len(self.eos_token_ids):
                    ends = np.flatnonzero(np.isin(tokens[self.prompt_lens[b]:], self.eos_token_ids))
                    keep = self.prompt_lens[b] + int(ends[0]) + 1 if len(ends) else keep
                generated += keep - self.prompt_lens[b]
                if row is not None:
                    self.rows[b] = None
                    computed = 0 if self.opaque[b] else min(self.computed[b], keep)
                    manager.cache_req(row, tokens, computed, finished=True)
        self.engine.stats.generated_tokens += generated
        if self._started is not None:
            self.engine.stats.wall_time += time.perf_counter() - self._started


def _wait_for(stream: torch.cuda.Stream | None) -> None:
    """Orders the current stream's later work after everything queued on `stream` so far."""
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
