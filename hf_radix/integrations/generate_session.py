"""The per-call side of `generate(..., cache_implementation="radix")`: the Cache one call runs with.

`RadixGenerateCache` is a `RadixCache` (generate receives it as its `past_key_values`): it reads each
padded step of generate and turns it into the rows of a step for the model-runner core. The call's rows
are requests (`GenerateRows`); rows with a duplicated prompt are computed once (`DuplicatePrompts`). On a
hybrid model the prompts run as forwards of rows with equal lengths, and rows keep state snapshots for the
tree (`HybridSteps`).
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
from ..scheduling.row_tokens import host_inputs
from .generate_hybrid import HybridSteps
from .generate_rows import GenerateRows
from .prefix_sharing import SharingRound, call_targets, reopen_followers

if TYPE_CHECKING:
    from ..engine import RadixEngine



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
        self.rows = GenerateRows(engine)
        # a hybrid model's prompts as forwards of equal-length rows, and its held snapshots
        self.hybrid = HybridSteps(self.rows, self.eos_token_ids) if engine.hybrid else None
        self.seen = 0  # padded length generate has handed us so far
        self.steps = 0  # generate's forwards done (each is followed by one sampled token per row)
        self.finished = False
        self._embeds: list[torch.Tensor] | None = None  # unpadded prompt embeddings per row (first step only)
        self._logits_rows: torch.Tensor | None = None  # packed logits row of each batch row; None: identity
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
        elif self.hybrid is not None and self.steps == 0:  # prompts: rows of equal lengths a forward
            ends = {b: self.rows.tokens.length(b) for b in self.rows.compute_rows()}
            logits = self.hybrid.run(ends, functools.partial(self._forward_rows, inner=inner, kwargs=kwargs))
        elif self._embeds is not None:  # the prompt as embeddings: no graph (they take ids)
            logits = self._forward_rows(None, inner=inner, kwargs=kwargs)
        else:
            step = self.rows.step()
            self.rows.allocate(step, self.steps)
            eager = functools.partial(self._eager, embeds=None, inner=inner, kwargs=kwargs)
            # A graph's output buffer is returned as is: generate copies the logits it reads before the
            # next forward (`outputs.logits[:, -1].to(copy=True, ...)`), so no replay can overwrite them.
            logits = self.model_runner.forward(step, eager)
        output = CausalLMOutputWithPast(logits=logits, **{self.engine.cache_kwarg: self})
        if self._logits_rows is not None:
            logits = logits[self._logits_rows]
        output.logits = logits[:, None, :]
        self.rows.computed()
        if self.steps == 0:
            self._embeds = None
            self.rows.cache_prompts()
            self._logits_rows = None
        if self.hybrid is not None:
            self.hybrid.hold_page_ends()
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
        elif not len(self.rows):
            self._open_rows(input_ids, embeds, mask, fresh)
        elif embeds is not None:
            raise ValueError("cache_implementation='radix' takes inputs_embeds for the prompt only")
        else:
            self.rows.tokens.append(input_ids[:, width - fresh:].cpu().numpy())
        self.seen = total
        if self.steps == 0 and (self._ahead is None or self._ahead[1] is None):  # nothing ran ahead
            while leaders := call_targets(self.rows).targets:  # shared prefixes once (`prefix_sharing`)
                self._compute(leaders, model)
                reopen_followers(self.rows, leaders)
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
        if self._open_rows(ids, None, mask, ids.shape[1]).targets:  # a sharing round first: generate runs it
            self._ahead = (ids, None, None)
            return
        step = self.rows.step()
        logits = None
        stream = self.engine.side_stream("prefill_ahead")
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        if self.model_runner.graph_fits(step):
            with torch.cuda.stream(stream):
                self.rows.allocate(step, self.steps)
                logits = self.model_runner.forward(step)  # the graph's output buffer, read after `stream`
        self._ahead = (ids, logits, stream)

    def _check_same_prompt(self, input_ids: torch.Tensor | None) -> None:
        """Generate's first step must be the prompt the step run ahead computed."""
        ahead = self._ahead[0]
        if input_ids is None or input_ids.shape != ahead.shape or (
            input_ids.data_ptr() != ahead.data_ptr() and not torch.equal(input_ids, ahead)
        ):
            raise RuntimeError("generate's first step is not the prompt it was given; radix cannot follow")

    def _prepare_next(self) -> None:
        """Loads the next decode step's inputs while the GPU computes this one (see `ModelRunner.prepare`),
        where it may come (the call can still add a token) and its slots are allocated already."""
        if self.model_runner is None or not self.model_runner.has_graphs or self.steps >= self.rows.max_new:
            return
        step = self.rows.decode_step()
        if self.rows.allocated(step):
            self.model_runner.prepare(step)

    def _eager(
        self, batch: ForwardBatch, embeds: torch.Tensor | None, inner: Callable, kwargs: dict
    ) -> torch.Tensor:
        """Generate's own model call on a packed batch (the step no graph runs, a prefill chunk); its packed
        logits."""
        call = {key: value for key, value in kwargs.items() if key != "cache_position"}
        self.batch, self.state_batch = batch, batch.state_batch
        try:
            call.update(self._model_inputs(batch, embeds))
            call["attention_mask"] = None
            with radix_forward(self), self.engine.forward_ops():
                logits = inner(**call).logits[0]
            if self.state_batch is not None:  # the rows' states back into their slots
                self.state_batch.flush()
        finally:
            self.batch = self.state_batch = None
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
    ) -> SharingRound:
        """Matches and locks each row's cached prefix (the first forward of the call); the call's first
        sharing round (`prefix_sharing`), which the pool check counts with."""
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
        if self.max_new_tokens is not None:
            max_new = self.max_new_tokens
        else:
            max_new = (self.max_length or width) - width
        self.rows.open(ids, lens, max_new)
        if embeds is not None:
            self._embeds = [embeds[b, width - n:] for b, n in enumerate(lens)]
        self._logits_rows = self.rows.logits_rows()
        sharing = call_targets(self.rows)
        self.rows.check_capacity(sharing.followers)
        return sharing

    def _make_step(
        self, ends: dict[int, int] | None, logits: bool
    ) -> tuple[StepRows, torch.Tensor | None]:
        """Rows `b` from their computed length to `ends[b]` (default: every computing row to its end), their
        slots allocated, and their packed embeddings (a prompt given as `inputs_embeds`)."""
        tokens = self.rows.tokens
        if ends is None:
            ends = {b: tokens.length(b) for b in self.rows.compute_rows()}
        reqs = [self.rows.reqs[b] for b in ends]
        manager = self.engine.manager
        manager.allocate([r.row for r in reqs], [ends[r.index] for r in reqs])
        step = StepRows.of(
            [r.row for r in reqs],
            [r.computed_len for r in reqs],
            [tokens.row(r.index)[r.computed_len:ends[r.index]] for r in reqs],
            None if logits else [np.zeros(0, dtype=np.int64)] * len(reqs),
        )
        packed = None
        if self._embeds is not None:
            packed = torch.cat([self._embeds[r.index][r.computed_len:ends[r.index]] for r in reqs])[None]
        return step, packed

    def _forward_rows(self, ends: dict[int, int] | None, inner: Callable, kwargs: dict) -> torch.Tensor:
        """One eager forward of rows `b` from their computed length to `ends[b]` (default: every computing
        row to its end); the logits of each row's last token."""
        step, embeds = self._make_step(ends, logits=True)
        eager = functools.partial(self._eager, embeds=embeds, inner=inner, kwargs=kwargs)
        return self.model_runner.forward(step, eager, graphs=False)

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
        reqs = [self.rows.reqs[b] for b in self.rows.compute_rows()]
        tokens = self.rows.tokens
        while sum(tokens.length(r.index) - r.computed_len for r in reqs) > budget:
            ends, left = {}, budget
            for r in reqs:
                take = min(tokens.length(r.index) - r.computed_len - 1, left)  # each row's last token stays
                if take > 0:
                    ends[r.index] = r.computed_len + take
                    left -= take
                if left == 0:
                    break
            if not ends:
                return
            self._compute(ends, module)

    def _compute(self, targets: dict[int, int], module: torch.nn.Module) -> None:
        """Computes each row `b` of `targets` from its computed length to `targets[b]` (prompt tokens, no
        logits kept), in forwards of at most `prefill_chunk_size` tokens when it is set."""
        reqs = self.rows.reqs
        kwargs = {"use_cache": True, "return_dict": True}
        budget = self.prefill_chunk_size or sum(end - reqs[b].computed_len for b, end in targets.items())
        while pending := {b: end for b, end in targets.items() if reqs[b].computed_len < end}:
            ends, left = {}, budget
            for b, end in pending.items():
                take = min(end - reqs[b].computed_len, left)
                if take > 0:
                    ends[b] = reqs[b].computed_len + take
                    left -= take
            if self.hybrid is not None:  # rows of equal lengths a forward; they note what they computed
                self.hybrid.run(ends, functools.partial(self._forward_rows, inner=module, kwargs=kwargs))
                continue
            step, embeds = self._make_step(ends, logits=False)
            chunk = functools.partial(self._eager, embeds=embeds, inner=module, kwargs=kwargs)
            self.model_runner.forward(step, chunk, graphs=False)
            for b, end in ends.items():
                reqs[b].computed_len = end

    def finish(self, sequences: torch.Tensor | None = None) -> None:
        """Caches every row's prompt and answer (up to its first EOS) and releases all locks.

        `sequences` (generate's output) supplies each row's last sampled token, which no forward saw; None:
        generate failed.
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
        self.engine.stats.generated_tokens += self.rows.release(last, self.eos_token_ids, sequences is None)
        if self._started is not None:
            self.engine.stats.wall_time += time.perf_counter() - self._started


def _wait_for(stream: torch.cuda.Stream | None) -> None:
    """Orders the current stream's later work after everything queued on `stream` so far."""
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
