"""Forwards captured in CUDA graphs: static metadata buffers, shapes padded to a few buckets.

Eager HF forwards of a few tokens are launch-bound (tens of milliseconds at 8B whatever the batch);
replaying a captured graph removes that. Two kinds:

* `DecodeGraphs`: one new token per row, rows padded to a bucket; a padded row is one token on the page
  table's padding row (every position: the scratch slot outside the managed pool), attending to itself.
  Batches whose rows share cached prefixes replay graphs of their own, one per batch size, whose
  attention reads each group's prefix once (`paged_attention.shared_decode`; static group buffers, the split
  count read on the device; deterministic mode: `paged_attention.grouped_decode`'s tiles).
* `ExtendGraphs`: a few new tokens per row over cached prefixes (a question after a cached few-shot
  prefix), rows and tokens padded to buckets; padded rows are empty and the padded tokens form one extra
  row on the padding row, all writing the scratch slot.

Hybrid models replay decode graphs alone (their steps' rows add equal tokens): a graph's rows read and write
their state slots through a static index (`forward.hybrid.GraphStates`), a padded row the scratch slot.

Before a replay the step's metadata lands in the graph's static buffers through the function that builds
eager batches (`build_forward_batch(..., into=)`): the staged copy of what the host sends goes straight
into a static block laid out for the graph's padded shape, and the device gathers (ids read from the page
table, the slot list) write into the static buffers; a capture records the batch it returns. The static
slot buffer holds every row's whole context (bucket x table width), so no context length falls back to
eager. Graphs are captured with the model's Llama-style norms and rotary embeddings swapped for single
Triton kernels (`fused_ops`, unless turned off). Off CUDA the same padded batches run eagerly, so the
padding logic is exercised on the CPU too.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import gc
import time

import numpy as np
import torch
from transformers.utils import logging

from ..memory.page_table import PADDING_ROW
from ..paged_attention.forward_batch import ForwardBatch, GraphInputs, StepRows, build_forward_batch
from ..paged_attention.grouped_decode import decode_planner
from .engine_view import ForwardEngine, eager_batch
from .fused_ops import fused_norm_and_rope
from .graph_shapes import EXTEND_TOKEN_BUCKETS, bucket, bucket_sizes, static_block_words
from .hybrid import GraphStates

logger = logging.get_logger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)


class GraphCaptureError(RuntimeError):
    """The model's forward runs eagerly but cannot be captured (it copies to or from the host, say: the
    grouped expert matmuls of MoE models outside bf16 do)."""


class _CapturedForwards(abc.ABC):
    """Shared machinery: static buffers, capture per padded shape, replay with the step's metadata loaded."""

    #: the kernels read the slot lists of whole contexts (decode) or of cached prefixes (extend)
    decode: bool

    def __init__(self, engine: ForwardEngine, max_rows: int, max_tokens: int, fused_ops: bool = True):
        self.engine = engine
        self.table = engine.manager.table
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.fused_ops = fused_ops
        # the kernels read whole contexts (decode; every step in deterministic mode) or cached prefixes
        self.context = self.decode or engine.options.deterministic
        # a row's context in a graph: up to the model's context (generate may go past it: eagerly)
        self.kv_bound = min(self.table.max_width, engine.max_context)
        self.capture = engine.device.type == "cuda"
        self.released = False
        self.replays = 0
        self.loads = 0  # inputs loaded into the static buffers (by runs, captures and `prepare`)
        self.capture_time = 0.0
        self.states: GraphStates | None = None  # hybrid models' decode graphs: the rows' state slots
        self._graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor, GraphInputs]] = {}
        if self.capture:
            self._allocate_static()
            self._pool = torch.cuda.graph_pool_handle()

    def _allocate_static(self) -> None:
        """The static block every shape's metadata is uploaded into, and the static slot list."""
        scratch = self.table.scratch_slot
        with torch.inference_mode(False):  # written later by calls in any grad mode
            self._block = torch.zeros(static_block_words(self.max_rows, self.max_tokens), dtype=torch.int64,
                                      device=self.engine.device)
            self._kv = torch.full(((self.max_rows + 1) * self.kv_bound,), scratch, dtype=torch.int64,
                                  device=self.engine.device)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Drops every captured graph, their memory pool and the static buffers (the engine's pool is going
        away: the graphs hold its addresses); running or capturing afterwards raises."""
        self.released = True
        self._graphs = {}
        self._block = self._kv = self._pool = None

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(
                "these CUDA graphs were released with their engine's KV pool; use the model's current engine"
            )

    # -- running -----------------------------------------------------------------------------------------
    def _run(self, key: tuple[int, ...], padded: StepRows, real_rows: int) -> torch.Tensor:
        """Runs a padded batch (its graph, captured on first use; eagerly off CUDA); real rows' logits.

        On CUDA the result is the graph's output buffer: valid until the next replay.
        """
        self._check_live()
        self.replays += 1
        if not self.capture:  # eager runs (off CUDA) may use any backend
            self._load_states(padded)
            return self._forward(self._attach(key, eager_batch(self.engine, padded)))[:real_rows]
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._capture(key)
        build_forward_batch(self.table, padded, self.context, into=captured[2])
        self._load_states(padded)
        self.loads += 1
        return self._replay(captured, real_rows)

    def _replay(self, captured: tuple[torch.cuda.CUDAGraph, torch.Tensor, GraphInputs],
                real_rows: int) -> torch.Tensor:
        graph, logits, _ = captured
        graph.replay()
        return logits[:real_rows]

    def capture_shape(self, key: tuple[int, int]) -> None:
        """Captures the graph of a padded shape now (a warm-up), unless it already is."""
        self._check_live()
        if self.capture and key not in self._graphs:
            self._graphs[key] = self._capture(key)

    def _capture(self, key: tuple[int, ...]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, GraphInputs]:
        started = time.perf_counter()
        padding = self._padding_only(key)
        rows, tokens = padding.batch_size, padding.num_tokens
        inputs = GraphInputs(self._block, self._kv, rows, tokens, key[0], self.decode)
        batch = build_forward_batch(self.table, padding, self.context, into=inputs)
        self._load_states(padding)  # the eager runs before the capture write the padding rows' states
        self.loads += 1
        # the kernels' launch sizes (split counts) for the longest context a replay may bring
        batch = dataclasses.replace(batch, max_kv_len=self.kv_bound)
        graph, logits = self._record(self._attach(key, batch))
        self.capture_time += time.perf_counter() - started
        logger.info("captured a %s CUDA graph for %s", type(self).__name__, key)
        return graph, logits, inputs

    def _record(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Captures the forward of the static `batch` in a graph (after two eager runs); its logits buffer."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        fused = fused_norm_and_rope(self.engine.model) if self.fused_ops else contextlib.nullcontext(0)
        with fused as swaps:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            collecting = gc.isenabled()
            # Neither a garbage collection (finalizers releasing CUDA or pinned memory) nor another thread's
            # CUDA call may invalidate the capture: collection waits until it ends.
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    logits = self._forward(batch)
            except RuntimeError as error:  # the eager runs above passed: only capturing fails
                raise GraphCaptureError(str(error)) from error
            finally:
                if collecting:
                    gc.enable()
        torch.cuda.current_stream().synchronize()
        logger.debug("%d norm/rope swaps in the captured forward", swaps)
        return graph, logits

    def _attach(self, key: tuple[int, ...], batch: ForwardBatch) -> ForwardBatch:
        """The batch a graph of `key` runs (what its kernels read besides the common metadata)."""
        return batch

    def _load_states(self, padded: StepRows) -> None:
        if self.states is not None:
            self.states.load(padded.rows)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """What a graph captures: the model's forward on the (static) batch."""
        return self.engine.run_model(batch)

    @abc.abstractmethod
    def _padding_only(self, key: tuple[int, int]) -> StepRows:
        """A batch of the shape `key` made of padding alone (what a graph is captured with)."""


