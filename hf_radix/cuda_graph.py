"""Decode forwards captured in CUDA graphs: static metadata buffers, batch sizes padded to a few buckets.

Eager HF decode is launch-bound (tens of milliseconds a step at 8B whatever the batch); replaying a
captured graph removes that. Padded rows read and write one scratch slot outside the managed pool.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .forward_batch import ForwardBatch

if TYPE_CHECKING:
    from .engine import RadixEngine

logger = logging.getLogger(__name__)


MAX_KV_PER_ROW = 16384


def bucket_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: powers of two up to 16, then steps of 16."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captures one decode graph per bucket lazily and replays it with fresh metadata."""

    def __init__(self, engine: RadixEngine, max_batch: int, scratch_slot: int):
        self.engine = engine
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = max_batch
        self.scratch_slot = scratch_slot
        # Rows sharing a prefix list its slots once each, so a batch can index more slots than the pool has;
        # past this bound a step runs eagerly instead.
        self.max_kv = max_batch * min(engine.max_context, engine.pool.num_slots, MAX_KV_PER_ROW)
        device = engine.device
        mb = max_batch
        # One device buffer (and one pinned staging twin) per dtype, so each replay needs two copies.
        self._wide = torch.zeros(3 * mb + self.max_kv, dtype=torch.int64, device=device)
        self._wide_host = torch.zeros_like(self._wide, device="cpu").pin_memory()
        self._narrow = torch.zeros(mb + 1, dtype=torch.int32, device=device)
        self._narrow_host = torch.zeros_like(self._narrow, device="cpu").pin_memory()
        self._qo_indptr = torch.arange(mb + 1, dtype=torch.int32, device=device)
        self._logits_indices = torch.arange(mb, dtype=torch.int64, device=device)
        self._empty = torch.zeros(1, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket(self, batch_size: int) -> int | None:
        return next((s for s in self.sizes if s >= batch_size), None)

    def fits(self, batch_size: int, total_kv: int) -> bool:
        """Whether a decode step of `batch_size` rows reading `total_kv` slots can replay a graph."""
        bucket = self.bucket(batch_size)
        return bucket is not None and total_kv + bucket - batch_size <= self.max_kv

    def _batch(self, size: int) -> ForwardBatch:
        mb = self.max_batch
        wide = self._wide
        return ForwardBatch(
            input_ids=wide[:size],
            positions=wide[mb : mb + size],
            out_loc=wide[2 * mb : 2 * mb + size],
            qo_indptr=self._qo_indptr[: size + 1],
            prefix_lens=self._narrow[:size],  # unused by the decode kernel
            seq_lens=self._narrow[:size],
            kv_indices=wide[3 * mb :],
            kv_indptr=self._narrow[: size + 1],
            prefix_kv_indices=self._empty,
            prefix_kv_indptr=self._narrow[: size + 1],
            logits_indices=self._logits_indices[:size],
            qo_indptr_host=np.arange(size + 1),
            seq_lens_host=np.ones(size, dtype=np.int64),
            max_new_len=1,
            max_kv_len=min(self.engine.max_context, self.engine.pool.num_slots),
        )

    def _stage(
        self,
        size: int,
        token_ids: np.ndarray,
        positions: np.ndarray,
        out_loc: np.ndarray,
        kv_lists: Sequence[np.ndarray],
    ) -> None:
        """Writes padded metadata into the staging buffers and copies them to the device."""
        mb, real = self.max_batch, len(token_ids)
        wide = self._wide_host.numpy()
        narrow = self._narrow_host.numpy()
        pad = size - real
        wide[:real], wide[real:size] = token_ids, 0
        wide[mb : mb + real], wide[mb + real : mb + size] = positions, 0
        wide[2 * mb : 2 * mb + real], wide[2 * mb + real : 2 * mb + size] = out_loc, self.scratch_slot
        lengths = np.fromiter((len(k) for k in kv_lists), dtype=np.int64, count=real)
        total = int(lengths.sum())
        if total + pad > self.max_kv:
            raise RuntimeError("decode batch context exceeds the CUDA-graph buffers")
        kv_start = 3 * mb
        if real:
            wide[kv_start : kv_start + total] = np.concatenate(kv_lists)
        wide[kv_start + total : kv_start + total + pad] = self.scratch_slot
        narrow[0] = 0
        np.cumsum(np.concatenate([lengths, np.ones(pad, dtype=np.int64)]), out=narrow[1 : size + 1])
        used = kv_start + total + pad
        self._wide[:used].copy_(self._wide_host[:used], non_blocking=True)
        self._narrow[: size + 1].copy_(self._narrow_host[: size + 1], non_blocking=True)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        empty = np.zeros(0, dtype=np.int64)
        self._stage(size, empty, empty, empty, [])
        batch = self._batch(size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.engine.run_model(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.engine.run_model(batch)
        logger.info("captured a decode CUDA graph for batch size %d", size)
        return graph, logits

    def run(
        self, row_slots: Sequence[np.ndarray], token_ids: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """Decodes one token per row (`positions[i]`: where its new token goes); returns `[B, vocab]`."""
        size = self.bucket(len(token_ids))
        if size is None:
            raise ValueError(f"batch of {len(token_ids)} exceeds the captured maximum {self.max_batch}")
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, logits = self._graphs[size]
        positions = np.asarray(positions, dtype=np.int64)
        kv_lists = [slots[: p + 1] for slots, p in zip(row_slots, positions)]
        out_loc = np.fromiter(
            (slots[p] for slots, p in zip(row_slots, positions)), dtype=np.int64, count=len(positions)
        )
        self._stage(size, np.asarray(token_ids, dtype=np.int64), positions, out_loc, kv_lists)
        graph.replay()
        return logits[: len(token_ids)]
