"""Forwards captured in CUDA graphs: static metadata buffers, shapes padded to a few buckets.

Eager HF forwards of a few tokens are launch-bound (tens of milliseconds at 8B whatever the batch);
replaying a captured graph removes that. Two kinds:

* `DecodeGraphs`: one new token per row, rows padded to a bucket; a padded row is one token at the
  scratch slot (outside the managed pool) that attends to itself.
* `ExtendGraphs`: a few new tokens per row over cached prefixes (a question after a cached few-shot
  prefix), rows and tokens padded to buckets; padded rows are empty and the padded tokens form one extra
  row with no prefix, all writing the scratch slot.

Graphs are captured with the model's Llama-style norms and rotary embeddings swapped for single Triton
kernels (`fused_ops`). Off CUDA the same padded batches run eagerly, so the padding logic is exercised on
the CPU too.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.utils import logging

from .forward_batch import ForwardBatch, HostBatch, pack_batch, upload_batch
from .fused_ops import fused_norm_and_rope

if TYPE_CHECKING:
    from .engine import RadixEngine

logger = logging.get_logger(__name__)


MAX_KV_PER_ROW = 16384
EXTEND_TOKEN_BUCKETS = (16, 32, 64, 128, 256)
_EMPTY = np.zeros(0, dtype=np.int64)
_extend_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its ExtendGraphs


def bucket_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: powers of two up to 16, then steps of 16."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


def _bucket(sizes: Sequence[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


class _StagedBuffer:
    """A device index buffer with a pinned host twin: fill `host`, then `upload(n)` copies its first n."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        with torch.inference_mode(False):  # written later by calls in any grad mode
            self.device = torch.zeros(size, dtype=dtype, device=device)
            self._pinned = torch.zeros(size, dtype=dtype).pin_memory()
        self.host = self._pinned.numpy()

    def upload(self, n: int) -> None:
        self.device[:n].copy_(self._pinned[:n], non_blocking=True)


