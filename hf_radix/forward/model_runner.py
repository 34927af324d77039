"""The model-runner core: turns the rows of a step into logits, for the batch runner and `generate` alike,
and samples or scores them on the device with the copy back to the host started (`sample`, `score`).

It is the one place that picks how a step runs: a captured decode graph (one new token per row), a
captured extend graph (a few new tokens per row after cached prefixes), or an eager forward (the engine's,
or the caller's own model call: generate's steps, a prompt given as embeddings, prefill chunks); every
forward is counted in the engine's statistics here. Graphs exist where `engine.captures_graphs` (CUDA,
Triton attention, no MLA latent pool); `warm_up` captures every shape and compiles the eager kernels before
the first request, so a first run costs what a steady one does.
The graphs hold the addresses of the engine's pool: `release` frees them when the engine closes its pool
or rebuilds its core, and a released core refuses to run. `graph_memory_bytes` estimates the memory the
graphs take, which the engine keeps out of a pool sized from free GPU memory.
With `shared_prefix` (Triton attention, one device), decode steps whose rows share cached prefixes read
each group's prefix once where the cost rule says so, in graphs and eagerly (`paged_attention.shared_decode`);
in deterministic mode, tiles compute each group's shared pieces once (`paged_attention.grouped_decode`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers.utils import logging

from ..memory.page_table import PADDING_ROW, to_device
from ..paged_attention.forward_batch import ForwardBatch, StepRows
from ..paged_attention.grouped_decode import decode_planner
from ..paged_attention.shared_decode import MAX_PREFIX_SPLITS
from ..scheduling.logprobs import target_logprobs
from ..scheduling.sampling import Sampler, SamplingParams, warm_up_sampling
from .cuda_graph import DecodeGraphs, ExtendGraphs, GraphCaptureError
from .engine_view import ForwardEngine, eager_batch
from .graph_shapes import EXTEND_TOKEN_BUCKETS, static_buffer_bytes
from .hybrid import state_batch

logger = logging.get_logger(__name__)

EagerForward = Callable[[ForwardBatch], torch.Tensor]
# eager prefill lengths run at warm-up: Triton specializations, and the GEMM kernels of prefill chunks
WARM_UP_TOKENS = (1, 7, 16, 100, 512, 2048, 8192)
# and one batch of rows of these lengths: more rows than extend attention serves in one launch
# (`triton_extend.FEW_ROWS`), so its one-program-per-row classes compile too
WARM_UP_ROW_TOKENS = (1, 7, 16, 100)
EXTEND_GRAPH_ROWS = 8  # extend graphs cover up to this many rows ...
EXTEND_GRAPH_TOKENS = EXTEND_TOKEN_BUCKETS[-1]  # ... and this many new tokens
GRAPH_MEMORY_MARGIN = 256 << 20  # allocator rounding, cuBLAS workspaces, graph bookkeeping (an estimate)


class ModelRunner:
    """Runs steps on one engine's model; graphs are captured on first use of a shape, or all by `warm_up`."""

    def __init__(
        self,
        engine: ForwardEngine,
        *,
        cuda_graph: bool = True,
        max_batch: int = 256,
        fused_ops: bool = True,
        extend_rows: int = EXTEND_GRAPH_ROWS,
        extend_tokens: int = EXTEND_GRAPH_TOKENS,
        shared_prefix: bool | None = None,
    ):
        self.engine = engine
        self.fused_ops = fused_ops
        if shared_prefix is None:
            shared_prefix = engine.options.shared_prefix
        self.shared_prefix = shared_prefix and engine.backend.name == "triton" and engine.single_device
        self.eager_shared = decode_planner(engine, 16, grow=True) if self.shared_prefix else None
        self.decode_graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None
        if cuda_graph and engine.captures_graphs:  # CUDA, Triton attention, K/V read from the pool
            self.decode_graphs = DecodeGraphs(engine, max_batch, fused_ops, self.shared_prefix)
            if not engine.hybrid:  # a hybrid model's rows add equal tokens: no padding row
                self.extend_graphs = ExtendGraphs(engine, extend_rows, extend_tokens, fused_ops)
        self.warm_up_times: dict[str, float] = {}
        self.released = False

    @property
    def has_graphs(self) -> bool:
        return self.decode_graphs is not None

    @property
    def captures(self) -> bool:
        """Steps replay captured CUDA graphs (off CUDA, graph-shaped batches run eagerly)."""
        return self.decode_graphs is not None and self.decode_graphs.capture

    def release(self) -> None:
        """Frees the captured graphs, their memory pool and static buffers, for good.

        Called when the engine releases its KV pool or rebuilds its core: the graphs replay into the pool's
        addresses, so none may run afterwards; `forward` then raises.
        """
        for graphs in (self.decode_graphs, self.extend_graphs):
            if graphs is not None:
                graphs.release()
        self.decode_graphs = self.extend_graphs = None
        self.released = True

    def graph_captures(self) -> dict[str, float]:
        """Graphs captured so far and the seconds their captures took (cold-start accounting)."""
        graphs = [g for g in (self.decode_graphs, self.extend_graphs) if g is not None]
        return {"graphs": sum(g.num_graphs for g in graphs), "capture_s": sum(g.capture_time for g in graphs)}

    @property
    def max_graph_batch(self) -> int:
        return 0 if self.decode_graphs is None else self.decode_graphs.max_rows

    def ensure_graph_batch(self, max_batch: int) -> None:
        """Decode graphs cover batches up to `max_batch` rows (re-created, uncaptured, when they did not)."""
        if self.decode_graphs is not None and max_batch > self.decode_graphs.max_rows:
            self.decode_graphs.release()
            self.decode_graphs = DecodeGraphs(self.engine, max_batch, self.fused_ops, self.shared_prefix)

    @property
    def shared_prefix_steps(self) -> int:
        """Decode steps whose attention read each group's shared prefix once (graphs and eager)."""
        graphs = self.decode_graphs.shared if self.decode_graphs is not None else None
        eager = self.eager_shared
        return (graphs.steps if graphs is not None else 0) + (eager.steps if eager is not None else 0)

    def _graphs_for(self, step: StepRows) -> DecodeGraphs | ExtendGraphs | None:
        for graphs in (self.decode_graphs, self.extend_graphs):
            if graphs is not None and graphs.fits(step):
                return graphs
        return None

    def graph_fits(self, step: StepRows) -> bool:
        """Whether `step` would replay a captured graph."""
        return self._graphs_for(step) is not None

    def forward(
        self, step: StepRows, eager: EagerForward | None = None, *, graphs: bool = True
    ) -> torch.Tensor:
        """Logits of the positions `step` asks for, rows concatenated; the forward counted in the engine's
        statistics.

        A graph's logits are its output buffer, valid until the next forward. `eager` runs the batch when
        no graph runs the step (default: the engine's model on the batch); `graphs=False`: none does (a
        runner without graphs, a step given as embeddings).
        """
        if self.released:
            raise RuntimeError(
                "this model runner was released with its engine's KV pool (closed, or options changed); "
                "use the model's current engine (hf_radix.get_engine(model).model_runner)"
            )
        captured = self._graphs_for(step) if graphs else None
        if captured is not None:
            try:
                logits = captured.run(step, fits=True)
            except GraphCaptureError as error:
                self._give_up_graphs(error)
                captured = None
        if captured is None:
            batch = eager_batch(self.engine, step)
            if self.engine.hybrid:  # a hybrid model: the rows' state slots
                batch.state_batch = state_batch(self.engine.manager, step)
            if self.eager_shared is not None and step.is_decode:
                batch.shared_prefix = self.eager_shared.share(step)
                if batch.shared_prefix is not None:
                    batch.shared_prefix.refresh(batch.kv_indptr, batch.seq_lens)
            logits = (eager or self.engine.run_model)(batch)
            self.engine.record_forward(step.num_tokens)
            return logits
        self.engine.record_forward(step.num_tokens)
        rows = step.logits_rows()
        if rows is not None:
            return logits[to_device(rows, logits.device)]
        return logits

    def sample(
        self, sampler: Sampler, logits: torch.Tensor, rows: np.ndarray | torch.Tensor,
        params: Sequence[SamplingParams], uids: Sequence[int], picks: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Samples a token for each page-table row of `rows` from its logits row (`picks`, else all of
        `logits` in order) on the device, records it as the row's next token (the next step's input) and
        starts its copy to the host; returns the host copy, to read once the step's work completed.

        `rows` already on the device (`upload`; a steady decode batch's) are not sent again.
        """
        table = self.engine.manager.table
        if isinstance(rows, np.ndarray):
            rows, *picked = table.upload([rows] if picks is None else [rows, picks])
            if picked:
                logits = logits[picked[0]]
        tokens = self.engine.sync_sampled(sampler.sample(logits, params, uids))  # tensor parallel: rank 0's
        table.set_next_tokens(rows, tokens)
        return copy_to_host(tokens)

    def score(
        self, logits: torch.Tensor, rows: np.ndarray, targets: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probability of each target token at its logits row and whether it is the greedy one,
        computed on the device; returns their host copies (`sample`'s lifetime)."""
        index, target = self.engine.manager.table.upload([rows, targets])
        logp, greedy = target_logprobs(logits, index, target, fixed_shape=self.engine.options.deterministic)
        return copy_to_host(logp.double()), copy_to_host(greedy)

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """`values` (int64) on the device, in the page table's staged copy."""
        return self.engine.manager.table.upload([values])[0]

    def prepare(self, step: StepRows) -> None:
        """Loads the inputs of a decode step that is to come (its ids excepted) while the GPU runs the
        current one, where a captured decode graph will replay it (see `DecodeGraphs.prepare`)."""
        if self.decode_graphs is not None and not self.released:
            self.decode_graphs.prepare(step)

    def _give_up_graphs(self, error: GraphCaptureError) -> None:
        """Every later step of this engine runs eagerly: its model's forward cannot be captured."""
        logger.warning(
            "hf_radix: %s cannot be captured in a CUDA graph (%s); its forwards run eagerly",
            type(self.engine.model).__name__, error,
        )
        for graphs in (self.decode_graphs, self.extend_graphs):
            if graphs is not None:
                graphs.release()
        self.decode_graphs = self.extend_graphs = None

    # -- warm-up -------------------------------------------------------------------------------------
    def ensure_warm(self) -> dict[str, float]:
        """`warm_up` once, where graphs are really captured (CUDA); later calls return at once.

        The first radix `generate` on an engine calls it: every decode and extend graph shape is captured
        and the eager kernels compiled in that call (seconds at 8B, reported in `warm_up_times`), so that
        no later call, of any batch size, pays a capture or a compile inline.
        """
        if self.captures and not self.warm_up_times:
            self.warm_up()
        return dict(self.warm_up_times)

    def warm_up(self) -> dict[str, float]:
        """Captures every graph shape and compiles the eager kernels now; returns the seconds each took.

        Runs on the page table's padding row only (every position the scratch slot), so it touches no
        cached K/V. `eager_s` is mostly Triton compiles; `capture_s` the graph captures. Nothing for a
        hybrid model (no graphs; a padding row has no state slot).
        """
        if self.engine.hybrid:
            return {}
        if self.warm_up_times:
            self._capture_all()
            return dict(self.warm_up_times)
        engine = self.engine
        sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
        started = time.perf_counter()
        width = engine.manager.table.width
        logits = None
        for lens in (*([tokens] for tokens in WARM_UP_TOKENS), WARM_UP_ROW_TOKENS):
            longest = max(lens)
            for prefix in {0, min(longest + 1, width - longest)}:
                if 0 <= prefix <= width - longest:
                    step = StepRows(
                        rows=np.full(len(lens), PADDING_ROW), prefix_lens=np.full(len(lens), prefix),
                        new_lens=np.array(lens), input_ids=np.zeros(sum(lens), dtype=np.int64),
                    )
                    logits = engine.run_model(eager_batch(engine, step))
        if logits is not None:
            warm_up_sampling(logits)
        self._warm_up_shared_prefix()
        sync()
        eager = time.perf_counter() - started
        self.warm_up_times = {"eager_s": eager, "capture_s": self._capture_all()}
        logger.info("hf_radix warm-up: %s", self.warm_up_times)
        return dict(self.warm_up_times)

    def _warm_up_shared_prefix(self) -> None:
        """Compiles the shared-prefix (or grouped) decode kernels: decodes of two padding rows sharing a
        prefix (`DecodePlanner.warm_up_plans`)."""
        if self.eager_shared is None:
            return
        engine = self.engine
        prefix = engine.page_size * max(1, 16 // engine.page_size)
        if prefix + 2 > engine.manager.table.width:
            return
        step = StepRows(rows=np.full(2, PADDING_ROW), prefix_lens=np.full(2, prefix + 1),
                        new_lens=np.ones(2, dtype=np.int64), input_ids=np.zeros(2, dtype=np.int64))
        for plan in self.eager_shared.warm_up_plans(step, prefix):
            batch = eager_batch(engine, step)
            batch.shared_prefix = plan
            plan.refresh(batch.kv_indptr, batch.seq_lens)
            engine.run_model(batch)

    def _capture_all(self) -> float:
        """Captures every shape not captured yet; returns the seconds it took."""
        capture = 0.0
        try:
            for graphs in (self.decode_graphs, self.extend_graphs):
                if graphs is not None:
                    before = graphs.capture_time
                    for key in graphs.shapes():
                        graphs.capture_shape(key)
                    capture += graphs.capture_time - before
        except GraphCaptureError as error:
            self._give_up_graphs(error)
        return capture


def copy_to_host(values: torch.Tensor) -> torch.Tensor:
    """Starts copying `values` to the host (pinned memory on CUDA); read it after the step's event."""
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def graph_memory_bytes(
    model: torch.nn.Module,
    dtype: torch.dtype,
    max_batch: int,
    kv_bound: int,
    extend_rows: int = EXTEND_GRAPH_ROWS,
    extend_tokens: int = EXTEND_GRAPH_TOKENS,
    state_layer_bytes: int = 0,
    piece: int | None = None,
) -> int:
    """An estimate of the GPU memory a model runner's graphs take once every shape is captured.

    The static metadata buffers (exact: decode graphs of `max_batch` rows, extend graphs of `extend_rows`
    rows and `extend_tokens` tokens, slot lists of up to `kv_bound` positions a row), plus the graphs'
    shared memory pool, which holds the largest captured forward's activations: per token the residual
    stream, the normed input, the attention projections and output, the MLP's gate, up and activation;
    the logits of every row (in the model's dtype and an fp32 upcast), the partial results of a
    shared-prefix decode (`MAX_PREFIX_SPLITS` per query head), deterministic mode's (`piece`: the keys a piece
    holds) a piece of `kv_bound` per query head; hybrid models: a state layer's states of
    every row three times (gathered, the layer's new ones, its output), `state_layer_bytes` a row. Twice
    that, for what the caching allocator rounds and keeps apart, plus `GRAPH_MEMORY_MARGIN`.
    """
    text = model.config.get_text_config(decoder=True)
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    element = torch.empty((), dtype=dtype).element_size()
    tokens, rows = max(max_batch, extend_tokens), max(max_batch, extend_rows)
    per_token = element * (4 * hidden + 3 * inter + (heads + 2 * kv_heads) * head_dim)
    parts, values = (MAX_PREFIX_SPLITS, head_dim + 1)  # fp32 outputs and log-sum-exps
    if piece is not None:
        parts, values = -(-kv_bound // piece), head_dim + 2  # fp32 accumulators, sums and maxima
    shared_partials = max_batch * heads * parts * values * 4
    activations = tokens * per_token + rows * text.vocab_size * (element + 4) + shared_partials
    activations += 3 * max_batch * state_layer_bytes
    static = static_buffer_bytes(max_batch, max_batch, kv_bound)
    static += static_buffer_bytes(extend_rows, extend_tokens, kv_bound)
    return static + 2 * activations + GRAPH_MEMORY_MARGIN