@dataclasses.dataclass(frozen=True)
class _PreparedStep:
    """A decode step whose inputs `DecodeGraphs.prepare` loaded: valid while nothing else loaded since."""

    key: tuple[int, ...]
    rows: np.ndarray
    prefix_lens: np.ndarray
    loads: int

    def matches(self, step: StepRows) -> bool:
        return (step.from_table is None and np.array_equal(step.rows, self.rows)
                and np.array_equal(step.prefix_lens, self.prefix_lens))


class DecodeGraphs(_CapturedForwards):
    """Decode steps (one new token per row) replayed from graphs captured per padded batch size."""

    decode = True

    def __init__(
        self, engine: ForwardEngine, max_batch: int, fused_ops: bool = True, shared_prefix: bool = False
    ):
        hybrid = engine.hybrid  # its norms are not all Llama-style: HF's own
        super().__init__(engine, max_batch, max_batch, fused_ops and not hybrid)
        self.states = GraphStates(engine.manager, max_batch, engine.device) if hybrid else None
        self.sizes = bucket_sizes(max_batch)
        # graphs keyed (rows, rows, 1) read its plans, one per batch size of two rows or more
        self.shared = decode_planner(engine, max_batch, captured=True) if shared_prefix else None
        self._padded: tuple[int, tuple, tuple] | None = None  # see `_pad`
        self._prepared: _PreparedStep | None = None  # see `prepare`
        self.prepared_replays = 0  # replays whose inputs `prepare` had loaded

    def fits(self, step: StepRows) -> bool:
        """Whether a step (one new token per row) can replay a graph."""
        return (
            step.is_decode
            and step.batch_size <= self.max_rows
            and step.last_tokens_only
            and int(step.prefix_lens.max()) + 1 <= self.kv_bound
            and (self.states is None or bool(step.prefix_lens.min() > 0))  # every row continues its state
        )

    def shapes(self) -> list[tuple[int, ...]]:
        per_row = [(s, s) for s in self.sizes]
        if self.shared is None:
            return per_row
        return per_row + [(s, s, 1) for s in self.sizes if s >= 2]

    def _pad(self, size: int, step: StepRows) -> StepRows:
        """`step` padded to `size` rows, each wanting its logits; padded rows read their id (0) from the
        page table's padding row too when the step's ids come from the table (one gather, no scatter).

        The padded arrays besides the positions are kept while the step's arrays are the same objects (a
        steady batch's `RunningRows`)."""
        n = step.batch_size
        if n == size:
            return step if step.logits_offsets is None else dataclasses.replace(step, logits_offsets=None)
        sources = (step.rows, step.new_lens, step.input_ids, step.from_table)
        cached = self._padded
        if cached is None or cached[0] != size or any(a is not b for a, b in zip(cached[1], sources)):
            zeros = np.zeros(size - n, dtype=np.int64)
            from_table = step.from_table
            if from_table is not None:
                from_table = np.concatenate([from_table, np.arange(n, size, dtype=np.int64)])
            padded = (
                np.concatenate([step.rows, zeros + PADDING_ROW]), np.concatenate([step.new_lens, zeros + 1]),
                np.concatenate([step.input_ids, zeros]), from_table, zeros,
            )
            padded[0].setflags(write=False)  # the same rows while kept (`DecodePlanner.share`)
            cached = self._padded = (size, sources, padded)
        rows, new_lens, input_ids, from_table, zeros = cached[2]
        return StepRows(rows=rows, prefix_lens=np.concatenate([step.prefix_lens, zeros]), new_lens=new_lens,
                        input_ids=input_ids, from_table=from_table)

    def _padding_only(self, key: tuple[int, int]) -> StepRows:
        return self._pad(key[0], StepRows.of([], [], []))

    def run(self, step: StepRows, *, fits: bool = False) -> torch.Tensor:
        """Decodes one token per row; returns `[B, vocab]` (see `_run` for the buffer's lifetime).

        `fits`: the caller has just checked `fits(step)`.
        """
        if not (fits or self.fits(step)):
            raise ValueError(f"a decode batch of {step.batch_size} rows does not fit the captured graphs")
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared.loads == self.loads and prepared.matches(step):
            captured = self._graphs[prepared.key]
            captured[2].input_ids[: step.batch_size].copy_(torch.from_numpy(step.input_ids))
            if len(prepared.key) == 3:
                self.shared.steps += 1
            self.replays += 1
            self.prepared_replays += 1
            return self._replay(captured, step.batch_size)
        key, padded = self._key(step, count=True)
        return self._run(key, padded, step.batch_size)

    def prepare(self, step: StepRows) -> None:
        """Loads the inputs of the decode step that comes next, ids aside, into its graph's static buffers
        now, while the GPU computes the current step; `run` of exactly these rows and lengths then writes
        only their ids before replaying. The loads are queued behind the current replay on its stream, so
        they cannot overwrite what it reads. Nothing is loaded for a shape not captured yet."""
        if not (self.capture and step.from_table is None and self.fits(step)):
            return
        key, padded = self._key(step, count=False)
        captured = self._graphs.get(key)
        if captured is None:
            return
        build_forward_batch(self.table, padded, True, into=captured[2])
        self._load_states(padded)
        self.loads += 1
        self._prepared = _PreparedStep(key, step.rows.copy(), step.prefix_lens.copy(), self.loads)

    def _key(self, step: StepRows, count: bool) -> tuple[tuple[int, ...], StepRows]:
        """The graph a decode step replays and the step padded to its shape; `count`: the step runs now
        (shared-prefix steps are counted)."""
        size = bucket(self.sizes, step.batch_size)
        padded = self._pad(size, step)
        share = None if self.shared is None else self.shared.share(padded, count=count)
        return ((size, size) if share is None else (size, size, 1)), padded

    def _attach(self, key: tuple[int, ...], batch: ForwardBatch) -> ForwardBatch:
        if self.states is not None:
            batch = dataclasses.replace(batch, state_batch=self.states.batch(key[0]))
        if len(key) == 2:
            return batch
        return dataclasses.replace(batch, shared_prefix=self.shared.graph_share(key[0]))

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.shared_prefix is not None:
            batch.shared_prefix.refresh(batch.kv_indptr, batch.seq_lens)
        return self.engine.run_model(batch)