class _CapturedForwards(abc.ABC):
    """Shared machinery: static buffers, capture on first use of a shape, replay with fresh metadata.

    Static layout: int64 `[ids | positions | out_loc] x max_tokens, logits x max_rows, kv slots`, and
    int32 `qo_indptr, lens, kv_indptr` for up to `max_rows + 1` rows (the extra one holds padding).
    """

    #: the kernels read the slot lists of whole contexts (decode) or of cached prefixes (extend)
    decode: bool

    def __init__(self, engine: RadixEngine, max_rows: int, max_tokens: int):
        self.engine = engine
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.scratch_slot = engine.scratch_slot
        self.kv_bound = min(engine.max_context, engine.pool.num_slots)
        # Rows sharing a prefix list its slots once each, so a batch can index more slots than the pool has;
        # past this bound a forward runs eagerly instead.
        self.max_kv = max_rows * min(self.kv_bound, MAX_KV_PER_ROW)
        self.capture = engine.device.type == "cuda"
        self.replays = 0
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.capture:
            tm, rm = max_tokens, max_rows
            self._wide = _StagedBuffer(3 * tm + rm + self.max_kv, torch.int64, engine.device)
            self._narrow = _StagedBuffer(3 * (rm + 1) + 2, torch.int32, engine.device)
            self._pool = torch.cuda.graph_pool_handle()
            # name -> (buffer, offset) of each static metadata array
            self._segments: dict[str, tuple[_StagedBuffer, int]] = {
                "input_ids": (self._wide, 0),
                "positions": (self._wide, tm),
                "out_loc": (self._wide, 2 * tm),
                "logits_indices": (self._wide, 3 * tm),
                "kv": (self._wide, 3 * tm + rm),
                "qo_indptr": (self._narrow, 0),
                "lens": (self._narrow, rm + 2),
                "kv_indptr": (self._narrow, 2 * rm + 3),
            }

    # -- the static batch of one shape -------------------------------------------------------------------
    def _view(self, name: str, n: int | None) -> torch.Tensor:
        buffer, start = self._segments[name]
        return buffer.device[start:] if n is None else buffer.device[start : start + n]

    def _static_batch(self, rows: int, tokens: int, logits: int) -> ForwardBatch:
        """The batch a graph of `rows` rows (padding row included) and `tokens` tokens is captured with."""
        lens, kv_indptr = self._view("lens", rows), self._view("kv_indptr", rows + 1)
        kv = self._view("kv", None)
        return ForwardBatch(
            input_ids=self._view("input_ids", tokens),
            positions=self._view("positions", tokens),
            out_loc=self._view("out_loc", tokens),
            qo_indptr=self._view("qo_indptr", rows + 1),
            prefix_lens=lens,
            seq_lens=lens,
            kv_indices=kv,
            kv_indptr=kv_indptr,
            prefix_kv_indices=kv,
            prefix_kv_indptr=kv_indptr,
            logits_indices=self._view("logits_indices", logits),
            qo_indptr_host=np.r_[np.arange(rows) if self.decode else np.zeros(rows, dtype=np.int64), tokens],
            seq_lens_host=np.ones(rows, dtype=np.int64),
            max_new_len=1 if self.decode else tokens,
            max_kv_len=self.kv_bound,
        )

    def _stage(self, host: HostBatch) -> None:
        """Writes a padded batch's metadata into the staging buffers and copies them to the device."""
        arrays = {
            "input_ids": host.input_ids,
            "positions": host.positions,
            "out_loc": host.out_loc,
            "logits_indices": host.logits_indices,
            "kv": host.kv_indices if self.decode else host.prefix_kv_indices,
            "qo_indptr": host.qo_indptr,
            "lens": host.seq_lens if self.decode else host.prefix_lens,
            "kv_indptr": host.kv_indptr if self.decode else host.prefix_kv_indptr,
        }
        for name, values in arrays.items():
            buffer, start = self._segments[name]
            buffer.host[start : start + len(values)] = values
        self._wide.upload(self._segments["kv"][1] + len(arrays["kv"]))
        self._narrow.upload(len(self._narrow.host))

    # -- running -----------------------------------------------------------------------------------------
    def _run(self, key: tuple[int, int], host: HostBatch, real_rows: int) -> torch.Tensor:
        """Runs a padded batch (its graph, captured on first use; eagerly off CUDA); real rows' logits."""
        self.replays += 1
        if not self.capture:
            return self.engine.run_model(upload_batch(host, self.engine.device))[:real_rows]
        if key not in self._graphs:
            self._graphs[key] = self._capture(key, host)
        graph, logits = self._graphs[key]
        self._stage(host)
        graph.replay()
        return logits[:real_rows]

    def _capture(self, key: tuple[int, int], host: HostBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        rows, tokens = len(host.qo_indptr) - 1, len(host.input_ids)
        batch = self._static_batch(rows, tokens, len(host.logits_indices))
        self._stage(self._padding_only(key))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with fused_norm_and_rope(self.engine.model) as fused:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.engine.run_model(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.engine.run_model(batch)
        logger.info("captured a %s CUDA graph for %s (%d norm/rope swaps)", type(self).__name__, key, fused)
        return graph, logits

    @abc.abstractmethod
    def _padding_only(self, key: tuple[int, int]) -> HostBatch:
        """A batch of the shape `key` made of padding alone (what a graph is captured with)."""


class DecodeGraphs(_CapturedForwards):
    """Decode steps (one new token per row) replayed from graphs captured per padded batch size."""

    decode = True

    def __init__(self, engine: RadixEngine, max_batch: int):
        super().__init__(engine, max_batch, max_batch)
        self.sizes = bucket_sizes(max_batch)

    def fits(self, batch_size: int, total_kv: int) -> bool:
        """Whether a decode step of `batch_size` rows reading `total_kv` slots can replay a graph."""
        bucket = _bucket(self.sizes, batch_size)
        return bucket is not None and total_kv + bucket - batch_size <= self.max_kv

    def _pad(self, size: int, row_slots, token_ids, positions) -> HostBatch:
        pad = size - len(token_ids)
        scratch = np.array([self.scratch_slot])
        return pack_batch(
            [*row_slots, *[scratch] * pad],
            [np.array([t]) for t in token_ids] + [np.zeros(1, dtype=np.int64)] * pad,
            [*positions, *[0] * pad],
            None,
            prefix_context=not self.capture,
        )

    def _padding_only(self, key: tuple[int, int]) -> HostBatch:
        return self._pad(key[0], [], [], [])

    def run(
        self, row_slots: Sequence[np.ndarray], token_ids: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """Decodes one token per row (`positions[i]`: where its new token goes); returns `[B, vocab]`."""
        if not self.fits(len(token_ids), sum(p + 1 for p in positions)):
            raise ValueError(f"a decode batch of {len(token_ids)} rows does not fit the captured graphs")
        size = _bucket(self.sizes, len(token_ids))
        host = self._pad(size, row_slots, token_ids, positions)
        return self._run((size, size), host, len(token_ids))


class ExtendGraphs(_CapturedForwards):
    """Short extends (a few new tokens per row after a cached prefix) replayed from captured graphs."""

    decode = False

    def __init__(self, engine: RadixEngine, max_rows: int = 8, max_tokens: int = EXTEND_TOKEN_BUCKETS[-1]):
        super().__init__(engine, max_rows, max_tokens)
        self.row_sizes = bucket_sizes(max_rows)
        self.token_sizes = sorted({t for t in EXTEND_TOKEN_BUCKETS if t < max_tokens} | {max_tokens})

    def fits(self, rows: int, new_tokens: int, prefix_tokens: int) -> bool:
        """Whether `rows` rows adding `new_tokens` tokens after `prefix_tokens` cached ones can replay."""
        return rows <= self.max_rows and new_tokens <= self.max_tokens and prefix_tokens <= self.max_kv

    def _pad(self, rows: int, tokens: int, row_slots, new_token_ids, prefix_lens) -> HostBatch:
        empty = rows - len(new_token_ids)
        pad = tokens - sum(len(t) for t in new_token_ids)
        host = pack_batch(
            [*row_slots, *[_EMPTY] * empty, np.full(pad, self.scratch_slot, dtype=np.int64)],
            [*new_token_ids, *[_EMPTY] * empty, np.zeros(pad, dtype=np.int64)],
            [*prefix_lens, *[0] * (empty + 1)],
            [*[np.array([len(t) - 1]) for t in new_token_ids], *[np.zeros(1, dtype=np.int64)] * empty,
             _EMPTY],
            whole_context=not self.capture,
        )
        np.clip(host.logits_indices, 0, tokens - 1, out=host.logits_indices)  # empty rows: any real index
        return host

    def _padding_only(self, key: tuple[int, int]) -> HostBatch:
        return self._pad(key[0], key[1], [], [], [])

    def run(
        self, row_slots: Sequence[np.ndarray], new_token_ids: Sequence[np.ndarray], prefix_lens: Sequence[int]
    ) -> torch.Tensor:
        """Computes each row's new tokens after its cached prefix; returns `[B, vocab]` (last tokens)."""
        new = sum(len(t) for t in new_token_ids)
        if min(map(len, new_token_ids), default=0) == 0 or not self.fits(len(new_token_ids), new,
                                                                         sum(prefix_lens)):
            raise ValueError("an extend batch with an empty row or past the captured shapes cannot replay")
        key = (_bucket(self.row_sizes, len(new_token_ids)), _bucket(self.token_sizes, new))
        host = self._pad(*key, row_slots, new_token_ids, prefix_lens)
        return self._run(key, host, len(new_token_ids))


def shared_extend_graphs(engine: RadixEngine) -> ExtendGraphs:
    """The engine's ExtendGraphs, shared by generate and the runner so each shape is captured once."""
    graphs = _extend_graphs.get(engine)
    if graphs is None:
        graphs = _extend_graphs[engine] = ExtendGraphs(engine)
    return graphs