class ExtendGraphs(_CapturedForwards):
    """Short extends (a few new tokens per row after a cached prefix) replayed from captured graphs."""

    decode = False

    def __init__(
        self, engine: ForwardEngine, max_rows: int = 8, max_tokens: int = EXTEND_TOKEN_BUCKETS[-1],
        fused_ops: bool = True,
    ):
        super().__init__(engine, max_rows, max_tokens, fused_ops)
        self.row_sizes = bucket_sizes(max_rows)
        self.token_sizes = sorted({t for t in EXTEND_TOKEN_BUCKETS if t < max_tokens} | {max_tokens})

    def fits(self, step: StepRows) -> bool:
        """Whether a step of rows that each add at least one token can replay a graph."""
        return (
            0 < step.batch_size <= self.max_rows
            and step.num_tokens <= self.max_tokens
            and bool(np.all(step.new_lens > 0))
            and step.last_tokens_only
            and int(step.prefix_lens.max()) <= self.kv_bound
        )

    def shapes(self) -> list[tuple[int, int]]:
        return [(r, t) for r in self.row_sizes for t in self.token_sizes if t >= r]

    def _pad(self, rows: int, tokens: int, step: StepRows) -> StepRows:
        empty = rows - step.batch_size
        pad = tokens - step.num_tokens
        offsets = [np.array([n - 1], dtype=np.int64) for n in step.new_lens.tolist()]
        # empty rows (page-table padding row, nothing cached, no token), then the padding row of `pad` tokens
        tail_rows = np.full(empty + 1, PADDING_ROW, dtype=np.int64)
        tail_prefix = np.zeros(empty + 1, dtype=np.int64)
        tail_new = tail_prefix.copy()
        tail_new[-1] = pad
        return StepRows(
            rows=np.concatenate([step.rows, tail_rows]),
            prefix_lens=np.concatenate([step.prefix_lens, tail_prefix]),
            new_lens=np.concatenate([step.new_lens, tail_new]),
            input_ids=np.concatenate([step.input_ids, np.zeros(pad, dtype=np.int64)]),
            # an empty row's "last token" is the one before it (a real row's); the padding row has no logits
            logits_offsets=[*offsets, *[np.full(1, -1, dtype=np.int64)] * empty, _EMPTY],
            from_table=step.from_table,
        )

    def _padding_only(self, key: tuple[int, int]) -> StepRows:
        return self._pad(key[0], key[1], StepRows.of([], [], []))

    def run(self, step: StepRows, *, fits: bool = False) -> torch.Tensor:
        """Computes each row's new tokens after its cached prefix; returns `[B, vocab]` (last tokens).

        `fits`: the caller has just checked `fits(step)`.
        """
        if not (fits or self.fits(step)):
            raise ValueError("an extend batch with an empty row or past the captured shapes cannot replay")
        key = (bucket(self.row_sizes, step.batch_size), bucket(self.token_sizes, step.num_tokens))
        return self._run(key, self._pad(*key, step), step.batch_size)
